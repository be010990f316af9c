"""The embedded proxy over real sockets, against small fake upstreams.

Two kinds of upstream: `AppUpstream` (an aiohttp server with a per-test handler)
and `RawUpstream` (asyncio streams, for byte-exact misbehaviour: drops before
headers, drops mid-body, hand-written hop-by-hop headers).
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web

from orchestrator.config import Settings
from orchestrator.errors import OrchError
from orchestrator.routing.backends import Backend, ReadyBackends
from tests.fakes import RecordingBackends
from tests.harness import free_port
from orchestrator.dataplane.embedded import EmbeddedProxy

pytestmark = pytest.mark.unit


# --- fixtures ----------------------------------------------------------------------

class AppUpstream:
    def __init__(self, handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]] | None = None):
        self.handler = handler or self.ok
        self.requests: list[dict] = []
        self.runner: web.ServerRunner | None = None
        self.port = 0

    async def ok(self, request: web.BaseRequest) -> web.StreamResponse:
        return web.json_response({"port": self.port, "path": request.path})

    async def _entry(self, request: web.BaseRequest) -> web.StreamResponse:
        body = await request.read()
        self.requests.append({"method": request.method, "path": request.raw_path, "body": body,
                              "headers": request.headers.copy()})
        return await self.handler(request)

    async def start(self) -> "AppUpstream":
        self.runner = web.ServerRunner(web.Server(self._entry, handler_cancellation=True, access_log=None))
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]
        return self

    async def close(self) -> None:
        if self.runner:
            await self.runner.cleanup()


class RawUpstream:
    """Reads one request (headers + Content-Length body), then runs `script(reader, writer, head, body)`."""

    def __init__(self, script):
        self.script = script
        self.requests: list[tuple[bytes, bytes]] = []
        self.server: asyncio.base_events.Server | None = None
        self.port = 0
        self.tasks: list[asyncio.Task] = []

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.tasks.append(asyncio.current_task())
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                body = await reader.readexactly(length)
                self.requests.append((head, body))
                if not await self.script(reader, writer, head, body):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def start(self) -> "RawUpstream":
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        self.server.close()
        for t in self.tasks:
            t.cancel()


def backend(i: int, port: int) -> Backend:
    return Backend(str(i), "127.0.0.1", port, 1, 2)


class Harness:
    def __init__(self) -> None:
        self.backends = RecordingBackends()
        self.failures = self.backends.failures
        self.successes = self.backends.successes
        self.proxy: EmbeddedProxy | None = None
        self.session: aiohttp.ClientSession | None = None
        self.cleanups: list = []

    async def start(self, **settings) -> EmbeddedProxy:
        base = dict(listen="127.0.0.1:0", metrics_listen="127.0.0.1:0", connect_timeout_s=1.0,
                    idle_timeout_s=5.0)
        base.update(settings)
        self.proxy = EmbeddedProxy(Settings(**base), self.backends)
        await self.proxy.start()
        self.session = aiohttp.ClientSession()
        return self.proxy

    def publish(self, *ups) -> None:
        self.backends.publish(tuple(backend(i, u if isinstance(u, int) else u.port) for i, u in enumerate(ups)))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.proxy.bound_port}"

    async def metrics(self) -> str:
        async with self.session.get(f"http://127.0.0.1:{self.proxy.metrics_port}/metrics") as r:
            return await r.text()

    async def raw(self, data: bytes, read_timeout: float = 3.0) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.proxy.bound_port)
        writer.write(data)
        await writer.drain()
        try:
            return await asyncio.wait_for(reader.read(), read_timeout)
        except (ConnectionError, asyncio.TimeoutError):
            return b""
        finally:
            writer.close()

    async def still_serving(self) -> None:
        async with self.session.get(self.url + "/v2/health/live") as r:
            assert r.status == 200


@pytest.fixture
async def h():
    harness = Harness()
    yield harness
    if harness.session:
        await harness.session.close()
    if harness.proxy:
        await harness.proxy.stop(grace_s=0.5)
    for c in harness.cleanups:
        await c.close()


async def up(h: Harness, handler=None) -> AppUpstream:
    u = await AppUpstream(handler).start()
    h.cleanups.append(u)
    return u


async def raw_up(h: Harness, script) -> RawUpstream:
    u = await RawUpstream(script).start()
    h.cleanups.append(u)
    return u


INFER = "/v2/models/m/infer"


# --- routing -----------------------------------------------------------------------

async def test_spread_over_two_upstreams_least_outstanding(h):
    a, b = await up(h), await up(h)
    await h.start()
    h.publish(a, b)
    for _ in range(40):
        async with h.session.post(h.url + INFER, data=b"{}") as r:
            assert r.status == 200
    assert len(a.requests) + len(b.requests) == 40
    assert len(a.requests) >= 5 and len(b.requests) >= 5  # ties broken at random


async def test_round_robin_alternates(h):
    a, b = await up(h), await up(h)
    await h.start(lb_policy="round-robin")
    h.publish(a, b)
    ports = []
    for _ in range(6):
        async with h.session.post(h.url + INFER, data=b"{}") as r:
            ports.append((await r.json())["port"])
    assert ports == [a.port, b.port] * 3


async def test_least_outstanding_avoids_busy_instance(h):
    release = asyncio.Event()

    async def maybe_slow(request):
        if await request.read() == b"block":
            await release.wait()
        return web.json_response({})

    a, b = await up(h, maybe_slow), await up(h, maybe_slow)
    await h.start()
    h.publish(a, b)
    pending = asyncio.create_task(h.session.post(h.url + INFER, data=b"block"))
    while not a.requests and not b.requests:
        await asyncio.sleep(0.01)
    busy, idle, busy_id = (a, b, "0") if a.requests else (b, a, "1")
    assert h.proxy.inflight()[busy_id] == 1
    for _ in range(10):
        async with h.session.post(h.url + INFER, data=b"{}") as r:
            assert r.status == 200
    assert len(idle.requests) == 10 and len(busy.requests) == 1
    release.set()
    (await pending).release()


async def test_path_normalised_and_query_forwarded(h):
    a = await up(h)
    await h.start()
    h.publish(a)
    async with h.session.post(h.url + "/v2//models/m/./infer/?x=1&y=%20", data=b"{}") as r:
        assert r.status == 200
    assert a.requests[0]["path"] == "/v2/models/m/infer?x=1&y=%20"


# --- streaming ---------------------------------------------------------------------

async def test_streaming_first_chunk_before_last_is_produced(h):
    go_on = asyncio.Event()

    async def sse(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"t": 1}\n\n')
        await asyncio.wait_for(go_on.wait(), 5)  # the last chunk waits for the client
        await resp.write(b'data: {"t": 2}\n\n')
        await resp.write_eof()
        return resp

    a = await up(h, sse)
    await h.start()
    h.publish(a)
    async with h.session.post(h.url + "/v2/models/m/generate_stream", data=b"{}") as r:
        assert r.status == 200
        assert r.headers["Content-Type"] == "text/event-stream"
        assert r.headers["X-Accel-Buffering"] == "no"
        assert "Content-Length" not in r.headers
        first = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 3)
        assert first == b'data: {"t": 1}\n\n'
        go_on.set()
        rest = await r.content.read()
        assert rest == b'data: {"t": 2}\n\n'


async def test_large_response_streamed_with_length(h):
    big = b"x" * (2 * 1024 * 1024)

    async def large(request):
        return web.Response(body=big)

    a = await up(h, large)
    await h.start()
    h.publish(a)
    async with h.session.post(h.url + INFER, data=b"{}") as r:
        assert r.headers["Content-Length"] == str(len(big))
        assert await r.read() == big


# --- retries -----------------------------------------------------------------------

async def test_retry_on_refused_connection(h):
    live = await up(h)
    await h.start(lb_policy="round-robin")
    h.publish(free_port(), live)  # instance 0 refuses
    for _ in range(4):
        async with h.session.post(h.url + INFER, data=b'{"n": 1}') as r:
            assert r.status == 200
    assert len(live.requests) == 4
    assert ("0", "connect_refused") in h.failures
    text = await h.metrics()
    assert 'trtllm_orch_proxy_retries_total{instance="0",reason="connect_refused"}' in text


async def test_retry_on_drop_before_headers_keeps_body(h):
    async def drop(reader, writer, head, body):
        return False  # read the request, close without answering

    dropper = await raw_up(h, drop)
    live = await up(h)
    await h.start(lb_policy="round-robin")
    h.publish(dropper, live)
    payload = json.dumps({"text_input": "x" * 5000}).encode()
    async with h.session.post(h.url + "/v2/models/m/generate", data=payload) as r:
        assert r.status == 200
    assert dropper.requests[0][1] == payload
    assert live.requests[0]["body"] == payload
    assert ("0", "disconnected") in h.failures


async def test_no_retry_after_first_byte(h):
    async def cut(reader, writer, head, body):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n12\r\ndata: {\"t\": 1}\n\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.1)
        return False  # close mid-body

    cutter = await raw_up(h, cut)
    other = await up(h)
    await h.start(lb_policy="round-robin")
    h.publish(cutter, other)
    async with h.session.post(h.url + "/v2/models/m/generate_stream", data=b"{}") as r:
        assert r.status == 200
        first = await r.content.readuntil(b"\n\n")
        assert first == b'data: {"t": 1}\n\n'
        with pytest.raises(aiohttp.ClientPayloadError):
            await r.content.read()
    assert other.requests == []
    await h.still_serving()


async def test_all_attempts_fail_gives_502(h, caplog):
    await h.start(max_attempts=3)
    ports = (free_port(), free_port())
    h.publish(*ports)
    with caplog.at_level("WARNING"):
        async with h.session.post(h.url + INFER, data=b"{}") as r:
            assert r.status == 502
            body = await r.text()
    assert "error" in json.loads(body)
    assert len(h.failures) == 3  # two instances, three attempts
    # The log says what the OS said; the client learns no instance address.
    line = next(rec.getMessage() for rec in caplog.records if "attempt(s) failed" in rec.getMessage())
    assert "Connection refused" in line, line
    assert not any(str(p) in body for p in ports), body


async def test_5xx_passes_through_and_is_reported(h):
    async def boom(request):
        return web.json_response({"error": "model failed"}, status=500)

    a = await up(h, boom)
    await h.start()
    h.publish(a)
    async with h.session.post(h.url + INFER, data=b"{}") as r:
        assert r.status == 500
        assert await r.json() == {"error": "model failed"}
    assert len(a.requests) == 1
    assert h.failures == [("0", "http_500")]


async def test_header_timeout_is_504_without_retry(h):
    async def hang(request):
        await asyncio.sleep(30)

    a, b = await up(h, hang), await up(h, hang)
    await h.start(idle_timeout_s=0.3)
    h.publish(a, b)
    async with h.session.post(h.url + INFER, data=b"{}") as r:
        assert r.status == 504
    assert len(a.requests) + len(b.requests) == 1


async def test_idle_timeout_mid_stream_truncates(h):
    async def stall(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: 1\n\n")
        await asyncio.sleep(30)
        return resp

    a = await up(h, stall)
    await h.start(idle_timeout_s=0.3)
    h.publish(a)
    async with h.session.post(h.url + "/v2/models/m/generate_stream", data=b"{}") as r:
        assert await r.content.readuntil(b"\n\n") == b"data: 1\n\n"
        with pytest.raises(aiohttp.ClientPayloadError):
            await r.content.read()
    assert ("0", "idle_timeout") in h.failures


# --- local answers -----------------------------------------------------------------

async def test_503_with_retry_after_when_none_ready(h):
    a = await up(h)
    await h.start(hold_s=0.3)  # past the hold (tested elsewhere), the 503
    async with h.session.post(h.url + INFER, data=b"{}") as r:
        assert r.status == 503
        assert r.headers["Retry-After"]
        assert "error" in await r.json()
    async with h.session.get(h.url + "/v2/health/ready") as r:
        assert r.status == 503
    async with h.session.get(h.url + "/v2/health/live") as r:
        assert r.status == 200
    h.publish(a)
    async with h.session.get(h.url + "/v2/health/ready") as r:
        assert r.status == 200
    assert a.requests == []  # health is answered by the proxy itself


async def test_admin_forbidden_and_upstream_not_contacted(h):
    a = await up(h)
    await h.start()
    h.publish(a)
    for method, path in [("POST", "/v2/repository/models/m/load"), ("POST", "/v2/repository/index"),
                         ("POST", "/v2/logging"), ("GET", "/v2/models/m/config"),
                         ("POST", "/v2/systemsharedmemory/region/x/register"),
                         ("POST", "/v2/models/m/infer/../../../repository/index"),
                         ("POST", "/v2/models/m/%2e%2e/%2e%2e/repository/models/m/load")]:
        async with h.session.request(method, h.url + path, data=b"{}") as r:
            assert r.status == 403, path
            assert "error" in await r.json()
    for method, path, code in [("GET", "/metrics", 404), ("GET", "/", 404), ("GET", INFER, 405),
                               ("GET", "/v2/models/a%2Fb/infer", 400)]:
        async with h.session.request(method, h.url + path) as r:
            assert r.status == code, path
    async with h.session.get(h.url + INFER) as r:
        assert r.headers["Allow"] == "POST"
    assert a.requests == []


async def test_admin_forwarded_when_allowed(h):
    a = await up(h)
    await h.start(allow_admin=True)
    h.publish(a)
    async with h.session.post(h.url + "/v2/repository/index", data=b"{}") as r:
        assert r.status == 200
    assert a.requests[0]["path"] == "/v2/repository/index"


# --- header hygiene ----------------------------------------------------------------

async def test_xff_spoofing_dropped(h):
    a = await up(h)
    await h.start()
    h.publish(a)
    async with h.session.post(h.url + INFER, data=b"{}",
                              headers={"X-Forwarded-For": "6.6.6.6", "Forwarded": "for=6.6.6.6"}):
        pass
    seen = a.requests[0]["headers"]
    assert seen.getall("X-Forwarded-For") == ["127.0.0.1"]
    assert "Forwarded" not in seen
    assert seen["X-Forwarded-Proto"] == "http"


async def test_xff_appended_for_trusted_peer(h):
    a = await up(h)
    await h.start(trusted_proxy=("127.0.0.1",))
    h.publish(a)
    async with h.session.post(h.url + INFER, data=b"{}", headers={"X-Forwarded-For": "6.6.6.6"}):
        pass
    assert a.requests[0]["headers"]["X-Forwarded-For"] == "6.6.6.6, 127.0.0.1"


async def test_hop_by_hop_stripped_both_ways(h):
    async def answer(reader, writer, head, body):
        payload = b'{"ok": true}'
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Connection: keep-alive, X-Upstream-Private\r\nX-Upstream-Private: 1\r\n"
                     b"Keep-Alive: timeout=5\r\nProxy-Authenticate: Basic\r\nUpgrade: h2c\r\n"
                     b"X-Kept: yes\r\nContent-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        await writer.drain()
        return True

    raw = await raw_up(h, answer)
    await h.start()
    h.publish(raw)
    async with h.session.post(h.url + INFER, data=b"{}",
                              headers={"Connection": "keep-alive, X-Client-Private", "X-Client-Private": "1",
                                       "Keep-Alive": "timeout=5", "TE": "trailers", "Upgrade": "websocket",
                                       "Proxy-Authorization": "Basic eA==", "X-Kept": "yes"}) as r:
        assert await r.json() == {"ok": True}
        for name in ("X-Upstream-Private", "Keep-Alive", "Proxy-Authenticate", "Upgrade"):
            assert name not in r.headers, name
        assert r.headers["X-Kept"] == "yes"
    head = raw.requests[0][0].decode().lower()
    for name in ("x-client-private", "keep-alive:", "te:", "upgrade", "proxy-authorization"):
        assert name not in head, name
    assert "x-kept: yes" in head


# --- limits and malformed input ----------------------------------------------------

async def test_413_on_big_body(h):
    a = await up(h)
    await h.start(max_body_bytes=1000)
    h.publish(a)
    async with h.session.post(h.url + INFER, data=b"x" * 1001) as r:
        assert r.status == 413
    async def chunks():
        for _ in range(20):
            yield b"x" * 100
    async with h.session.post(h.url + INFER, data=chunks()) as r:  # chunked, no Content-Length
        assert r.status == 413
    async with h.session.post(h.url + INFER, data=b"x" * 1000) as r:
        assert r.status == 200
    assert len(a.requests) == 1
    await h.still_serving()


async def test_expect_100_continue(h):
    a = await up(h)
    await h.start()
    h.publish(a)
    out = await h.raw(b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                      b"Expect: 100-continue\r\nConnection: close\r\n\r\n{}")
    assert out.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200")
    assert "Expect" not in a.requests[0]["headers"]


@pytest.mark.parametrize("data", [
    b"GARBAGE\r\n\r\n",
    b"GET /v2 HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n",
    b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n",
    b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab",
    b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc",
    b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # a TLS ClientHello
    b"GET /v2/models/m HTTP/1.1\r\nHost: x\r\n\x00\r\n\r\n",
])
async def test_malformed_input_leaves_proxy_serving(h, data):
    a = await up(h)
    await h.start()
    h.publish(a)
    out = await h.raw(data, read_timeout=1.5)
    assert out == b"" or out.startswith((b"HTTP/1.1 4", b"HTTP/1.0 4")), out[:80]
    assert not any(r["path"].startswith("/v2/models/m/infer") and r["body"] not in (b"",)
                   for r in a.requests if r["method"] == "POST")
    await h.still_serving()
    async with h.session.post(h.url + INFER, data=b"{}") as r:
        assert r.status == 200
    assert h.proxy.inflight() == {"0": 0}


async def test_client_disconnect_cancels_upstream(h):
    upstream_saw_close = asyncio.Event()

    async def stream_until_closed(reader, writer, head, body):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n")
        await writer.drain()
        if await reader.read(1) == b"":  # the proxy closed its side
            upstream_saw_close.set()
        return False

    raw = await raw_up(h, stream_until_closed)
    await h.start()
    h.publish(raw)
    reader, writer = await asyncio.open_connection("127.0.0.1", h.proxy.bound_port)
    writer.write(b"POST /v2/models/m/generate_stream HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
    await writer.drain()
    got = b""
    while b"data: 1" not in got:
        got += await asyncio.wait_for(reader.read(1024), 3)
    writer.close()
    await asyncio.wait_for(upstream_saw_close.wait(), 3)
    for _ in range(50):
        if h.proxy.inflight() == {"0": 0}:
            break
        await asyncio.sleep(0.02)
    assert h.proxy.inflight() == {"0": 0}
    await h.still_serving()


async def test_client_disconnect_while_waiting_for_headers_cancels_upstream(h):
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def slow(request):
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    a = await up(h, slow)
    await h.start()
    h.publish(a)
    reader, writer = await asyncio.open_connection("127.0.0.1", h.proxy.bound_port)
    writer.write(b"POST /v2/models/m/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
    await writer.drain()
    await asyncio.wait_for(started.wait(), 3)
    writer.close()
    await asyncio.wait_for(cancelled.wait(), 3)


# --- metrics and lifecycle ---------------------------------------------------------

async def test_metrics(h):
    a = await up(h)
    await h.start()
    h.publish(a)
    async with h.session.post(h.url + INFER, data=b"{}") as r:
        assert r.status == 200
    async with h.session.post(h.url + "/v2/repository/index") as r:
        assert r.status == 403
    text = await h.metrics()
    assert 'trtllm_orch_proxy_requests_total{code="200",instance="0"} 1.0' in text
    assert 'trtllm_orch_proxy_requests_total{code="403",instance="none"} 1.0' in text
    assert 'trtllm_orch_proxy_upstream_latency_seconds_count{instance="0"} 1.0' in text
    assert "trtllm_orch_proxy_ready_instances 1.0" in text
    assert 'trtllm_orch_proxy_instance_ready{instance="0"} 1.0' in text
    assert 'trtllm_orch_proxy_inflight_requests{instance="0"} 0.0' in text
    h.publish()
    text = await h.metrics()
    assert 'trtllm_orch_proxy_instance_ready{instance="0"} 0.0' in text
    async with h.session.get(f"http://127.0.0.1:{h.proxy.metrics_port}/other") as r:
        assert r.status == 404


async def test_metrics_off(h):
    await h.start(metrics_listen="")
    assert h.proxy.metrics_port == 0


async def test_bind_failure_names_address():
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        p = EmbeddedProxy(Settings(listen=f"127.0.0.1:{port}", metrics_listen=""), ReadyBackends())
        with pytest.raises(OrchError, match=f"127.0.0.1:{port}"):
            await p.start()
        p2 = EmbeddedProxy(Settings(listen="127.0.0.1:0", metrics_listen=f"127.0.0.1:{port}"),
                           ReadyBackends())
        with pytest.raises(OrchError, match="--metrics-listen"):
            await p2.start()
    finally:
        busy.close()


async def test_stop_lets_inflight_finish_then_cancels():
    backends = ReadyBackends()
    finish = asyncio.Event()

    async def slow(request):
        await finish.wait()
        return web.json_response({"done": True})

    a = await AppUpstream(slow).start()
    try:
        backends.publish((backend(0, a.port),))
        proxy = EmbeddedProxy(Settings(listen="127.0.0.1:0", metrics_listen=""), backends)
        await proxy.start()
        port = proxy.bound_port
        async with aiohttp.ClientSession() as s:
            req = asyncio.create_task(s.post(f"http://127.0.0.1:{port}{INFER}", data=b"{}"))
            while not a.requests:
                await asyncio.sleep(0.01)
            stopper = asyncio.create_task(proxy.stop(grace_s=5))
            await asyncio.sleep(0.2)
            with pytest.raises(aiohttp.ClientConnectionError):  # no longer accepting
                await s.get(f"http://127.0.0.1:{port}/v2/health/live")
            finish.set()
            r = await req
            assert r.status == 200 and await r.json() == {"done": True}
            await asyncio.wait_for(stopper, 3)
        # a request that outlives the grace is cancelled
        finish.clear()
        proxy = EmbeddedProxy(Settings(listen="127.0.0.1:0", metrics_listen=""), backends)
        await proxy.start()
        async with aiohttp.ClientSession() as s:
            req = asyncio.create_task(s.post(f"http://127.0.0.1:{proxy.bound_port}{INFER}", data=b"{}"))
            n = len(a.requests)
            while len(a.requests) == n:
                await asyncio.sleep(0.01)
            await asyncio.wait_for(proxy.stop(grace_s=0.2), 3)
            with pytest.raises(aiohttp.ClientError):
                r = await req
                await r.read()
        assert proxy.inflight() == {"0": 0}
    finally:
        await a.close()
