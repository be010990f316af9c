"""The fast lane (orchestrator/dataplane/fast_lane.py) on a real EmbeddedProxy, on loopback:
native inference requests answered without aiohttp's request machinery, everything else
handed to aiohttp on the same connection, pipelining, slow clients, a client that leaves,
and a stop that lets a request in flight finish."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from orchestrator.config import Settings
from orchestrator.dataplane.embedded import EmbeddedProxy
from orchestrator.dataplane.fast_lane import parse_head
from orchestrator.routing.backends import Backend, ReadyBackends
from tests.test_proxy_slow_clients import DEADLINE_S, TRICKLE_EVERY_S, TRICKLE_PIECES, read_to_eof

pytestmark = pytest.mark.unit

GEN = "/v2/models/m/generate"


class Upstream:
    """An instance: echoes each body; a `slow` body streams SSE until the client leaves."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.stream_closed = asyncio.Event()
        self.release = asyncio.Event()

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        body = await request.read()
        self.bodies.append(body)
        if body == b"slow":
            await self.release.wait()
            return web.json_response({"echo": "slow"})
        if body == b"stream":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            try:
                while True:
                    await resp.write(b'data: {"text_output":"x"}\n\n')
                    await asyncio.sleep(0.02)
            except (ConnectionError, asyncio.CancelledError):
                self.stream_closed.set()
                raise
        return web.json_response({"echo": body.decode()})


@pytest.fixture
async def lane():
    up = Upstream()
    runner = web.ServerRunner(web.Server(up.handle, access_log=None))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    ready = ReadyBackends()
    ready.publish((Backend("0", "127.0.0.1", runner.addresses[0][1], 1, 2),))
    proxy = EmbeddedProxy(Settings(listen="127.0.0.1:0", metrics_listen="", client_header_timeout_s=DEADLINE_S,
                                   client_body_timeout_s=DEADLINE_S, max_body_bytes=1000), ready)
    served: list[str] = []
    serve = proxy._serve_fast

    async def counted(request, route):
        served.append(request.path)
        return await serve(request, route)

    proxy._serve_fast = counted  # type: ignore[method-assign]
    await proxy.start()
    yield proxy, up, served
    await proxy.stop(grace_s=2.0)
    await runner.cleanup()


def post(body: bytes, path: str = GEN, extra: bytes = b"") -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n%s\r\n%s" % (path.encode(), len(body), extra, body)


async def answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One response (Content-Length or chunked): its status and body."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    status = int(head.split(b" ")[1])
    lines = head.lower().split(b"\r\n")
    length = [ln for ln in lines if ln.startswith(b"content-length:")]
    if length:
        return status, await reader.readexactly(int(length[0].split(b":")[1]))
    assert b"transfer-encoding: chunked" in lines, head
    body = b""
    while True:
        size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
        chunk = await reader.readexactly(size + 2)
        if size == 0:
            return status, body
        body += chunk[:-2]


async def test_lane_and_aiohttp_answer_on_one_connection(lane):
    proxy, up, served = lane
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.bound_port)
    try:
        writer.write(post(b"one"))
        assert await answer(reader) == (200, b'{"echo": "one"}')
        writer.write(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n")  # aiohttp's from here on
        assert (await answer(reader))[0] == 200
        writer.write(post(b"two"))
        assert await answer(reader) == (200, b'{"echo": "two"}')
    finally:
        writer.close()
    assert served == [GEN] and up.bodies == [b"one", b"two"]


async def test_pipelined_requests_are_answered_in_order(lane):
    proxy, up, served = lane
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.bound_port)
    try:
        writer.write(post(b"a") + post(b"b") + post(b"c"))
        assert [await answer(reader) for _ in range(3)] == [
            (200, b'{"echo": "a"}'), (200, b'{"echo": "b"}'), (200, b'{"echo": "c"}')]
        # A head split in pieces and a body after it are one request all the same.
        for piece in (post(b"d")[:10], post(b"d")[10:30], post(b"d")[30:]):
            writer.write(piece)
            await asyncio.sleep(0.05)
        assert await answer(reader) == (200, b'{"echo": "d"}')
    finally:
        writer.close()
    assert len(served) == 4


