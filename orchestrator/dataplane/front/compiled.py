"""A worker's compiled front (`Front`): its start on the event loop, its rules from the product's
one definitions, the connections it adopts and hands off to aiohttp, its stop.

State: the C module (_front.c) owns its connections, kept instance connections and per-instance
counts, in the worker process that started it (one front at a time per process). Each request's
Python state is path.py's `_FrontRequest`, held by the front from decide to release. aiohttp owns
every connection the front hands off.

`NATIVE` is the module, or None where it was not built (setup.py builds it where a C compiler is)
or where TRTLLM_ORCH_PURE_PYTHON=1 leaves it out.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from typing import Any

from orchestrator import native
from orchestrator.dataplane.client_guard import ClientLimits, body_timeout_answer, head_timeout_answer
from orchestrator.dataplane.front import MODULE
from orchestrator.dataplane.headers import RESPONSE_DROP, UNTRUSTED_REQUEST_DROP, TrustedPeers
from orchestrator.dataplane.metrics import ITL_BUCKETS

NATIVE: Any = native.load(MODULE)  # None where not built: everything below runs only where it is

# The native routes the front serves itself (POST /v2/models/...<suffix>): the generations. Every
# other request's connection is handed to aiohttp, which applies the surface's rules to it.
HOT_SUFFIXES = (b"/generate", b"/generate_stream", b"/infer")
# How often a loop-driven front checks its clients' deadlines when no event wakes it.
SWEEP_S = 0.1


def rules(limits: ClientLimits, keepalive_s: float, max_body: int,
          trusted: TrustedPeers | None = None) -> dict[str, Any]:
    """start()'s keyword arguments for the product's rules: which requests are the front's, the
    header tables, the deadlines and the answers of a cut."""
    return {"hot_suffixes": HOT_SUFFIXES, "max_body": max_body,
            "request_drop": sorted(n.encode() for n in UNTRUSTED_REQUEST_DROP),
            "response_drop": sorted(n.encode() for n in RESPONSE_DROP),
            "limits": (limits.header_timeout_s, limits.body_timeout_s, keepalive_s),
            "head_answer": head_timeout_answer(), "body_answer": body_timeout_answer(limits),
            # a trusted proxy's forwarding headers are kept: its connections are aiohttp's
            "trusted": trusted.__contains__ if trusted else None}


def _upstream_deadlines(settings: Any) -> tuple[float, float, float]:
    """The instance's deadlines as the front keeps them: to connect, between its bytes, and for the
    answer's head after the attempt began (--first-byte-timeout-s; 0: none)."""
    return settings.connect_timeout_s, settings.idle_timeout_s, settings.first_byte_timeout_s


