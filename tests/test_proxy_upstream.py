"""The embedded proxy's upstream client (orchestrator/dataplane/upstream.py) against raw sockets:
keep-alive reuse, framing (length, chunked, until close, HEAD, interim 1xx), the
per-instance connection cap, the idle timeout before and after the head, and backpressure."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from orchestrator.dataplane.upstream import (BadResponse, ConnectFailed, Disconnected, HeadTimeout, UpstreamPool)

pytestmark = pytest.mark.unit


class Raw:
    """An upstream that answers each request head (+ Content-Length body) with `answer(head)`."""

    def __init__(self, answer, keep_open: bool = True) -> None:
        self.answer = answer
        self.keep_open = keep_open
        self.connections = 0
        self.heads: list[bytes] = []
        self.closed = asyncio.Event()

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                self.heads.append(head)
                out = self.answer(head)
                if asyncio.iscoroutine(out):
                    out = await out
                if out is SILENT:
                    await reader.read()  # never answer; returns at the client's close
                    break
                if out is None:
                    break
                writer.write(out)
                await writer.drain()
                if not self.keep_open:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed.set()
            writer.close()

    async def __aenter__(self) -> "Raw":
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()


SILENT = object()  # an answer: none, until the client closes


def ok(body: bytes = b"hello") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nX-A: 1\r\n\r\n%s" % (len(body), body)


async def request(pool: UpstreamPool, port: int, method: str = "POST", idle: float | None = 5.0, body=b"{}"):
    return await pool.request("127.0.0.1", port, method, "/v2/x?q=1", {"X-Forwarded-For": "1.2.3.4"}, body,
                              connect_timeout_s=1.0, idle_timeout_s=idle)


@pytest.fixture
async def pool():
    p = UpstreamPool(limit_per_host=2)
    yield p
    await p.close()


async def test_keep_alive_reuses_one_connection_and_sends_one_head(pool):
    async with Raw(lambda head: ok()) as up:
        for _ in range(3):
            r = await request(pool, up.port)
            assert (r.status, r.reason, r.headers["X-A"]) == (200, "OK", "1")
            assert await r.read() == b"hello"
            r.release()
        assert up.connections == 1
        head = up.heads[0].decode()
        assert head.startswith("POST /v2/x?q=1 HTTP/1.1\r\n")
        assert f"Host: 127.0.0.1:{up.port}\r\n" in head and "X-Forwarded-For: 1.2.3.4\r\n" in head
        assert "Content-Length: 2\r\n" in head


async def test_chunked_until_close_head_and_interim(pool):
    answers = iter([
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n",  # HEAD: no body whatever the length says
    ])
    async with Raw(lambda head: next(answers)) as up:
        r = await request(pool, up.port)
        assert await r.read() == b"abcde"
        r.release()
        r = await request(pool, up.port)
        assert r.status == 201 and await r.read() == b"ok"
        r.release()
        r = await request(pool, up.port, "HEAD")
        assert r.status == 200 and await r.read() == b""
        r.release()
        assert up.connections == 1
    async with Raw(lambda head: b"HTTP/1.1 200 OK\r\n\r\nuntil the close", keep_open=False) as up:
        r = await request(pool, up.port)
        assert await r.read() == b"until the close"
        r.release()


async def test_failures_before_the_head(pool):
    async with Raw(lambda head: None) as up:  # reads the request, closes without answering
        with pytest.raises(Disconnected):
            await request(pool, up.port)
    async with Raw(lambda head: b"garbage\r\n\r\n") as up:
        with pytest.raises(BadResponse):
            await request(pool, up.port)
    async with Raw(lambda head: SILENT) as up:
        with pytest.raises(HeadTimeout):
            await request(pool, up.port, idle=0.2)
        await asyncio.wait_for(up.closed.wait(), 3)  # the instance saw the close
    port = up.port
    with pytest.raises(ConnectFailed):
        await request(pool, port)
    assert pool.open_connections() == 0


async def test_body_failures_are_aiohttp_payload_and_timeout_errors(pool):
    async def stall(head):
        return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n"

    async with Raw(stall) as up:  # sends a chunk, then nothing
        r = await request(pool, up.port, idle=0.2)
        assert await r.content.readany() == b"ab"
        with pytest.raises(aiohttp.SocketTimeoutError):
            await r.content.readany()
        r.close()
    async with Raw(lambda head: b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", keep_open=False) as up:
        r = await request(pool, up.port)
        with pytest.raises(aiohttp.ClientPayloadError):
            await r.read()
        r.close()


async def test_connection_cap_makes_requests_wait(pool):
    release = asyncio.Event()

    async def slow(head):
        await release.wait()
        return ok()

    async with Raw(slow) as up:
        tasks = [asyncio.create_task(request(pool, up.port)) for _ in range(3)]
        await asyncio.sleep(0.2)
        assert up.connections == 2 and len(up.heads) == 2  # the third waits for a connection
        release.set()
        for t in tasks:
            r = await t
            assert await r.read() == b"hello"
            r.release()
        assert up.connections == 2 and len(up.heads) == 3


async def test_cancel_closes_the_connection(pool):
    async with Raw(lambda head: SILENT) as up:
        t = asyncio.create_task(request(pool, up.port))
        while not up.heads:
            await asyncio.sleep(0.01)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        await asyncio.wait_for(up.closed.wait(), 3)
        assert pool.open_connections() == 0


async def test_slow_reader_pauses_the_instance_without_timing_out(pool):
    big = b"x" * (4 * 1024 * 1024)
    async with Raw(lambda head: ok(big)) as up:
        r = await request(pool, up.port, idle=0.3)
        await asyncio.sleep(0.6)  # the relay is slow: reading is paused, the idle clock stops
        assert await r.read() == big
        r.release()


class Sink:
    """The client's side of a pipe: every write it got, and a buffer that can be made to look
    full (a client that does not read)."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.buffered = 0
        self.closing = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return self.buffered


