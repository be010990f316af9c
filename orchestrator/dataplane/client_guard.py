"""Slow clients and too many clients, for the embedded proxy's aiohttp listeners.

aiohttp's server closes an idle keep-alive connection (keepalive_timeout) but has no
deadline for a client that sends its request slowly: a head trickled one header at
a time, or a body trickled one byte at a time, holds a connection and a handler for
as long as the client likes. NGINX has client_header_timeout/client_body_timeout for
this; `GuardedServer` (a drop-in for aiohttp's low-level `web.Server`) adds:

- a head deadline: the request line and headers must be complete header_timeout_s
  after the connect (a connection's first request) or after the first byte of a
  later keep-alive request. Else: 408, and the connection is closed.
- a body deadline: the whole body must have arrived body_timeout_s after the head.
  Else the body's reads raise BodyTimeout, and the handler answers 408 and closes.
  A whole-body deadline, not NGINX's per-read one: a body trickled one byte per
  second would never trip a per-read timeout.
- a cap on open connections: beyond max_connections, a new connection gets a 503
  and is closed at once, with a rate-limited warning.
- a first request for every accepted connection at shutdown. aiohttp's pre_shutdown closes
  every connection waiting for a request, and one accepted a moment before, whose request
  was in its socket unread, was closed with it: the kernel answers unread data with a
  reset, and the client of a reload of the worker count saw ConnectionResetError (a CI
  run of tests/test_e2e_workers.py). A connection that has not sent a byte yet is
  closed after its first response instead (`settle` waits for those requests, briefly).
- the body of a request in progress at shutdown. aiohttp drops what a connection receives
  once it is closed (closing means "after the current response"), so a request whose head
  had come and whose body was still on the way waited for the rest until the stop's grace
  ran out and cancelled it (another CI run of the same reload: RemoteDisconnected, the cancel
  log showing it waiting in `_read_body`). Its body is read and it is answered.
- the next request of a connection busy at shutdown. An answer whose head went out before the
  stop says keep-alive, and its client may send the next request the moment it ends: closed
  then, that request fails (a broken pipe or a reset: bench/chaos_soak.py's streaming clients
  at a reload that stopped a worker; NGINX's graceful stop leaves the same race). Such a
  connection stays open after the answer (`kept`), and `linger` gives it the first request's
  grace for its next request, answered with Connection: close (the proxy's answers say close
  once it stops), then closes it. A connection idle between requests at the shutdown is kept
  the same way (its client may be sending the next one).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]

LOG_INTERVAL_S = 10.0  # at most one line per this long for each kind of event
SETTLE_POLL_S = 0.005


@dataclass(frozen=True)
class ClientLimits:
    header_timeout_s: float
    body_timeout_s: float
    max_connections: int

    def __post_init__(self) -> None:
        if self.header_timeout_s <= 0 or self.body_timeout_s <= 0 or self.max_connections < 1:
            raise ValueError(f"client limits must be positive: {self}")


class BodyTimeout(asyncio.TimeoutError):
    """The request body did not arrive in time; raised by the body's reads.

    A TimeoutError so that aiohttp's lingering read after the response (which
    tolerates timeouts) ends quietly instead of logging an unhandled exception.
    """


def _raw_response(status: str, message: str, extra: str = "") -> bytes:
    # Written straight to the transport: no request object exists to answer through.
    body = '{"error":"' + message + '"}'
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n{body}").encode()


_REFUSED = _raw_response("503 Service Unavailable", "too many client connections", "Retry-After: 1\r\n")
_HEAD_TIMEOUT = _raw_response("408 Request Timeout", "request head not received in time")


def _body_late(limits: ClientLimits) -> str:
    return f"request body not received within {limits.body_timeout_s:g} s"


def head_timeout_answer() -> bytes:
    """What a client whose request head came too late is sent before its connection closes (here
    and in the compiled front, front/compiled.py)."""
    return _HEAD_TIMEOUT


def body_timeout_answer(limits: ClientLimits) -> bytes:
    """The same for a body (the embedded path answers it through its handler: the same message)."""
    return _raw_response("408 Request Timeout", _body_late(limits))


class _Throttled:
    """A log line for a repeated event, at most once per interval, with the count."""

    __slots__ = ("_log", "_level", "_count", "_next")

    def __init__(self, log: logging.Logger, level: int) -> None:
        self._log = log
        self._level = level
        self._count = 0
        self._next = 0.0

    def __call__(self, message: str, *args: Any) -> None:
        self._count += 1
        now = time.monotonic()
        if now >= self._next:
            self._log.log(self._level, message + " (%d since the last such line)", *args, self._count)
            self._count = 0
            self._next = now + LOG_INTERVAL_S


class GuardedServer(web.Server):
    """aiohttp's low-level Server with deadlines for slow clients and a connection cap."""

    def __init__(self, handler: Handler, *, limits: ClientLimits, log: logging.Logger,
                 **kwargs: Any) -> None:
        protocol_kwargs = {k: v for k, v in kwargs.items()
                           if k not in ("request_factory", "handler_cancellation", "loop")}
        super().__init__(self._guarded, **kwargs)
        self._handler = handler
        self._protocol_kwargs = protocol_kwargs
        self._event_loop = asyncio.get_running_loop()
        self.limits = limits
        self.open_connections = 0
        # Told when a counted connection closes (accept.py publishes the count to the other
        # workers: their shares of the next burst are computed from it).
        self.on_closed: Callable[[], None] | None = None
        # Accepted connections that have not sent a byte yet (their first request may be on
        # the way): a shutdown closes them after it (module doc).
        self.fresh: set["_GuardedProtocol"] = set()
        # Connections answering or idle between requests at the shutdown, kept open for one
        # more request (module doc): `linger` waits for them.
        self.kept: set["_GuardedProtocol"] = set()
        self._refusals = _Throttled(log, logging.WARNING)
        self._cuts = _Throttled(log, logging.INFO)

    def __call__(self) -> RequestHandler:
        # The protocol factory: one protocol per accepted connection.
        return _GuardedProtocol(self, loop=self._event_loop, **self._protocol_kwargs)

    async def _guarded(self, request: web.BaseRequest) -> web.StreamResponse:
        protocol = request.protocol
        if isinstance(protocol, _GuardedProtocol):
            protocol.stop_head_timer()
        timer = None
        if request.body_exists and not request.content.is_eof():  # a small body came with the head
            timer = self._event_loop.call_later(self.limits.body_timeout_s, self._body_expired, request)
        try:
            return await self._handler(request)
        finally:
            if timer is not None:
                timer.cancel()

    def _body_expired(self, request: web.BaseRequest) -> None:
        content = request.content
        if not content.is_eof():
            content.set_exception(BodyTimeout(_body_late(self.limits)))
            self.cut("body", request.remote)

    def cut(self, part: str, peer: Any) -> None:
        self._cuts("cut slow client %s: request %s not received within %g s", peer, part,
                   self.limits.header_timeout_s if part == "head" else self.limits.body_timeout_s)

    async def settle(self, timeout_s: float) -> None:
        """After pre_shutdown: wait up to `timeout_s` for the connections accepted but silent to
        send their first request (it is then served, and the connection closed), then close
        the ones still silent."""
        deadline = self._event_loop.time() + timeout_s
        while self.fresh and self._event_loop.time() < deadline:
            await asyncio.sleep(SETTLE_POLL_S)
        for protocol in list(self.fresh):
            self.fresh.discard(protocol)
            # Closed now. RequestHandler.close() only cancels the wait for a request: the
            # connection stayed open, unread, until the proxy's cleanup at the end of its stop,
            # and a request sent in the meantime waited there for nothing (up to the grace,
            # then a RemoteDisconnected: a reload test's stream, 10.9 s).
            protocol.force_close()

    async def linger(self, first_request_s: float, until: float) -> None:
        """After pre_shutdown, beside the wait for the running answers: each kept connection idle
        (its answer ended kept alive, or it was idle at the shutdown) gets `first_request_s` for
        its next request; a silent one is closed then, and every one left at `until` (loop time)."""
        loop = self._event_loop
        idle_since: dict[_GuardedProtocol, float] = {}
        while self.kept and loop.time() < until:
            now = loop.time()
            for protocol in list(self.kept):
                if not protocol.awaiting_request():
                    idle_since.pop(protocol, None)  # still answering, or its next request came
                elif now - idle_since.setdefault(protocol, now) >= first_request_s:
                    self.kept.discard(protocol)
                    protocol.force_close()  # idle: closed now (module doc: settle)
            await asyncio.sleep(SETTLE_POLL_S)
        for protocol in list(self.kept):
            self.kept.discard(protocol)
            if protocol.awaiting_request():
                protocol.force_close()
            else:
                RequestHandler.close(protocol)  # after the answer it is giving

    def refuse(self, transport: asyncio.BaseTransport) -> None:
        transport.write(_REFUSED)  # type: ignore[attr-defined]
        transport.close()
        self._refusals("client connection limit reached (max_client_connections=%d): refused %s "
                       "with 503", self.limits.max_connections, transport.get_extra_info("peername"))


