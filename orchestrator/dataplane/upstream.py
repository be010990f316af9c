"""The embedded proxy's HTTP/1.1 client for the instances: pooled keep-alive connections,
each an asyncio Protocol feeding httptools' response parser (llhttp, Node.js's parser).

Why not aiohttp's ClientSession, which this replaces: per request it builds a URL, a
ClientRequest, a writer task, a StreamReader and timer handles, runs tracing and cookie
hooks, and writes the head and the body separately; on the small `generate` calls that
dominate a proxy's CPU that was most of the proxy's own time (issue 12, bench/README.md).
Here a request is one `transport.write` of head + body, and the response is parsed as
it arrives into one small object.

What it keeps of aiohttp's client as the proxy used it:
- a pool per instance address (host, port), keep-alive up to KEEPALIVE_S idle, at most
  `limit_per_host` connections per instance (further requests wait for a free one);
- a connect timeout, and an idle timeout for the response head and between body reads
  (not a total: long generations are not cut; the clock stops while the client is the
  slow side and reading from the instance is paused);
- cancellation closes the connection: a client that leaves cancels its handler, and the
  instance sees the close and cancels the generation;
- the response's face: `status`, `reason`, `headers` (a CIMultiDictProxy), `content.readany()`,
  `read()`, `release()` (back to the pool once read to its end), `close()`; failures while
  reading the body are aiohttp's `ClientPayloadError` and `SocketTimeoutError`, which every
  relay (ours and the OpenAI frontend's) already handles.

Failures before the response head are this module's own exceptions (ConnectFailed,
ConnectTimeout, HeadTimeout, Disconnected, BadResponse): the proxy decides per kind
whether to retry and whom to blame.
"""

from __future__ import annotations

import asyncio
import os
from collections import deque
from collections.abc import Callable
from typing import Any

import aiohttp
import httptools
from multidict import CIMultiDict, CIMultiDictProxy

KEEPALIVE_S = 30.0
# Past this much unread body, stop reading from the instance until the relay catches up
# (a slow client then slows the instance's socket, not the proxy's memory).
HIGH_WATER = 256 * 1024


class UpstreamError(aiohttp.ClientConnectionError):
    """A request failed before its response head arrived."""


class ConnectFailed(UpstreamError):
    """Refused, unreachable or reset while connecting."""


class ConnectTimeout(UpstreamError):
    pass


class HeadTimeout(UpstreamError):
    """Connected and sent, then silence for the idle timeout before the response head."""


class Disconnected(UpstreamError):
    """The connection closed (or failed) before the response head."""


class BadResponse(UpstreamError):
    """The instance sent something that is not an HTTP/1.x response head."""


def _decode(raw: bytes) -> str:
    # As aiohttp's parser: UTF-8, undecodable bytes kept (surrogateescape).
    return raw.decode("utf-8", "surrogateescape")


class _Connection(asyncio.Protocol):
    """One keep-alive connection; it carries at most one response at a time."""

    __slots__ = ("_pool", "key", "transport", "response", "closed", "registered", "idle_since")

    def __init__(self, pool: "UpstreamPool", key: tuple[str, int]) -> None:
        self._pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.response: UpstreamResponse | None = None
        self.closed = False
        self.registered = False  # counted in the pool (it owns an open-connection slot)
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.registered = True
        self._pool._all.add(self)

    def data_received(self, data: bytes) -> None:
        r = self.response
        if r is None:
            # Bytes while no request is out (a second response, garbage): unusable.
            self.close()
            return
        r._feed(data)

    def eof_received(self) -> bool:
        return False  # the transport closes; connection_lost tells the response

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        r = self.response
        if r is not None:
            r._lost(exc)
        self._pool._lost(self)

    def usable(self) -> bool:
        t = self.transport
        return not self.closed and t is not None and not t.is_closing()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()
            self._pool._lost(self)


