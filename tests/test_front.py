"""The data plane's compiled front (orchestrator/dataplane/front/_front.c, issue 22's plan), run by
bench/_compiled_front.py as dataplane_bench measures it against NGINX: real processes and sockets,
bench/sse_source.c and http.server instances. It must relay what a relay must (every byte of every
answer, in order, on kept connections, each request's count released however the answer ended)
and keep the product's rules: header hygiene both ways, slow clients cut, and every request that
is not its own handed to aiohttp."""

from __future__ import annotations

import http.server
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from multidict import CIMultiDict

from bench.common import REPO, free_port
from bench.wrk import SseSource
from orchestrator.dataplane.front.compiled import NATIVE
from orchestrator.dataplane.headers import client_response_headers, upstream_request_headers
from orchestrator.dataplane.shared_prefix import SharedPrefixIndex
from orchestrator.dataplane.shared_table import GlobalInflight, SharedTable

pytestmark = pytest.mark.process

BODY = b'{"text_input": "What is the capital of France?", "max_tokens": 8, "stream": true}'
REQUEST = (b"POST /v2/models/ensemble/generate_stream HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n" % len(BODY)) + BODY
LAST = b"0\r\n\r\n"


@pytest.fixture(scope="module")
def front_built() -> None:
    if NATIVE is None:
        pytest.skip("the compiled front is not built here (no C compiler when setup.py ran)")


def start_front(_: None, ports: list[int], tmp: Path, decide: str = "c", loop: str = "c",
                extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, int]:
    port = free_port()
    ready = tmp / f"ready-{port}"
    argv = [sys.executable, "-m", "bench._compiled_front", "--port", str(port), "--ports", ",".join(map(str, ports)),
            "--decide", decide, "--loop", loop, "--ready", str(ready), *extra]
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
def test_pipelined_streams_arrive_whole_and_in_order_on_one_connection(front_built, sources, tmp_path, loop):
    direct = one_answer(sources[0].port)
    assert direct.startswith(b"HTTP/1.1 200") and direct.count(b"data:") == 8
    proc, port = start_front(front_built, [s.port for s in sources], tmp_path, loop=loop)
    try:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(REQUEST * 3)  # three requests in one write: answered one after the other
            assert read_answers(s, 3) == direct * 3
            s.sendall(REQUEST)  # the connection is kept for the next one
            assert read_answers(s, 1) == direct
    finally:
        stop(proc)


def test_the_c_decision_passes_over_an_instance_that_refuses(front_built, sources, tmp_path):
    dead = free_port()  # nothing listens there
    proc, port = start_front(front_built, [dead, sources[0].port], tmp_path)
    try:
        answers = [one_answer(port) for _ in range(6)]
        assert all(a.startswith(b"HTTP/1.1 200") and a.count(b"data:") == 8 for a in answers)
    finally:
        stop(proc)


def test_the_python_decision_releases_every_count(front_built, sources, shared_state):
    state, inflight = shared_state
    dead = free_port()
    proc, port = start_front(front_built, [sources[0].port, sources[1].port, dead], state, decide="python")
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
            proc, port = start_front(front_built, [slow.port], state, decide="python")
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


def test_an_answer_framed_by_its_length_is_relayed_whole_twice_on_one_connection(front_built, tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Fixed)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    proc, port = start_front(front_built, [server.server_address[1]], tmp_path)
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


def test_other_routes_go_to_aiohttp_on_the_same_connection_with_the_bytes_already_read(front_built, sources,
                                                                                        tmp_path):
    """The front's hand-off (issue 22's plan: the hot native routes in C, every other request to the
    worker's aiohttp side): a connection whose request is not a hot route is aiohttp's from then
    on, the bytes the front read included, pipelined ones after them."""
    direct = one_answer(sources[0].port)
    proc, port = start_front(front_built, [sources[0].port], tmp_path, loop="asyncio", extra=("--handoff",))
    try:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(REQUEST)  # hot: relayed by the front, its head cleaned (test_the_answers_head_...)
            relayed = read_answers(s, 1)
            assert relayed.split(b"\r\n\r\n", 1)[1] == direct.split(b"\r\n\r\n", 1)[1]
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