class _GuardedProtocol(RequestHandler):
    """aiohttp's per-connection protocol, plus the head deadline and the connection count."""

    __slots__ = ("_guard", "_head_timer", "_counted", "_close_after_first")

    def __init__(self, guard: GuardedServer, **kwargs: Any) -> None:
        super().__init__(guard, **kwargs)
        self._guard = guard
        self._head_timer: asyncio.TimerHandle | None = None
        self._counted = False
        self._close_after_first = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        guard = self._guard
        if guard.open_connections >= guard.limits.max_connections:
            guard.refuse(transport)  # aiohttp never sees this connection
            return
        guard.open_connections += 1
        self._counted = True
        guard.fresh.add(self)
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.stop_head_timer()  # nothing to time any more
        self._guard.fresh.discard(self)
        self._guard.kept.discard(self)
        if not self._counted:
            return
        self._counted = False
        guard = self._guard
        guard.open_connections -= 1
        if guard.on_closed is not None:
            guard.on_closed()
        super().connection_lost(exc)

    def close(self) -> None:
        """A shutdown's close: one that has not sent a byte yet is closed after its first
        response instead, one answering now after its next (module doc: `kept`)."""
        if self in self._guard.fresh:
            self._close_after_first = True
            return
        if self._counted and not self._force_close and not self._close:
            # answering (its head may have said keep-alive), or idle between requests (the next
            # may be on its way): closed after the next answer, which says Connection: close
            # (aiohttp ends a connection after such an answer), or by `linger` if none comes.
            # Not by marking it closed now: a next request that arrives while the current
            # answer's handler is still returning would be queued, then dropped unanswered.
            self._guard.kept.add(self)
            return
        super().close()

    def data_received(self, data: bytes) -> None:
        if not self._counted:
            return
        self._guard.fresh.discard(self)
        if self._close and not self._force_close and self._body_arriving():
            # A stop's close (after the current response) came while this request's body was on
            # its way: aiohttp drops what a closed connection receives, and the handler would
            # wait for the rest until the stop cancels it. The parser takes it; the connection
            # still closes after the response.
            self._close = False
            try:
                super().data_received(data)
            finally:
                self._close = True
            return
        super().data_received(data)
        if self._close_after_first and not self.awaiting_request():
            # its first request is parsed (start() has it): served, then the connection closes
            self._close_after_first = False
            super().close()
        # Still waiting after these bytes: they began a keep-alive request's head but did
        # not complete it. (Checked after parsing: a head that arrives whole, the usual
        # case, costs no timer.)
        if self._head_timer is None and self.awaiting_request():
            self._arm_head_timer()

    def _body_arriving(self) -> bool:
        """Whether a request whose head was parsed still waits for body bytes: the one being
        handled, or one parsed and queued for start()."""
        # aiohttp's own fields (RequestHandler.start and data_received), read as awaiting_request
        # reads _waiter
        request = getattr(self, "_current_request", None)
        if request is not None and not request.content.is_eof():
            return True
        return any(not payload.is_eof() for _, payload in getattr(self, "_messages", ()))

    def stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _arm_head_timer(self) -> None:
        self._head_timer = self._loop.call_later(self._guard.limits.header_timeout_s, self._head_expired)

    def awaiting_request(self) -> bool:
        # aiohttp's own idle test (RequestHandler._process_keepalive): between requests its
        # start() loop waits on _waiter until the parser completes the next head. Not
        # waiting: a request is being handled, or a complete head is queued behind it.
        waiter = getattr(self, "_waiter", None)
        return waiter is not None and not waiter.done()

    def _head_expired(self) -> None:
        self._head_timer = None
        if not self.awaiting_request():
            return
        transport = self.transport
        if transport is not None:
            self._guard.cut("head", transport.get_extra_info("peername"))
            transport.write(_HEAD_TIMEOUT)
        self.force_close()  # closes after the 408 is flushed; start() ends as on keep-alive expiry
