"""The public listening sockets: bound once, then accepted from many connections per wakeup.

Why not the event loop's own server: uvloop (libuv >= 1.45) takes one connection per
event-loop iteration, so that processes sharing a socket share its connections. A worker
busy relaying runs ~30 ms per iteration, so 256 clients connecting at once waited up to
seconds to be accepted. strace showed one accept4 per epoll_wait, and dataplane_bench
measured a p99 of 2.8-4 s at one worker against NGINX's 25-150 ms. NGINX's `multi_accept on`
takes every pending connection. `AcceptingSite` takes up to ACCEPT_BATCH per wakeup and
hands each to the loop's `connect_accepted_socket`, which makes the transport and calls the
protocol factory, as the loop's server would. It behaves the same on uvloop and on asyncio.

Where several workers accept from one socket, each takes only its share (`share`,
accept_share.py): the first worker awake would otherwise take a whole burst. Past its share
a worker stops watching the socket for DEFER_S and looks again, so a peer under its share
takes the rest; after DEFER_MAX_S of declining it takes one per look whatever the shares
say (a peer that counts as under its share may be busy or stuck).

With a compiled front (front/compiled.py, `--front compiled`) the accepted sockets go to it
(`adopt`) instead, while the connection cap allows: past it the aiohttp server takes the
connection, which refuses it with its 503.

The listening socket belongs to whoever bound it: the daemon for its workers (it passes the
same socket to each, and keeps it open while a worker is replaced), or the proxy itself in a
single process. A site stops accepting on `stop()`; it closes the socket only when it is the
owner (`owned`): then new connections are refused at once, as a stopping NGINX refuses them.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import time
from typing import Any

from aiohttp import web

from orchestrator.config import parse_host_port
from orchestrator.dataplane.accept_share import AcceptShare, queued
from orchestrator.errors import OrchError

# Connections the kernel keeps waiting for accept() on a public port. NGINX asks for 511 and
# the bench's NGINX 4096; at 128 (aiohttp's default) 256 clients connecting at once overflow
# it, their SYNs are dropped, and each waits out TCP's 1 s retransmit. The kernel caps it at
# net.core.somaxconn.
LISTEN_BACKLOG = 4096
# Per wakeup. The rest wait for the next iteration, and the other workers woken by the same
# socket take their share meanwhile.
ACCEPT_BATCH = 64
# After running out of file descriptors or memory, as asyncio's own server does: accepting
# again at once would spin on the same error.
ACCEPT_PAUSE_S = 1.0
# Past its share a worker looks again after DEFER_S; once it has declined for DEFER_MAX_S it
# takes one per look. A peer under its share takes its part on its next loop iteration (up to
# ~30 ms when busy relaying); one that does not (stuck, or not scheduled on a busy machine)
# delays a burst's clients by DEFER_MAX_S + DEFER_S per connection at most, and only until
# its heartbeat is stale (shared_table.ALIVE_S).
DEFER_S = 0.002
DEFER_MAX_S = 0.020
# At a stop, how long the sockets accepted already may take to become transports (a loop turn).
WRAP_WAIT_S = 1.0
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def bind_listener(address: str, flag: str) -> socket.socket:
    """A non-blocking listening TCP socket on `address` (inheritable through pass_fds)."""
    host, port = parse_host_port(address, flag)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
    except OSError as exc:
        raise OrchError(f"{flag}={address!r}: cannot listen: {exc.strerror or exc}") from None
    sock.setblocking(False)
    return sock


class _Acceptor:
    """What aiohttp's BaseSite keeps as its server: `sockets` (for the runner's addresses)
    and `close()`. Owns the short tasks that wrap each accepted socket in a transport."""

    def __init__(self, sock: socket.socket, factory: Any, log: logging.Logger, owned: bool = False,
                 share: AcceptShare | None = None, front: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._sock = sock
        self._owned = owned
        self._factory = factory
        self._log = log
        self._share = share
        self._front = front  # takes the connections (adopt) where given
        self._tasks: set[asyncio.Task[Any]] = set()
        self._resume: asyncio.TimerHandle | None = None
        self._declining_since: float | None = None
        self._last_warning = 0.0
        self._closed = False
        self.sockets = (sock,)
        if share is not None and hasattr(factory, "on_closed"):
            # A count published only at accepts went stale when clients left: the next burst
            # was shared out as if they were still open (25/15, 5/35 of 40 on 2 workers).
            factory.on_closed = lambda: share.publish(self._open())
            if front is not None:  # the front's clients leave too (it says so once per sweep)
                front.on_closed = factory.on_closed

    def start(self) -> None:
        self._resume = None
        self._loop.add_reader(self._sock.fileno(), self._accept_pending)
        if self._share is not None:
            self._share.accepting(True)

    def _open(self) -> int:
        # Served by the protocol factory (GuardedServer counts them), plus those accepted
        # whose transport is not made yet, plus the front's.
        front = self._front.open_connections if self._front is not None else 0
        return getattr(self._factory, "open_connections", 0) + len(self._tasks) + front

    def _batch(self) -> tuple[int, bool]:
        """How many to accept on this wakeup, and whether to stop watching the socket for
        DEFER_S after (past this worker's share: the rest are left to the other workers)."""
        share = self._share
        if share is None:
            return ACCEPT_BATCH, False
        waiting = queued(self._sock)
        if waiting == 0:
            self._declining_since = None  # a peer took them
            return 0, False
        n = share.budget(self._open(), waiting)
        if n > 0:
            self._declining_since = None
            return min(ACCEPT_BATCH, n), False
        now = self._loop.time()
        if self._declining_since is None:
            self._declining_since = now
        # No peer took them in DEFER_MAX_S (busy or stuck): one per DEFER_S, clients first.
        return int(now - self._declining_since >= DEFER_MAX_S), True

    def _look_again(self) -> None:
        if queued(self._sock) == 0:
            self._declining_since = None  # the peers took them: a later burst starts anew
        self.start()

    def _accept_pending(self) -> None:
        batch, defer = self._batch()
        for _ in range(batch):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                break
            except ConnectionAbortedError:
                continue  # the client gave up while queued
            except OSError as exc:
                if exc.errno not in _OUT_OF_RESOURCES:
                    raise
                self._pause(exc)
                return
            conn.setblocking(False)
            if self._front is not None and self._front_takes():
                self._front.adopt(conn)
                continue
            task = self._loop.create_task(self._loop.connect_accepted_socket(self._factory, conn))
            self._tasks.add(task)
            task.add_done_callback(self._wrapped)
        if batch and self._share is not None:
            self._share.publish(self._open())  # the peers woken by the same burst see these
        if defer:
            self._loop.remove_reader(self._sock.fileno())
            self._resume = self._loop.call_later(DEFER_S, self._look_again)

    def _front_takes(self) -> bool:
        limits = getattr(self._factory, "limits", None)
        return limits is None or self._open() < limits.max_connections

    def _wrapped(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # The client left between accept and the transport: nothing to serve.
            self._log.debug("accepted connection lost before serving: %r", task.exception())

    def _pause(self, exc: OSError) -> None:
        self._loop.remove_reader(self._sock.fileno())
        if self._share is not None:
            self._share.accepting(False)
        self._resume = self._loop.call_later(ACCEPT_PAUSE_S, self.start)
        now = time.monotonic()
        if now - self._last_warning >= 10.0:
            self._last_warning = now
            self._log.warning("accept on %s: %s; not accepting for %.0f s", self._sock.getsockname(),
                              exc.strerror, ACCEPT_PAUSE_S)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._share is not None:
            self._share.accepting(False)
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        else:
            self._loop.remove_reader(self._sock.fileno())
        # Sockets accepted whose transport is not made yet are left to finish (wrapped()):
        # cancelled, they were closed with the client's request unread in them, a reset.
        if self._owned:
            self._sock.close()

    async def wrapped(self, timeout_s: float = WRAP_WAIT_S) -> None:
        """After close(): wait for the accepted sockets' transports (one loop turn each); the
        runner's shutdown closes made ones, and those still unmade after `timeout_s` are
        cancelled."""
        if self._tasks:
            _, pending = await asyncio.wait(list(self._tasks), timeout=timeout_s)
            for task in pending:
                task.cancel()


class AcceptingSite(web.BaseSite):
    """aiohttp's SockSite with many accepts per wakeup (see the module's docstring)."""

    __slots__ = ("_sock", "_log", "_owned", "_share", "_front")

    def __init__(self, runner: web.BaseRunner, sock: socket.socket, log: logging.Logger, *, owned: bool,
                 share: AcceptShare | None = None, front: Any = None) -> None:
        super().__init__(runner, backlog=LISTEN_BACKLOG)
        self._sock = sock
        self._log = log
        self._owned = owned
        self._share = share
        self._front = front

    @property
    def name(self) -> str:
        host, port = self._sock.getsockname()[:2]
        return f"http://{host}:{port}"

    async def start(self) -> None:
        await super().start()
        # Again for a socket bound elsewhere: a listen() by anyone else (an event loop's
        # create_server passes aiohttp's 128) would have shrunk it.
        self._sock.listen(LISTEN_BACKLOG)
        server = self._runner.server
        assert server is not None
        acceptor = _Acceptor(self._sock, server, self._log, self._owned, self._share, self._front)
        acceptor.start()
        self._server = acceptor  # type: ignore[assignment]

    async def stop(self) -> None:
        acceptor = self._server
        await super().stop()
        if isinstance(acceptor, _Acceptor):
            await acceptor.wrapped()
