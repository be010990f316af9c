"""bench/_compiled_front.c, the compiled front dataplane_bench measures against NGINX (issue 22's
plan): real processes and sockets, bench/sse_source.c as the instances. Its numbers mean something
only if it relays what a relay must: every byte of every answer, in order, on kept connections, with
each request's count released however the answer ended."""

from __future__ import annotations

import http.server
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from bench._compiled_front import build
from bench.common import REPO, free_port
from bench.wrk import SseSource
from orchestrator.dataplane.shared_prefix import SharedPrefixIndex
from orchestrator.dataplane.shared_table import GlobalInflight, SharedTable

pytestmark = pytest.mark.process

BODY = b'{"text_input": "What is the capital of France?", "max_tokens": 8, "stream": true}'
REQUEST = (b"POST /v2/models/ensemble/generate_stream HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n" % len(BODY)) + BODY
LAST = b"0\r\n\r\n"


@pytest.fixture(scope="module")
def module_dir() -> Path:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: bench/_compiled_front.c cannot be built here")
    built = build()
    yield built
    shutil.rmtree(built, ignore_errors=True)


def start_front(module_dir: Path, ports: list[int], tmp: Path, decide: str = "c", loop: str = "c",
                extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, int]:
    port = free_port()
    ready = tmp / f"ready-{port}"
    argv = [sys.executable, "-m", "bench._compiled_front", "--port", str(port), "--ports", ",".join(map(str, ports)),
            "--decide", decide, "--loop", loop, "--module-dir", str(module_dir), "--ready", str(ready), *extra]
    if decide != "c":
        argv += ["--state", str(tmp), "--slot", "0"]
    proc = subprocess.Popen(argv, cwd=REPO, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the front did not start"
        time.sleep(0.02)
    return proc, port


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(10)


def read_answers(sock: socket.socket, n: int, timeout: float = 10.0) -> bytes:
    """Bytes until `n` chunked answers have ended (sse_source's last chunk ends each)."""
    sock.settimeout(timeout)
    data = b""
    while data.count(LAST) < n:
        more = sock.recv(65536)
        assert more, f"closed after {data.count(LAST)} of {n} answers"
        data += more
    return data


def one_answer(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(REQUEST)
        return read_answers(s, 1)


@pytest.fixture
def sources():
    items = [SseSource(8, 0).start() for _ in range(2)]
    yield items
    for s in items:
        s.stop()


@pytest.fixture
def shared_state(tmp_path):
    table = SharedTable.create(tmp_path / "table")
    prefixes = SharedPrefixIndex.create(tmp_path / "prefixes")
    yield tmp_path, GlobalInflight(table)
    prefixes.close()
    table.close()


@pytest.mark.parametrize("loop", ["c", "asyncio"])
def test_pipelined_streams_arrive_whole_and_in_order_on_one_connection(module_dir, sources, tmp_path, loop):
    direct = one_answer(sources[0].port)
    assert direct.startswith(b"HTTP/1.1 200") and direct.count(b"data:") == 8
    proc, port = start_front(module_dir, [s.port for s in sources], tmp_path, loop=loop)
    try:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(REQUEST * 3)  # three requests in one write: answered one after the other
            assert read_answers(s, 3) == direct * 3
            s.sendall(REQUEST)  # the connection is kept for the next one
            assert read_answers(s, 1) == direct
    finally:
        stop(proc)


def test_the_c_decision_passes_over_an_instance_that_refuses(module_dir, sources, tmp_path):
    dead = free_port()  # nothing listens there
    proc, port = start_front(module_dir, [dead, sources[0].port], tmp_path)
    try:
        answers = [one_answer(port) for _ in range(6)]
        assert all(a.startswith(b"HTTP/1.1 200") and a.count(b"data:") == 8 for a in answers)
    finally:
        stop(proc)


def test_the_python_decision_releases_every_count(module_dir, sources, shared_state):
    state, inflight = shared_state
    dead = free_port()
    proc, port = start_front(module_dir, [sources[0].port, sources[1].port, dead], state, decide="python")
    try:
        # concurrent streams on kept connections, through the product's balancer
        conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(8)]
        for _ in range(5):
            for c in conns:
                c.sendall(REQUEST)
            for c in conns:
                answer = read_answers(c, 1)
                # the policy may pick the instance that refuses: 502, not a hang, its count released
                assert answer.startswith(b"HTTP/1.1 200") and answer.count(b"data:") == 8 or \
                    answer.startswith(b"HTTP/1.1 502")
        for c in conns:
            c.close()
        # a client gone mid-stream: its instance's connection is dropped and its count released
        slow = SseSource(50, 20_000).start()
        try:
            stop(proc)
            proc, port = start_front(module_dir, [slow.port], state, decide="python")
            with socket.create_connection(("127.0.0.1", port)) as c:
                c.sendall(REQUEST)
                c.settimeout(5)
                # the head and the first event may come in separate reads
                seen = b""
                while b"data:" not in seen:
                    more = c.recv(65536)
                    assert more, f"closed before the first event: {seen!r}"
                    seen += more
                assert inflight.get("0") == 1
            deadline = time.monotonic() + 5
            while inflight.get("0") and time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            slow.stop()
        assert [inflight.get(str(i)) for i in range(3)] == [0, 0, 0]
    finally:
        stop(proc)


class _Fixed(http.server.BaseHTTPRequestHandler):
    """An instance answering with a Content-Length (HTTP/1.1, kept) instead of chunks."""

    protocol_version = "HTTP/1.1"
    body = b"x" * 100_000

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


def test_an_answer_framed_by_its_length_is_relayed_whole_twice_on_one_connection(module_dir, tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Fixed)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    proc, port = start_front(module_dir, [server.server_address[1]], tmp_path)
    try:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.settimeout(10)
            for _ in range(2):
                s.sendall(REQUEST)
                data = b""
                while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < len(_Fixed.body):
                    more = s.recv(65536)
                    assert more
                    data += more
                head, body = data.split(b"\r\n\r\n", 1)
                assert head.startswith(b"HTTP/1.1 200") and body == _Fixed.body
    finally:
        stop(proc)
        server.shutdown()


def test_other_routes_go_to_aiohttp_on_the_same_connection_with_the_bytes_already_read(module_dir, sources,
                                                                                        tmp_path):
    """The front's hand-off (issue 22's plan: the hot native routes in C, every other request to the
    worker's aiohttp side): a connection whose request is not a hot route is aiohttp's from then
    on, the bytes the front read included, pipelined ones after them."""
    direct = one_answer(sources[0].port)
    proc, port = start_front(module_dir, [sources[0].port], tmp_path, loop="asyncio", extra=("--handoff",))
    try:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(REQUEST)  # hot: relayed by the front
            assert read_answers(s, 1) == direct
        health = b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n"
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.settimeout(10)
            s.sendall(health * 2 + b"GET /v2/models/x/config HTTP/1.1\r\nHost: x\r\n\r\n")
            data = b""
            while data.count(b"HTTP/1.1 ") < 3:
                more = s.recv(65536)
                assert more
                data += more
            answers = data.split(b"HTTP/1.1 ")[1:]
            assert [a[:3] for a in answers] == [b"200", b"200", b"404"]
            assert b"ready (aiohttp)" in answers[0] and b"ready (aiohttp)" in answers[1]
            s.sendall(health)  # the connection stays aiohttp's
            data = b""
            while b"ready (aiohttp)" not in data:
                more = s.recv(65536)
                assert more
                data += more
    finally:
        stop(proc)
