"""Accepting client connections (orchestrator/dataplane/accept.py): many per wakeup on the
loop the workers run (uvloop), a stopped site accepts nothing more and leaves its socket
open, and running out of file descriptors pauses accepting instead of spinning."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import time

import pytest

from orchestrator.dataplane import accept
from orchestrator.dataplane.accept_share import AcceptShare, queued
from orchestrator.dataplane.shared_table import ALIVE_S, SharedTable

uvloop = pytest.importorskip("uvloop")  # a dependency: the workers' loop

pytestmark = pytest.mark.unit

LOG = logging.getLogger("test.accept")


class Counting(asyncio.Protocol):
    made: list[asyncio.BaseTransport]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.made.append(transport)


def listener() -> socket.socket:
    return accept.bind_listener("127.0.0.1:0", "--listen")


def connect_all(port: int, n: int) -> list[socket.socket]:
    """n clients whose handshakes the kernel completes before the loop runs at all."""
    return [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]


def started(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> accept._Acceptor:
    async def start() -> accept._Acceptor:
        acceptor = accept._Acceptor(sock, Counting, LOG)
        acceptor.start()  # on the running loop, as the site starts it
        return acceptor
    return loop.run_until_complete(start())


def iterations(loop: asyncio.AbstractEventLoop, n: int) -> None:
    for _ in range(n):
        loop.run_until_complete(asyncio.sleep(0))


def close_all(loop: asyncio.AbstractEventLoop, transports: list[asyncio.BaseTransport],
              clients: list[socket.socket], sock: socket.socket, table: SharedTable | None = None) -> None:
    for t in transports:
        t.close()
    for c in clients:
        c.close()
    iterations(loop, 2)
    loop.close()
    sock.close()
    if table is not None:
        table.close()


def test_a_burst_of_connections_is_served_within_a_few_loop_iterations_on_uvloop():
    """On uvloop the loop's own server takes one connection per iteration (libuv >= 1.45):
    a worker busy relaying would leave 150 clients waiting 150 iterations."""
    loop = uvloop.new_event_loop()
    sock = listener()
    made: list[asyncio.BaseTransport] = []
    Counting.made = made
    clients = connect_all(sock.getsockname()[1], 150)
    try:
        acceptor = started(loop, sock)
        iterations(loop, 8)
        assert len(made) == 150
        acceptor.close()
    finally:
        close_all(loop, made, clients, sock)


def test_a_stopped_acceptor_takes_no_more_connections_and_leaves_the_socket_to_its_owner():
    loop = uvloop.new_event_loop()
    sock = listener()
    made: list[asyncio.BaseTransport] = []
    Counting.made = made
    try:
        acceptor = started(loop, sock)
        acceptor.close()
        clients = connect_all(sock.getsockname()[1], 3)
        iterations(loop, 5)
        assert made == [] and sock.fileno() != -1
        sock.setblocking(True)
        sock.settimeout(1)
        sock.accept()[0].close()  # still listening: the owner (the daemon) decides when it closes
        for c in clients:
            c.close()
    finally:
        loop.close()
        sock.close()


class OutOfFds:
    """A listening socket whose next accept fails as with no file descriptor left."""

    def __init__(self, sock: socket.socket, failures: int) -> None:
        self._sock = sock
        self.failures = failures

    def accept(self) -> tuple[socket.socket, object]:
        if self.failures:
            self.failures -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return self._sock.accept()

    def fileno(self) -> int:
        return self._sock.fileno()

    def getsockname(self) -> object:
        return self._sock.getsockname()


def test_running_out_of_file_descriptors_pauses_accepting_then_resumes(monkeypatch, caplog):
    monkeypatch.setattr(accept, "ACCEPT_PAUSE_S", 0.2)
    loop = uvloop.new_event_loop()
    sock = listener()
    made: list[asyncio.BaseTransport] = []
    Counting.made = made
    flaky = OutOfFds(sock, failures=1)
    clients = connect_all(sock.getsockname()[1], 5)
    try:
        async def scenario() -> tuple[int, int]:
            acceptor = accept._Acceptor(flaky, Counting, LOG)  # type: ignore[arg-type]
            acceptor.start()
            for _ in range(5):
                await asyncio.sleep(0)
            during = len(made)
            await asyncio.sleep(0.5)
            acceptor.close()
            return during, len(made)

        with caplog.at_level(logging.WARNING, logger=LOG.name):
            during, after = loop.run_until_complete(scenario())
        assert during == 0 and after == 5
        assert flaky.failures == 0 and "Too many open files" in caplog.text
    finally:
        for t in made:
            t.close()
        for c in clients:
            c.close()
        loop.close()
        sock.close()


# --- several workers on one socket (accept_share.py) ----------------------------------------
class Served:
    """A protocol factory that counts what it serves, as GuardedServer does."""

    def __init__(self) -> None:
        self.open_connections = 0
        self.on_closed = None
        self.transports: list[asyncio.BaseTransport] = []

    def __call__(self) -> asyncio.Protocol:
        server = self

        class Proto(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                server.open_connections += 1
                server.transports.append(transport)

            def connection_lost(self, exc: BaseException | None) -> None:
                server.open_connections -= 1
                if server.on_closed is not None:
                    server.on_closed()

        return Proto()


def table_with_workers(tmp_path, *slots: int, accepting: bool = True) -> SharedTable:
    table = SharedTable.create(tmp_path / "table")
    now = time.monotonic()
    for w in slots:
        table.beat(w, now)
        table.set_accepting(w, accepting)
    return table


def test_two_workers_on_one_socket_each_take_half_of_a_burst(tmp_path):
    """Every worker is woken for the same connections; the first awake took all 64 of them
    (the other 0) before each took only its share."""
    loop = uvloop.new_event_loop()
    sock = listener()
    table = table_with_workers(tmp_path, 0, 1)
    servers = [Served(), Served()]
    # One kernel socket, two descriptors: two registrations, woken alike, as two processes are.
    socks = [sock, sock.dup()]
    clients = connect_all(sock.getsockname()[1], 64)
    try:
        async def scenario() -> list[accept._Acceptor]:
            acceptors = [accept._Acceptor(s, srv, LOG, share=AcceptShare(table, w))
                         for w, (s, srv) in enumerate(zip(socks, servers))]
            for a in acceptors:
                a.start()
            for _ in range(20):
                await asyncio.sleep(0.005)
            return acceptors

        acceptors = loop.run_until_complete(scenario())
        served = [srv.open_connections for srv in servers]
        assert sum(served) == 64 and min(served) >= 24, served
        for a in acceptors:
            a.close()
    finally:
        socks[1].close()
        close_all(loop, [t for srv in servers for t in srv.transports], clients, sock, table)


def test_a_peer_that_counts_as_under_its_share_but_never_accepts_delays_clients_only_briefly(tmp_path):
    """Slot 1 is alive and accepting by the table, with no connection, and takes none: this
    worker (slot 0) declines past its share, then serves every client within the bound."""
    loop = uvloop.new_event_loop()
    sock = listener()
    table = table_with_workers(tmp_path, 0, 1)
    server = Served()
    clients = connect_all(sock.getsockname()[1], 20)
    try:
        async def scenario() -> float:
            acceptor = accept._Acceptor(sock, server, LOG, share=AcceptShare(table, 0))
            t0 = time.monotonic()
            acceptor.start()
            while server.open_connections < 20 and time.monotonic() - t0 < 2.0:
                await asyncio.sleep(0.001)
            acceptor.close()
            return time.monotonic() - t0

        took = loop.run_until_complete(scenario())
        assert server.open_connections == 20
        assert took < 0.5, took  # DEFER_MAX_S (20 ms), then one per DEFER_S (2 ms), on a busy box
    finally:
        close_all(loop, server.transports, clients, sock, table)


def test_share_is_an_equal_part_of_open_and_waiting_connections_among_live_accepting_workers(tmp_path):
    table = table_with_workers(tmp_path, 0, 1, 2)
    table.set_connections(1, 10)
    table.set_connections(2, 20)
    clock = [time.monotonic()]
    share = AcceptShare(table, 0, clock=lambda: clock[0])
    assert share.budget(0, 30) == 20  # (0 + 10 + 20 + 30) / 3
    assert table.connections(0) == 0  # it published what it holds
    assert share.budget(25, 1) == 0  # past its share: left to the others
    assert share.budget(15, 1) == 1  # under its share: ceil((15 + 1 + 30) / 3) = 16
    # A peer that stops accepting (at once, not at the next look at the slots), or whose
    # heartbeat is stale, has no share.
    table.set_accepting(2, False)
    assert share.budget(0, 30) == 20  # (0 + 10 + 30) / 2
    clock[0] += 1.0
    clock[0] += ALIVE_S + 1.0
    assert share.budget(0, 30) == 30  # every peer's heartbeat is stale: alone


def test_queued_counts_the_listening_sockets_accept_queue():
    sock = listener()
    clients = connect_all(sock.getsockname()[1], 5)
    try:
        assert queued(sock) == 5
        sock.setblocking(True)
        sock.accept()[0].close()
        assert queued(sock) == 4
    finally:
        for c in clients:
            c.close()
        sock.close()


def test_a_workers_published_count_falls_when_its_clients_leave(tmp_path):
    """The peers share out the next burst on what each worker holds open: a count published
    only at accepts kept the clients that had left (a later burst of 40 went 5/35)."""
    loop = uvloop.new_event_loop()
    sock = listener()
    table = table_with_workers(tmp_path, 0)
    server = Served()
    clients = connect_all(sock.getsockname()[1], 10)
    try:
        async def scenario() -> tuple[int, int]:
            acceptor = accept._Acceptor(sock, server, LOG, share=AcceptShare(table, 0))
            acceptor.start()
            while server.open_connections < 10:
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.01)
            after_accept = table.connections(0)
            for c in clients[:7]:
                c.close()
            deadline = time.monotonic() + 2.0
            while server.open_connections > 3 and time.monotonic() < deadline:
                await asyncio.sleep(0.001)  # (their EOFs close the transports)
            acceptor.close()
            return after_accept, table.connections(0)

        after_accept, after_leaving = loop.run_until_complete(scenario())
        assert after_accept == 10
        assert after_leaving == 3  # published without a new accept
    finally:
        close_all(loop, server.transports, clients, sock, table)