class _Primed(asyncio.Protocol):
    """aiohttp's protocol for a connection the front handed over: fed the bytes the front had read
    before anything the socket brings next, so a pipelined request cannot overtake them."""

    def __init__(self, inner: asyncio.Protocol, first: bytes) -> None:
        self.inner = inner
        self.first = first

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.inner.connection_made(transport)
        self.inner.data_received(self.first)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class HandOff:
    """handoff(fd, bytes) for start(): the connection becomes a transport of the loop's, served by
    `factory`'s protocol (an aiohttp server) with the bytes the front read first. Owns the short
    tasks that make the transports."""

    def __init__(self, loop: asyncio.AbstractEventLoop, factory: Callable[[], asyncio.Protocol]) -> None:
        self._loop = loop
        self._factory = factory
        self._tasks: set[asyncio.Task[Any]] = set()  # the loop keeps weak references to tasks only

    def __call__(self, fd: int, first: bytes) -> None:
        conn = socket.socket(fileno=fd)
        task = self._loop.create_task(self._loop.connect_accepted_socket(lambda: _Primed(self._factory(), first),
                                                                          conn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def wrapped(self) -> None:
        """Wait for the transports being made (at a stop)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks))


def drive(loop: asyncio.AbstractEventLoop, epfd: int, rounds: int, after_sweep: Callable[[], None] | None = None,
          after_poll: Callable[[], None] | None = None) -> Callable[[], None]:
    """Run a started front on `loop`: poll() when its epoll fd is readable (up to `rounds` batches per
    wakeup, then `after_poll`), sweep() every SWEEP_S (then `after_sweep`). Returns what stops it."""
    if after_poll is None:
        loop.add_reader(epfd, NATIVE.poll, rounds)
    else:
        def ready() -> None:
            try:
                NATIVE.poll(rounds)
            finally:
                after_poll()

        loop.add_reader(epfd, ready)
    timer: list[asyncio.TimerHandle] = []

    def tick() -> None:
        NATIVE.sweep()
        if after_sweep is not None:
            after_sweep()
        timer[:] = [loop.call_later(SWEEP_S, tick)]

    tick()

    def stop() -> None:
        loop.remove_reader(epfd)
        for t in timer:
            t.cancel()

    return stop


# Batches of ready events one wakeup of the loop takes (dataplane_bench: 16 ran 0.96-0.97 x NGINX
# where one ran 0.88-0.89, at 2-4 workers).
DRAIN_ROUNDS = 16
STOP_POLL_S = 0.02


class Front:
    """One worker's compiled front, on its event loop: _front.c started with the product's rules and
    `FrontPath`'s callbacks over `proxy` (its EmbeddedProxy); the worker's acceptor hands it the
    public connections (`adopt`), and it hands `server` (the proxy's aiohttp server) those it does
    not serve. One per process (the C module's state is the process's)."""

    def __init__(self, proxy: Any, server: Any, log: Any) -> None:
        from orchestrator.dataplane.front.path import FrontPath
        self._server = server
        self._log = log
        self.path = FrontPath(proxy, NATIVE.instance, log)
        self._handoff: HandOff | None = None
        self._undrive: Callable[[], None] | None = None
        # Told when the front's count of open connections fell (the acceptor's share, accept.py)
        self.on_closed: Callable[[], None] | None = None
        self._open_seen = 0

    def start(self, settings: Any, limits: ClientLimits, keepalive_s: float) -> None:
        loop = asyncio.get_running_loop()
        self._handoff = HandOff(loop, self._server)
        path = self.path
        epfd = NATIVE.start(-1, [], decide=path.decide, release=path.release, retry=path.retry,
                            answered=path.answered, first=path.first, handoff=self._handoff,
                            upstream=_upstream_deadlines(settings),
                            itl_bounds=[b for b in ITL_BUCKETS if b != float("inf")],
                            **rules(limits, keepalive_s, settings.max_body_bytes, TrustedPeers(settings.trusted_proxy)))
        self._undrive = drive(loop, epfd, DRAIN_ROUNDS, self._after_sweep, after_poll=path.after_poll)

    def _after_sweep(self) -> None:
        self.path.account()  # what a sweep's deadlines ended, and what an abort() did
        now = NATIVE.open_count()
        if now < self._open_seen and self.on_closed is not None:
            self.on_closed()
        self._open_seen = now

    def configure(self, settings: Any, limits: ClientLimits, keepalive_s: float) -> None:
        """A reload's new numbers, for the requests that start from now on."""
        NATIVE.configure(limits=(limits.header_timeout_s, limits.body_timeout_s, keepalive_s),
                         upstream=_upstream_deadlines(settings),
                         max_body=settings.max_body_bytes, body_answer=body_timeout_answer(limits))

    @property
    def open_connections(self) -> int:
        return NATIVE.open_count()

    @property
    def served(self) -> int:
        return NATIVE.stats()["served"]

    def adopt(self, conn: socket.socket) -> None:
        NATIVE.adopt(conn.detach())

    def abort(self, host: str, port: int, answering: bool) -> int:
        slot = self.path.slot_known(host, port)
        return 0 if slot < 0 else NATIVE.abort(slot, answering)

    async def stop(self, grace_s: float, first_request_s: float) -> None:
        """Every connection closes after its next answer, which says Connection: close where its
        head is still to come. One with nothing on the way (accepted but silent, kept alive
        between requests, or its answer ended kept alive since) gets `first_request_s` for that
        request (it may be in flight: closed unread, the client would see a reset or a broken
        pipe), as GuardedServer.settle gives aiohttp's; what still runs after `grace_s` is cut
        (release: outcome cut, so the instances see the cancel)."""
        NATIVE.drain()
        began = time.monotonic()
        deadline = began + max(grace_s, 0.0)
        fresh_deadline = min(began + first_request_s, deadline)
        busy = None
        while time.monotonic() < deadline:
            now = NATIVE.stats()
            if busy is not None and now["busy"] < busy:
                # answers ended: their connections wait for a next request from now
                fresh_deadline = min(time.monotonic() + first_request_s, deadline)
            busy = now["busy"]
            if not busy and (not now["fresh"] or time.monotonic() >= fresh_deadline):
                break
            await asyncio.sleep(STOP_POLL_S)
        busy = NATIVE.stats()["busy"]
        if busy:
            self._log.warning("proxy stop: the front cuts %d request(s) still running after %.1fs", busy, grace_s)
        if self._undrive is not None:
            self._undrive()
        NATIVE.shutdown()  # every connection closes; another front may start in this process
        self.path.account()  # the counting still queued, the cut requests' too
        if self._handoff is not None:
            await self._handoff.wrapped()
