"""The fast lane: native inference requests read and answered without aiohttp's request
machinery, on the same connection and listener as everything else.

Why: in a worker under load, aiohttp's server side (its per-request loop, request object,
payload stream, writer and handler task) was half of the busy time in the device's flame
graph (bench/results/dataplane_bench-20261125T062848Z-worker.svg), and an aiohttp server
that answers a fixed body costs ~17 us of CPU per request on the test VM against ~3 us for
a bare httptools protocol. What the proxy does with a request (hold, pick, forward, retry,
relay, metrics) is the same code either way: EmbeddedProxy._forward.

Which requests take it (FastLane.eligible, from the proxy's one Surface): a native (v2)
route the proxy forwards (public, or admin where --allow-admin), GET or POST, HTTP/1.x, an
origin-form target, a body framed by Content-Length (or none) no larger than
--max-body-bytes, no Expect, Upgrade or Transfer-Encoding. Everything else (OpenAI routes,
health answers, errors, chunked uploads, anything malformed) is handed to aiohttp at that
request's first byte, and the connection stays aiohttp's from then on: one place answers
each kind of request, and the lane never has to re-implement a rare case.

Slow clients are cut as on aiohttp's path (client_guard.py): the head deadline runs from the
connection (or the next request's first byte), the body deadline from the head; the
connection cap counts lane connections alike. Pipelined requests are answered in order: the
bytes after one request wait until its answer is out.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import httptools
from aiohttp import web
from aiohttp.http_writer import StreamWriter
from multidict import CIMultiDict, CIMultiDictProxy

from orchestrator.dataplane.client_guard import GuardedProtocol, GuardedServer
from orchestrator.dataplane.response_head import RelayedResponse, response_head

# A head longer than this is not ours: aiohttp refuses a request line or a header field over
# 8190 bytes (400), and answering the same bytes alike is its job, not a second rule here.
HEAD_MAX = 8190
_METHODS = frozenset({"GET", "POST"})
# Headers that make a request aiohttp's (see the module docstring).
_NOT_OURS = ("expect", "upgrade", "transfer-encoding")
_BODY_408 = b'{"error":"request body not received in time"}'
BODY_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(_BODY_408), _BODY_408))


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")  # as aiohttp's parser


class FastRequest:
    """What EmbeddedProxy._forward and its relay read of a request (aiohttp's names)."""

    __slots__ = ("method", "path", "query", "headers", "version", "keep_alive", "body", "remote",
                 "transport", "protocol", "writer")

    def __init__(self, method: str, path: str, query: str, headers: CIMultiDictProxy[str],
                 version: tuple[int, int], keep_alive: bool, body: bytes, protocol: "FastLaneProtocol") -> None:
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers
        self.version = version
        self.keep_alive = keep_alive
        self.body = body
        self.protocol = protocol
        self.transport = protocol.transport
        peer = self.transport.get_extra_info("peername") if self.transport is not None else None
        self.remote = peer[0] if isinstance(peer, (tuple, list)) else None
        self.writer = StreamWriter(protocol, protocol._loop)  # its drain() waits out a full buffer


class _Head:
    """httptools callbacks for one request head; what the parser knows is read when the head
    completes (a request without a body completes the message in the same feed, and llhttp
    then resets its flags: asked afterwards, `Connection: close` would be forgotten)."""

    __slots__ = ("parser", "url", "headers", "method", "version", "keep_alive", "done")

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.method = ""
        self.version = (1, 1)
        self.keep_alive = False
        self.done = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        p = self.parser
        self.method = p.get_method().decode("ascii", "replace")
        major, _, minor = p.get_http_version().partition(".")
        self.version = (int(major), int(minor or 0))
        self.keep_alive = p.should_keep_alive()
        self.done = True


def parse_head(head: bytes) -> tuple[str, str, tuple[int, int], CIMultiDict[str], bool] | None:
    """(method, target, version, headers, keep_alive) of a complete head, or None when
    httptools finds it malformed (aiohttp then answers it)."""
    cb = _Head()
    try:
        cb.parser.feed_data(head)
    except httptools.HttpParserError:
        return None
    if not cb.done:
        return None
    headers: CIMultiDict[str] = CIMultiDict()
    for name, value in cb.headers:
        headers.add(_decode(name), _decode(value))
    return cb.method, _decode(cb.url), cb.version, headers, cb.keep_alive


def plain_response(resp: web.Response, version: tuple[int, int], keep_alive: bool) -> bytes:
    """A whole aiohttp Response (the proxy's errors and buffered answers) as bytes."""
    body = resp.body if isinstance(resp.body, (bytes, bytearray)) else b""
    headers = CIMultiDict(resp.headers)
    headers["Content-Length"] = str(len(body))
    return response_head(resp.status, resp.reason, headers, version=version, framed=False,
                         keep_alive=keep_alive) + bytes(body)


# The proxy's side of the lane: which requests it takes (a route, or None) and how it serves one.
Eligible = Callable[[str, str], Any]
Serve = Callable[[FastRequest, Any], Awaitable[web.StreamResponse]]


class FastLane:
    """What a listener's lane needs from its proxy."""

    __slots__ = ("eligible", "serve", "max_body")

    def __init__(self, eligible: Eligible, serve: Serve, max_body: int) -> None:
        self.eligible = eligible
        self.serve = serve
        self.max_body = max_body


class FastLaneProtocol(GuardedProtocol):
    __slots__ = ("_lane", "_buf", "_aiohttp", "_busy", "_task", "_body_timer", "_idle_timer")

    def __init__(self, guard: GuardedServer, **kwargs: Any) -> None:
        super().__init__(guard, **kwargs)
        self._lane: FastLane = guard.lane
        self._buf = b""
        self._aiohttp = False  # handed to aiohttp for good
        self._busy = False  # a request of ours is being answered
        self._task: asyncio.Task[Any] | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._idle_timer: asyncio.TimerHandle | None = None  # keep-alive between our requests

    # --- bytes in -------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self._aiohttp or not self._counted:
            super().data_received(data)
            return
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        if self._head_timer is None and not self._busy and not self._buf:
            self._arm_head_timer()  # the first byte of a keep-alive request
        self._buf += data
        if self._busy:
            if len(self._buf) > self._lane.max_body + HEAD_MAX:
                self.transport.pause_reading()  # a pipelining client waits for its answers
            return
        self._take()

    def _take(self) -> None:
        """Start answering the request at the front of the buffer, if it is whole."""
        buf = self._buf
        end = buf.find(b"\r\n\r\n", 0, HEAD_MAX + 4)
        if end < 0:
            if len(buf) > HEAD_MAX:
                self._hand_over()
            return
        head = parse_head(buf[:end + 4])
        if head is None:
            self._hand_over()
            return
        method, target, version, headers, keep_alive = head
        length = headers.get("Content-Length", "0")
        route = None
        if (method in _METHODS and target.startswith("/") and version[0] == 1 and length.isdigit()
                and int(length) <= self._lane.max_body and len(headers.getall("Content-Length", ())) <= 1
                and not any(h in headers for h in _NOT_OURS)):
            path, _, query = target.partition("?")
            route = self._lane.eligible(method, path)
        if route is None:
            self._hand_over()
            return
        need = end + 4 + int(length)
        if len(buf) < need:
            self.stop_head_timer()
            if self._body_timer is None:
                self._body_timer = self._loop.call_later(self._guard.limits.body_timeout_s, self._body_expired)
            return
        self._stop_body_timer()
        self.stop_head_timer()
        body, self._buf = buf[end + 4:need], buf[need:]
        request = FastRequest(method, path, query, CIMultiDictProxy(headers), version, keep_alive, body, self)
        self._busy = True
        self._task = self._loop.create_task(self._answer(request, route))

    def _hand_over(self) -> None:
        """aiohttp takes the connection from this request's first byte on."""
        self._aiohttp = True
        buf, self._buf = self._buf, b""
        self._stop_body_timer()
        super().data_received(buf)

    # --- the answer -----------------------------------------------------------------
    async def _answer(self, request: FastRequest, route: Any) -> None:
        keep_alive = False
        try:
            resp = await self._lane.serve(request, route)
            transport = self.transport
            if isinstance(resp, RelayedResponse):
                keep_alive = resp.keep_alive  # written already
            elif transport is not None and not transport.is_closing():
                keep_alive = request.keep_alive and resp.keep_alive is not False
                transport.write(plain_response(resp, request.version, keep_alive))  # type: ignore[arg-type]
        except asyncio.CancelledError:
            pass  # the client left: the relay closed its upstream connection
        except Exception:  # a bug: the client gets its connection closed, the log says why
            self.logger.exception("fast lane: %s %s failed", request.method, request.path)
        finally:
            self._task = None
            self._busy = False
            self._after(keep_alive)

    def _after(self, keep_alive: bool) -> None:
        transport = self.transport
        if transport is None:
            return
        if not keep_alive:  # (a stopping proxy answers with keep_alive off: EmbeddedProxy._serve_fast)
            transport.close()
            return
        transport.resume_reading()
        if self._buf:
            self._arm_head_timer()
            self._take()
        else:
            self._idle_timer = self._loop.call_later(self._keepalive_timeout, self._idle_expired)

    def _idle_expired(self) -> None:
        self._idle_timer = None
        if not self._busy and not self._buf and self.transport is not None:
            self.transport.close()

    # --- deadlines and the end ------------------------------------------------------
    def _body_expired(self) -> None:
        self._body_timer = None
        transport = self.transport
        if transport is not None and not self._busy:
            self._guard.cut("body", transport.get_extra_info("peername"))
            transport.write(BODY_TIMEOUT_RESPONSE)
            transport.close()

    def _stop_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _awaiting_request(self) -> bool:
        if self._aiohttp:
            return super()._awaiting_request()
        return not self._busy and self._body_timer is None

    def connection_lost(self, exc: BaseException | None) -> None:
        self._stop_body_timer()
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        if self._task is not None:
            self._task.cancel()  # the relay closes its upstream connection: Triton cancels
        super().connection_lost(exc)


__all__ = ["FastLane", "FastLaneProtocol", "FastRequest", "parse_head", "plain_response"]
