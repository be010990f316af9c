"""SystemdNotifier against real AF_UNIX datagram sockets (a path one and an abstract one)."""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from pathlib import Path

import pytest

from orchestrator.service.sdnotify import SystemdNotifier

pytestmark = pytest.mark.unit


@pytest.fixture
def receiver(tmp_path: Path):
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(2)
    yield str(path), sock
    sock.close()


def recv(sock: socket.socket) -> str:
    return sock.recv(4096).decode()


def test_messages_are_single_datagrams(receiver) -> None:
    path, sock = receiver
    n = SystemdNotifier({"NOTIFY_SOCKET": path})
    assert n.enabled
    n.ready()
    assert recv(sock) == "READY=1"
    n.ready("2/2 instances ready")
    assert recv(sock) == "READY=1\nSTATUS=2/2 instances ready"
    n.status("loading\nmodel   0")
    assert recv(sock) == "STATUS=loading model 0"  # a newline would be a second assignment
    n.extend_timeout(90)
    assert recv(sock) == "EXTEND_TIMEOUT_USEC=90000000"
    n.stopping()
    assert recv(sock) == "STOPPING=1"
    n.reloading()
    first, second = recv(sock).split("\n")
    assert first == "RELOADING=1" and second.startswith("MONOTONIC_USEC=")
    assert abs(int(second.split("=")[1]) - time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000) < 5_000_000
    n.close()


def test_abstract_socket() -> None:
    name = f"trtllm-orch-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(2)
    try:
        n = SystemdNotifier({"NOTIFY_SOCKET": "@" + name})
        n.ready()
        assert recv(sock) == "READY=1"
    finally:
        sock.close()


def test_watchdog(receiver) -> None:
    path, sock = receiver
    n = SystemdNotifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())})
    assert n.watchdog_interval() == 15.0
    n.watchdog()
    assert recv(sock) == "WATCHDOG=1"


def test_watchdog_for_another_process_is_ignored(receiver) -> None:
    path, sock = receiver
    n = SystemdNotifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"})
    assert n.watchdog_interval() is None
    n.watchdog()
    n.stopping()
    assert recv(sock) == "STOPPING=1"  # the watchdog ping was never sent


def test_without_notify_socket_everything_is_a_noop() -> None:
    n = SystemdNotifier({"WATCHDOG_USEC": "30000000"})
    assert not n.enabled
    assert n.watchdog_interval() is None
    for call in (n.ready, n.stopping, n.watchdog, lambda: n.status("x"), lambda: n.extend_timeout(5)):
        call()


def test_reads_os_environ_by_default(receiver, monkeypatch) -> None:
    path, sock = receiver
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    n = SystemdNotifier()
    n.ready()
    assert recv(sock) == "READY=1"


def test_send_failure_never_raises_and_logs_once(tmp_path: Path, caplog) -> None:
    n = SystemdNotifier({"NOTIFY_SOCKET": str(tmp_path / "missing.sock")})
    with caplog.at_level(logging.DEBUG, logger="orchestrator.service.sdnotify"):
        for _ in range(5):
            n.ready()
            n.watchdog()
            n.status("x")
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "missing.sock" in warnings[0].getMessage()


def test_full_socket_does_not_block(tmp_path: Path) -> None:
    path = tmp_path / "small.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    try:
        n = SystemdNotifier({"NOTIFY_SOCKET": str(path)})
        for _ in range(2000):  # nobody reads: the queue fills, sends fail with EAGAIN, we return
            n.status("x" * 1000)
    finally:
        sock.close()