class UpstreamResponse:
    """A response being received on one connection; also its own `content` (readany)."""

    __slots__ = ("status", "reason", "headers", "content", "_conn", "_loop", "_parser", "_raw", "_reason",
                 "_chunks", "_size", "_paused", "_head_done", "_done", "_exc", "_waiter", "_informational",
                 "_until_eof", "_is_head", "_keep_alive", "_idle_s", "_timer", "_last", "_sink", "_framed",
                 "_on_data", "_out")

    def __init__(self, conn: _Connection, loop: asyncio.AbstractEventLoop, is_head: bool,
                 idle_s: float | None) -> None:
        self.status = 0
        self.reason = ""
        self.headers: CIMultiDictProxy[str] = _NO_HEADERS
        self.content = self  # aiohttp's shape: response.content.readany()
        self._conn: _Connection | None = conn
        self._loop = loop
        self._parser = httptools.HttpResponseParser(self)
        self._raw: list[tuple[bytes, bytes]] = []
        self._reason = b""
        self._chunks: list[bytes] = []
        self._size = 0
        self._paused = False
        self._head_done = False
        self._done = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._informational = False
        self._until_eof = False
        self._is_head = is_head
        self._keep_alive = False
        self._idle_s = idle_s
        self._timer: asyncio.TimerHandle | None = None
        self._last = 0.0
        # Pipe mode (pipe()): the body goes from the parser straight to the client's transport.
        self._sink: asyncio.WriteTransport | None = None
        self._framed = False
        self._on_data: Callable[[bytes], None] | None = None
        self._out: list[bytes] = []

    # --- the proxy's side -----------------------------------------------------------------
    async def _wait_head(self) -> "UpstreamResponse":
        if self._idle_s:
            self._last = self._loop.time()
            self._timer = self._loop.call_at(self._last + self._idle_s, self._on_idle)
        while not self._head_done and self._exc is None:
            await self._wait()
        if not self._head_done:
            raise self._exc  # type: ignore[misc]
        return self

    async def readany(self) -> bytes:
        """What has arrived since the last read (waiting for some); b"" at the end."""
        chunks = self._chunks
        while not chunks:
            if self._exc is not None:
                raise self._exc
            if self._done:
                return b""
            await self._wait()
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._size = 0
        self.resume()
        return data

    def pipe(self, sink: asyncio.WriteTransport, framed: bool, on_data: Callable[[bytes], None],
             head: bytes = b"", prefix: bytes = b"") -> None:
        """Relay the rest of the body to `sink` (the client's transport) from inside the
        connection's data_received: what one read of the instance's socket brought is written
        to the client at once, in one write, with no coroutine woken per read. That wake-up
        and aiohttp's StreamResponse.write were most of a worker's cost per streamed event
        (bench/results/dataplane_bench-*-worker.svg).

        `prefix`: the response head for the client (response_head.py), written now with the
        body that has arrived already (`head`: body the caller read, then what is buffered):
        a short answer goes out in one write, head, body and last chunk. `framed`: re-frame
        as HTTP/1.1 chunks, the last chunk with the last data. `on_data` sees every piece
        relayed (SSE event counting). Then `piped()` waits for the end, a failure, or a full
        client buffer."""
        self._sink, self._framed, self._on_data = sink, framed, on_data
        if head:
            self._out.append(head)
        if self._chunks:
            self._out.extend(self._chunks)
            self._chunks.clear()
            self._size = 0
        self.resume()  # paused while buffering (readany's HIGH_WATER): the client's buffer decides now
        self._flush(prefix)

    async def piped(self) -> bool:
        """In pipe mode: True once the body was relayed to its end; False when the client's
        buffer is past HIGH_WATER (reading from the instance is paused: drain the client,
        then resume()). Raises as readany() does when the instance fails, and
        ConnectionResetError when the client's transport closed."""
        while True:
            if self._exc is not None:
                raise self._exc
            if self._done:
                if self._framed:
                    self._flush()  # a body that ended with the connection: its last chunk
                    if self._exc is not None:
                        raise self._exc
                return True
            if self._paused:
                return False
            await self._wait()

    def resume(self) -> None:
        """Read from the instance again after a pause (the relay caught up)."""
        if self._paused:
            self._paused = False
            conn = self._conn
            if conn is not None and conn.transport is not None and not conn.closed:
                conn.transport.resume_reading()

    def _flush(self, prefix: bytes = b"") -> None:
        sink = self._sink
        assert sink is not None and self._on_data is not None
        if sink.is_closing():
            self._out.clear()
            self._fail(ConnectionResetError("the client went away"))
            return
        out = self._out
        body = b""
        if out:
            body = out[0] if len(out) == 1 else b"".join(out)
            out.clear()
        data = b"%x\r\n%b\r\n" % (len(body), body) if body and self._framed else body
        if self._done and self._framed and self._exc is None:
            self._framed = False  # the last chunk goes once, with the last data
            data += b"0\r\n\r\n"
        if prefix:
            data = prefix + data
        if data:
            sink.write(data)
        if body:
            self._on_data(body)
        if not self._paused and sink.get_write_buffer_size() > HIGH_WATER:
            conn = self._conn
            if conn is not None and conn.transport is not None:
                self._paused = True
                conn.transport.pause_reading()
                self._wake()

    async def read(self) -> bytes:
        parts: list[bytes] = []
        while True:
            chunk = await self.readany()
            if not chunk:
                return b"".join(parts)
            parts.append(chunk)

    def release(self) -> None:
        """Done with it: the connection goes back to the pool if the response was read to its
        end and may be reused, else it is closed."""
        conn, self._conn = self._conn, None
        self._stop_timer()
        if conn is None:
            return
        conn.response = None
        if self._done and self._exc is None and self._keep_alive and conn.usable():
            conn._pool._put(conn)
        else:
            conn.close()

    def close(self) -> None:
        """Drop the connection (the instance sees the close and cancels the request)."""
        conn, self._conn = self._conn, None
        self._stop_timer()
        if conn is not None:
            conn.response = None
            conn.close()

    async def _wait(self) -> None:
        fut = self._waiter = self._loop.create_future()
        try:
            await fut
        finally:
            self._waiter = None

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # --- the connection's side -----------------------------------------------------------
    def _feed(self, data: bytes) -> None:
        if self._timer is not None:
            self._last = self._loop.time()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(BadResponse("instance answered with a protocol upgrade"))
        except httptools.HttpParserError as exc:
            self._fail(BadResponse(f"unparsable response from the instance: {exc}") if not self._head_done
                       else aiohttp.ClientPayloadError(f"malformed response body from the instance: {exc}"))
        if self._sink is not None and (self._out or (self._done and self._framed)):
            self._flush()

    def _lost(self, exc: BaseException | None) -> None:
        if self._done or self._exc is not None:
            return
        if not self._head_done:
            self._fail(Disconnected(f"instance closed the connection before answering ({exc or 'EOF'})"))
        elif self._until_eof:
            self._keep_alive = False
            self._complete()  # a body delimited by the close: this is its end
        else:
            self._fail(aiohttp.ClientPayloadError(
                f"instance closed the connection mid-response ({exc or 'EOF'})"))

    def _fail(self, exc: BaseException) -> None:
        if self._exc is None and not self._done:
            self._exc = exc
        self._stop_timer()
        conn = self._conn
        if conn is not None:
            conn.close()  # never reused after a failure
        self._wake()

    def _complete(self) -> None:
        self._done = True
        self._stop_timer()
        self._wake()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_idle(self) -> None:
        self._timer = None
        if self._done or self._exc is not None:
            return
        now = self._loop.time()
        idle_s = self._idle_s or 0.0
        if self._paused:
            # The client is the slow side; the instance is not silent, we stopped listening.
            self._last = now
        elif now - self._last >= idle_s * 0.999:
            self._fail(HeadTimeout(f"no response head within {idle_s:g} s") if not self._head_done
                       else aiohttp.SocketTimeoutError(f"instance silent for {idle_s:g} s mid-response"))
            return
        self._timer = self._loop.call_at(self._last + idle_s, self._on_idle)

    # httptools callbacks (called inside feed_data)
    def on_message_begin(self) -> None:
        if self._done:
            self._keep_alive = False  # bytes after our response: do not reuse this connection

    def on_status(self, reason: bytes) -> None:
        self._reason += reason  # may come in pieces

    def on_header(self, name: bytes, value: bytes) -> None:
        self._raw.append((name, value))

    def on_headers_complete(self) -> None:
        if self._done:
            return
        parser = self._parser
        status = parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            # An interim response (100 Continue, 103 Early Hints): the real one follows.
            self._informational = True
            self._raw = []
            self._reason = b""
            return
        headers: CIMultiDict[str] = CIMultiDict()
        add = headers.add
        for name, value in self._raw:
            add(_decode(name), _decode(value))
        self._raw = []
        self.headers = CIMultiDictProxy(headers)
        self.status = status
        self.reason = _decode(self._reason)
        self._keep_alive = parser.should_keep_alive()
        self._until_eof = ("Content-Length" not in headers and "Transfer-Encoding" not in headers
                           and status not in (204, 304) and not self._is_head)
        self._head_done = True
        if self._is_head:
            self._complete()  # a HEAD answer has no body, whatever its Content-Length says
        else:
            self._wake()

    def on_body(self, body: bytes) -> None:
        if self._done:
            return
        if self._sink is not None:
            self._out.append(body)  # written once feed_data returns: one write per read
            return
        self._chunks.append(body)
        self._size += len(body)
        if self._size >= HIGH_WATER and not self._paused:
            conn = self._conn
            if conn is not None and conn.transport is not None:
                self._paused = True
                conn.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        if not self._done:
            self._complete()