HANDOFF = ("--handoff", "--limits", "0.6,0.6,1.2")


def read_response(sock: socket.socket, timeout: float = 10.0) -> tuple[int, CIMultiDict[str], bytes]:
    """One answer framed by its Content-Length: (status, headers, body)."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        more = sock.recv(65536)
        assert more, f"closed before a whole head: {data!r}"
        data += more
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers: CIMultiDict[str] = CIMultiDict()
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers.add(name, value.strip())
    while len(body) < int(headers.get("Content-Length", "0")):
        more = sock.recv(65536)
        assert more, "closed mid-body"
        body += more
    return int(lines[0].split()[1]), headers, body


class _Echo(http.server.BaseHTTPRequestHandler):
    """An instance that answers with the headers it was sent (JSON), and the headers `reply` names."""

    protocol_version = "HTTP/1.1"
    reply: list[tuple[str, str]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        out = json.dumps({"headers": list(self.headers.items()), "body": body.decode()}).encode()
        self.send_response(200)
        for name, value in self.reply:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def echo():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def _names(headers) -> set[tuple[str, str]]:
    return {(k.lower(), v) for k, v in headers}


def test_the_instance_gets_the_request_headers_the_embedded_path_sends(front_built, echo, tmp_path):
    """Header hygiene toward the instance, held to headers.py's one definition: the hop-by-hop
    headers and those Connection names are gone, a client's forwarding headers are replaced by
    the socket's (the peer is no trusted proxy), Host and Content-Length are the front's (bodies
    of one to five digits' length, and none)."""
    proc, port = start_front(front_built, [echo], tmp_path, loop="asyncio", extra=HANDOFF)
    try:
        with socket.create_connection(("127.0.0.1", port)) as s:
            short = '{"text_input": "hi", "max_tokens": 2}'
            long = '{"text_input": "%s"}' % ("x" * 12000)
            for body in (short, short, "", "7", long):  # the first again on the kept connection
                sent = [("Host", "public.example"), ("Connection", "keep-alive, X-Secret"), ("X-Secret", "1"),
                        ("Keep-Alive", "timeout=5"), ("TE", "trailers"), ("Proxy-Authorization", "Basic eA=="),
                        ("X-Forwarded-For", "6.6.6.6"), ("X-Real-IP", "6.6.6.6"), ("Forwarded", "for=6.6.6.6"),
                        ("X-Forwarded-Proto", "https"), ("X-Custom", "kept"), ("Content-Type", "application/json"),
                        ("Content-Length", str(len(body)))]
                request = ("POST /v2/models/ensemble/generate HTTP/1.1\r\n" +
                           "".join(f"{k}: {v}\r\n" for k, v in sent) + "\r\n" + body).encode()
                s.sendall(request)
                status, _, answer = read_response(s)
                assert status == 200
                seen = json.loads(answer)
                assert seen["body"] == body
                expected = upstream_request_headers(CIMultiDict(sent), "127.0.0.1", False)
                expected.update({"Host": f"127.0.0.1:{echo}", "Content-Length": str(len(body))})
                assert _names(seen["headers"]) == _names(expected.items())
    finally:
        stop(proc)


def test_the_answers_head_is_cleaned_as_the_embedded_path_cleans_it(front_built, echo, tmp_path):
    """Toward the client: the instance's hop-by-hop headers and those its Connection names are
    gone (headers.client_response_headers), a Date is added, the rest and the body arrive as sent."""
    _Echo.reply = [("Connection", "X-Hop"), ("X-Hop", "1"), ("Keep-Alive", "timeout=5"),
                   ("Proxy-Authenticate", "Basic"), ("Trailer", "X-T"), ("X-Kept", "yes")]
    proc, port = start_front(front_built, [echo], tmp_path, loop="asyncio", extra=HANDOFF)
    try:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(REQUEST)
            status, headers, answer = read_response(s)
    finally:
        _Echo.reply = []
        stop(proc)
    assert status == 200 and json.loads(answer)["body"] == BODY.decode()
    expected = client_response_headers(CIMultiDict([("Connection", "X-Hop"), ("X-Hop", "1"),
                                                    ("Keep-Alive", "timeout=5"), ("Proxy-Authenticate", "Basic"),
                                                    ("Trailer", "X-T"), ("X-Kept", "yes"),
                                                    ("Content-Length", str(len(answer)))]), keep_length=True)
    got = CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in ("date", "server"))
    assert _names(got.items()) == _names(expected.items())
    assert "Date" in headers