async def test_what_the_lane_does_not_take_aiohttp_answers(lane):
    proxy, up, served = lane
    for request, status in ((post(b"x" * 1001), 413),  # over --max-body-bytes
                            (post(b"{}", "/v2/repository/index"), 403),  # the admin API
                            (b"PUT /v2/models/m/generate HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n", 405),
                            (b"POST /v2/models/m/generate HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked"
                             b"\r\n\r\n3\r\nabc\r\n0\r\n\r\n", 200)):
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.bound_port)
        try:
            writer.write(request)
            assert (await answer(reader))[0] == status, request[:40]
        finally:
            writer.close()
    assert served == [] and up.bodies == [b"abc"]


async def test_a_keep_alive_lane_connection_idles_and_a_trickled_head_is_cut(lane):
    proxy, _, _ = lane
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.bound_port)
    try:
        writer.write(post(b"1"))
        assert (await answer(reader))[0] == 200
        await asyncio.sleep(2 * DEADLINE_S)  # idle keep-alive is not a slow head
        writer.write(post(b"2"))
        assert (await answer(reader))[0] == 200
        writer.write(b"POST /v2/models/m/generate HTTP/1.1\r\n")
        cut = asyncio.ensure_future(read_to_eof(reader))
        for _ in range(TRICKLE_PIECES):
            done, _ = await asyncio.wait({cut}, timeout=TRICKLE_EVERY_S)
            if done:
                break
            writer.write(b"X-Slow: 1\r\n")
        assert cut.done() and (cut.result() == b"" or cut.result().startswith(b"HTTP/1.1 408")), "never cut"
        # A body that trickles after a whole head is cut too.
        reader, writer2 = await asyncio.open_connection("127.0.0.1", proxy.bound_port)
        writer2.write(b"POST /v2/models/m/generate HTTP/1.1\r\nHost: t\r\nContent-Length: 500\r\n\r\nxx")
        got = await asyncio.wait_for(read_to_eof(reader), DEADLINE_S * 10)
        assert got.startswith(b"HTTP/1.1 408"), got
        writer2.close()
    finally:
        writer.close()


async def test_a_client_that_leaves_mid_stream_closes_the_instance_side(lane):
    proxy, up, _ = lane
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.bound_port)
    writer.write(post(b"stream", "/v2/models/m/generate_stream"))
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head
    assert b"data:" in await asyncio.wait_for(reader.readuntil(b"\n\n"), 5)
    writer.close()
    await asyncio.wait_for(up.stream_closed.wait(), 5)  # the instance sees the cancel


async def test_stop_lets_a_lane_request_in_flight_finish(lane):
    proxy, up, _ = lane
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.bound_port)
    try:
        writer.write(post(b"slow"))
        while b"slow" not in up.bodies:
            await asyncio.sleep(0.01)
        stopping = asyncio.ensure_future(proxy.stop(grace_s=5.0))
        await asyncio.sleep(0.2)
        up.release.set()
        status, body = await answer(reader)
        assert (status, json.loads(body)) == (200, {"echo": "slow"})
        assert await asyncio.wait_for(read_to_eof(reader), 5) == b""  # then the connection closes
        await stopping
    finally:
        writer.close()


def test_parse_head_reads_what_the_lane_needs_and_refuses_garbage():
    method, target, version, headers, keep_alive = parse_head(
        b"POST /v2/x?y=1 HTTP/1.0\r\nContent-Length: 2\r\nX-A: b\r\n\r\n")  # type: ignore[misc]
    assert (method, target, version, headers["X-A"], keep_alive) == ("POST", "/v2/x?y=1", (1, 0), "b", False)
    assert parse_head(b"NOT HTTP AT ALL\r\n\r\n") is None


def test_connection_close_is_kept_for_a_request_without_a_body():
    # llhttp completes a bodiless message inside the feed and resets its flags.
    assert parse_head(b"GET /v2 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")[4] is False  # type: ignore[index]
    assert parse_head(b"GET /v2 HTTP/1.1\r\nHost: x\r\n\r\n")[4] is True  # type: ignore[index]