_NO_HEADERS: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict())


def _host_header(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class UpstreamPool:
    """Keep-alive connections per instance address, and the requests sent over them."""

    def __init__(self, *, limit_per_host: int, keepalive_s: float = KEEPALIVE_S) -> None:
        self._limit = limit_per_host
        self._keepalive_s = keepalive_s
        self._loop = asyncio.get_running_loop()
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._open: dict[tuple[str, int], int] = {}
        self._waiters: dict[tuple[str, int], deque[asyncio.Future[_Connection | None]]] = {}
        self._all: set[_Connection] = set()
        self._sweeper: asyncio.TimerHandle | None = None
        self._host_lines: dict[tuple[str, int], bytes] = {}
        self.closed = False

    async def request(self, host: str, port: int, method: str, target: str, headers: Any, body: bytes, *,
                      connect_timeout_s: float | None, idle_timeout_s: float | None) -> UpstreamResponse:
        """Send one request; returns once the response head arrived (the body follows)."""
        if self.closed:
            raise Disconnected("the proxy is shutting down")
        key = (host, port)
        conn = await self._acquire(key, connect_timeout_s)
        resp = UpstreamResponse(conn, self._loop, method == "HEAD", idle_timeout_s)
        conn.response = resp
        try:
            host_line = self._host_lines.get(key)
            if host_line is None:
                host_line = self._host_lines[key] = f"Host: {_host_header(host, port)}\r\n".encode()
            # Content-Length always, 0 included, as aiohttp's client sent it for a bytes body.
            lines = [f"{method} {target} HTTP/1.1\r\n".encode(), host_line]
            lines += [f"{k}: {v}\r\n".encode("utf-8", "surrogateescape") for k, v in headers.items()]
            lines.append(b"Content-Length: %d\r\n\r\n" % len(body))
            if len(body) <= 65536:
                lines.append(body)  # one write, one segment for a small request
                conn.transport.write(b"".join(lines))  # type: ignore[union-attr]
            else:
                conn.transport.write(b"".join(lines))  # type: ignore[union-attr]
                conn.transport.write(body)  # type: ignore[union-attr]
            return await resp._wait_head()
        except BaseException:
            resp.close()  # cancelled or failed: the instance sees the close
            raise

    # --- the pool -------------------------------------------------------------------------
    async def _acquire(self, key: tuple[str, int], connect_timeout_s: float | None) -> _Connection:
        while True:
            idle = self._idle.get(key)
            while idle:
                conn = idle.pop()  # the most recently used: warm, and lets the rest expire
                if conn.usable():
                    return conn
            if self._open.get(key, 0) < self._limit:
                break
            handed = await self._wait_for_slot(key)
            if handed is None:
                break  # a connection closed: its slot is ours to connect in
            if handed.usable():
                return handed
            # Handed over, then closed before we ran: try again.
        self._open[key] = self._open.get(key, 0) + 1
        host, port = key
        made: list[_Connection] = []

        def factory() -> _Connection:
            made.append(_Connection(self, key))
            return made[0]

        try:
            coro = self._loop.create_connection(factory, host, port)
            if connect_timeout_s:
                await asyncio.wait_for(coro, connect_timeout_s)
            else:
                await coro
        except BaseException as exc:
            if made and made[0].registered:
                made[0].close()  # connected, then cancelled: the connection owns the slot
            else:
                self._slot_freed(key)
            if isinstance(exc, asyncio.TimeoutError):
                raise ConnectTimeout(f"connect to {host}:{port} timed out after {connect_timeout_s:g} s") \
                    from None
            if isinstance(exc, OSError):
                # asyncio's own message ("Connect call failed (...)") hides the errno's meaning.
                why = os.strerror(exc.errno) if exc.errno else str(exc)
                raise ConnectFailed(f"connect to {host}:{port}: {why}") from exc
            raise
        conn = made[0]
        if not conn.usable():
            raise Disconnected(f"instance {host}:{port} closed the connection at once")
        if self.closed:
            conn.close()
            raise Disconnected("the proxy is shutting down")
        return conn

    async def _wait_for_slot(self, key: tuple[str, int]) -> _Connection | None:
        """Wait while the instance has limit_per_host connections: a released one, or None
        when one closed (then the caller connects in its slot)."""
        waiters = self._waiters.setdefault(key, deque())
        fut: asyncio.Future[_Connection | None] = self._loop.create_future()
        waiters.append(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                handed = fut.result()  # given to us just as we were cancelled: pass it on
                if handed is not None:
                    self._put(handed)
                else:
                    self._wake(key)
            else:
                try:
                    waiters.remove(fut)
                except ValueError:
                    pass
            raise

    def _put(self, conn: _Connection) -> None:
        """A connection whose response was read to its end: to a waiter, else idle."""
        waiters = self._waiters.get(conn.key)
        while waiters:
            fut = waiters.popleft()
            if not fut.done():
                fut.set_result(conn)
                return
        if self.closed:
            conn.close()
            return
        conn.idle_since = self._loop.time()
        self._idle.setdefault(conn.key, []).append(conn)
        if self._sweeper is None:
            self._sweeper = self._loop.call_later(self._keepalive_s, self._sweep)

    def _lost(self, conn: _Connection) -> None:
        """A connection closed (either side): forget it, free its slot once."""
        if conn not in self._all:
            return
        self._all.discard(conn)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)
        self._slot_freed(conn.key)

    def _slot_freed(self, key: tuple[str, int]) -> None:
        n = self._open.get(key, 0) - 1
        if n > 0:
            self._open[key] = n
        else:
            self._open.pop(key, None)
        self._wake(key)

    def _wake(self, key: tuple[str, int]) -> None:
        waiters = self._waiters.get(key)
        while waiters:
            fut = waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # connect a new one in the freed slot
                return

    def _sweep(self) -> None:
        """Close connections idle longer than the keep-alive; one timer for the whole pool."""
        self._sweeper = None
        now = self._loop.time()
        soonest = None
        for idle in list(self._idle.values()):
            # Oldest first: _put appends, _acquire pops the newest.
            while idle and now - idle[0].idle_since >= self._keepalive_s:
                idle[0].close()  # _lost removes it from the list
            if idle:
                due = idle[0].idle_since + self._keepalive_s
                soonest = due if soonest is None else min(soonest, due)
        if soonest is not None and not self.closed:
            self._sweeper = self._loop.call_at(soonest, self._sweep)

    def abort(self, host: str, port: int, reason: str, *, answering: bool) -> int:
        """Fail the requests in flight to one instance that stopped answering (its process
        stopped, its node or the link gone: nothing refuses or closes, so they would wait for
        the idle timeout). Those still waiting for the response head fail as Disconnected,
        which the proxy retries elsewhere; with `answering`, also those whose answer is
        arriving, which the relay cuts. Its idle connections are closed. Returns how many
        requests failed."""
        failed = 0
        for conn in [c for c in self._all if c.key == (host, port)]:
            r = conn.response
            if r is None:
                conn.close()  # idle: never send another request down it
            elif not r._head_done:
                r._fail(Disconnected(f"instance {host}:{port} stopped answering: {reason}"))
                failed += 1
            elif answering:
                r._fail(aiohttp.ClientPayloadError(f"instance {host}:{port} stopped answering: {reason}"))
                failed += 1
        return failed

    def open_connections(self) -> int:
        return len(self._all)

    async def close(self) -> None:
        """Close every connection (requests still running see a failure); no new requests."""
        self.closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for conn in list(self._all):
            conn.close()
        for waiters in self._waiters.values():
            while waiters:
                fut = waiters.popleft()
                if not fut.done():
                    fut.cancel()
        await asyncio.sleep(0)  # let the transports run their connection_lost


__all__ = ["BadResponse", "ConnectFailed", "ConnectTimeout", "Disconnected", "HeadTimeout", "UpstreamError",
           "UpstreamPool", "UpstreamResponse"]