def test_slow_clients_are_cut_and_idle_ones_closed(front_built, echo, tmp_path):
    """client_guard.py's deadlines, kept by the front: a head not whole in time gets its 408 and the
    connection closes, a body the same, a kept connection idle past its keep-alive closes. A
    request sent in time is served."""
    proc, port = start_front(front_built, [echo], tmp_path, loop="asyncio", extra=HANDOFF)

    def closed_after(sock: socket.socket) -> bytes:
        sock.settimeout(10)
        data = b""
        while more := sock.recv(65536):
            data += more
        return data

    try:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(REQUEST[:30])  # a head trickled: never whole
            answer = closed_after(s)
            assert answer.startswith(b"HTTP/1.1 408") and b"request head not received in time" in answer
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(REQUEST[:-10])  # the head, and the body but its last bytes
            answer = closed_after(s)
            assert answer.startswith(b"HTTP/1.1 408") and b"request body not received within 0.6 s" in answer
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(REQUEST)
            assert read_response(s)[0] == 200
            began = time.monotonic()
            assert closed_after(s) == b""  # kept, then closed once idle past the keep-alive
            assert time.monotonic() - began >= 0.5  # not at once: 1.2 s after the answer (read late on a busy box)
    finally:
        stop(proc)


@pytest.mark.parametrize("request_bytes", [
    b"POST /v2/models/m/generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    b"POST /v2/models/m/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"2\r\n{}\r\n0\r\n\r\n",
    b"POST /v2/models/m/generate HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n{}",
    b"POST /v2/models/m/generate HTTP/1.0\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}",
    b"GET /v2/models/m/generate HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /v2/models/m/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 2000000\r\n\r\n{}",
    b"POST /v2/models/m/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n{}",
    b"POST /v2/models/m/generate HTTP/1.1\r\nHost: x\r\n X-Folded: y\r\nContent-Length: 2\r\n\r\n{}",
], ids=["chunked", "chunked-and-length", "expect", "http10", "get", "over-max-body", "two-lengths", "folded"])
def test_requests_the_front_does_not_take_are_answered_by_aiohttp(front_built, echo, tmp_path, request_bytes):
    """The edge cases stay the embedded path's: the front hands their connections to aiohttp,
    which answers them (here its only route is the health check: a 4xx or 5xx of its own, never
    the instance's 200)."""
    proc, port = start_front(front_built, [echo], tmp_path, loop="asyncio", extra=HANDOFF)
    try:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(request_bytes)
            s.settimeout(10)
            first = s.recv(65536)
            if first.startswith(b"HTTP/1.1 100 Continue\r\n\r\n"):  # aiohttp's answer to the Expect
                first = first[25:] or s.recv(65536)
        assert first.startswith((b"HTTP/1.1 4", b"HTTP/1.0 4", b"HTTP/1.1 5", b"HTTP/1.0 5")), first[:200]
        assert b"Server: Python/" in first and b"aiohttp" in first  # aiohttp's answer, not the front's own
        assert b'"headers"' not in first  # the instance never saw it
    finally:
        stop(proc)
