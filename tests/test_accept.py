"""Accepting client connections (orchestrator/dataplane/accept.py): many per wakeup on the
loop the workers run (uvloop), a stopped site accepts nothing more and leaves its socket
open, and running out of file descriptors pauses accepting instead of spinning."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket

import pytest

from orchestrator.dataplane import accept

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
        for t in made:
            t.close()
        for c in clients:
            c.close()
        iterations(loop, 2)
        loop.close()
        sock.close()


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