async def piped(r, sink: Sink, framed: bool, head: bytes = b"", prefix: bytes = b"HEAD|") -> list[bytes]:
    seen: list[bytes] = []
    r.pipe(sink, framed, seen.append, head, prefix)
    assert await r.piped()
    return seen


async def test_pipe_sends_a_short_answer_in_one_write_head_body_and_last_chunk(pool):
    async with Raw(lambda head: b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                                b"6\r\ndata: \r\n3\r\nx\n\n\r\n0\r\n\r\n") as up:
        r = await request(pool, up.port)
        sink = Sink()
        seen = await piped(r, sink, framed=True)
        assert sink.writes == [b"HEAD|9\r\ndata: x\n\n\r\n0\r\n\r\n"]
        assert seen == [b"data: x\n\n"]
        r.release()  # read to its end: the connection is reused
        r = await request(pool, up.port)
        assert up.connections == 1
        r.close()


async def test_pipe_relays_each_read_as_it_comes_and_ends_a_body_delimited_by_the_close(pool):
    async def answer(head):
        return b"HTTP/1.1 200 OK\r\n\r\n"

    async with Raw(answer, keep_open=False) as up:
        r = await request(pool, up.port)
        sink = Sink()
        seen = await piped(r, sink, framed=True, head=b"early")
        # The head with what was read already; the end of the body (the close) is the last chunk.
        assert b"".join(sink.writes) == b"HEAD|5\r\nearly\r\n0\r\n\r\n" and seen == [b"early"]
    async with Raw(lambda head: ok(b"raw bytes")) as up:  # unframed: an HTTP/1.0 client
        r = await request(pool, up.port)
        sink = Sink()
        await piped(r, sink, framed=False, prefix=b"")
        assert sink.writes == [b"raw bytes"]
        r.release()


async def test_pipe_pauses_the_instance_while_the_client_is_full_and_fails_when_it_left(pool):
    more = asyncio.Event()
    closed = asyncio.Event()

    async def instance(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n")
        await more.wait()
        writer.write(b"1\r\nb\r\n")
        await reader.read()  # until the proxy closes its side
        closed.set()
        writer.close()

    server = await asyncio.start_server(instance, "127.0.0.1", 0)
    try:
        r = await request(pool, server.sockets[0].getsockname()[1])
        sink = Sink()
        sink.buffered = 10 * 1024 * 1024  # a client that reads nothing
        seen: list[bytes] = []
        r.pipe(sink, True, seen.append)
        # Paused: the caller drains the client, then resume(); no timeout meanwhile.
        assert await r.piped() is False
        sink.buffered = 0
        r.resume()
        sink.closing = True  # the client went away
        more.set()  # more of the answer arrives for it
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(r.piped(), 5)
        await asyncio.wait_for(closed.wait(), 5)  # the instance saw the close: it cancels the work
        assert b"".join(sink.writes) == b"1\r\na\r\n" and seen == [b"a"]
    finally:
        server.close()
