"""One worker of the compiled front (bench/_compiled_front.c): issue 22's plan, measured.

    python -m bench._compiled_front --port P --ports P0,P1,... [--decide c|python|python-full --state DIR --slot K]
                                    [--loop c|asyncio|asyncio-drain [--handoff]]

Binds 127.0.0.1:P with SO_REUSEPORT (as the NGINX of bench/dataplane_bench.py does: W processes,
one socket each, the kernel spreads the connections), writes `--ready PATH` once listening, and
relays until SIGTERM. `--decide c`: least requests in flight in C (NGINX's least_conn), the bound a
compiled decision reaches. `--decide python`: the product's balancer and default policy, called once
per request from C (bench/_route_decider.py's `Decider`, on the workers' shared table and prefix
index in DIR, slot K), the count released from C when the answer ends; `python-full` also runs the
embedded path's other per-request Python (`_full_rules`). Not a product path.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

SOURCE = Path(__file__).with_name("_compiled_front.c")


def build() -> Path:
    """Compile the extension into a new directory (the tree is not written); that directory."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc) for bench/_compiled_front.c")
    out = Path(tempfile.mkdtemp(prefix="bench-front-"))
    so = out / ("_compiled_front" + sysconfig.get_config_var("EXT_SUFFIX"))
    subprocess.run([cc, "-O2", "-Wall", "-shared", "-fPIC", "-I", sysconfig.get_paths()["include"],
                    "-o", str(so), str(SOURCE)], check=True)
    return out


def load(directory: Path) -> ModuleType:
    sys.path.insert(0, str(directory))
    return importlib.import_module("_compiled_front")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--ports", required=True)
    ap.add_argument("--decide", choices=("c", "python", "python-full"), default="c",
                    help="python-full: also the product's other per-request Python (headers, metrics)")
    ap.add_argument("--state", type=Path)
    ap.add_argument("--slot", type=int, default=0)
    ap.add_argument("--policy", default="prefix-affinity")
    ap.add_argument("--module-dir", type=Path, help="where build() put the extension (else built here)")
    ap.add_argument("--ready", type=Path)
    ap.add_argument("--loop", choices=("c", "asyncio", "asyncio-drain"), default="c",
                    help="c: the front's own blocking loop; asyncio: an asyncio loop (uvloop) drives it, a batch "
                         "of events per wakeup; asyncio-drain: up to 16 batches per wakeup")
    ap.add_argument("--handoff", action="store_true",
                    help="(--loop asyncio) requests other than the native generate/infer routes go to aiohttp")
    args = ap.parse_args()
    if args.loop != "c":
        try:
            import uvloop
            uvloop.install()
        except ImportError:
            pass
    ports = [int(p) for p in args.ports.split(",")]
    front = load(args.module_dir or build())
    decide = release = None
    if args.decide == "python":
        _, decide, release = _route_rules(args.state, args.slot, ports, args.policy)
    elif args.decide == "python-full":
        decide, release = _full_rules(args.state, args.slot, ports, args.policy)

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", args.port))
    sock.listen(4096)
    sock.setblocking(False)
    if args.ready is not None and args.loop == "c":
        args.ready.write_text("listening\n")
    try:
        if args.loop != "c":
            asyncio.run(_driven(front, sock, ports, decide, release, args.ready, args.handoff,
                                rounds=16 if args.loop == "asyncio-drain" else 1,
                                decide_head=args.decide == "python-full"))
        else:
            front.serve(sock.fileno(), ports, decide, release, decide_head=args.decide == "python-full")
    except KeyboardInterrupt:
        pass
    return 0


# The native routes the front serves itself; every other request's connection is handed to aiohttp.
HOT_SUFFIXES = (b"/generate", b"/generate_stream", b"/infer")


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


async def _aiohttp_side() -> Any:
    """What a worker's aiohttp server would answer on handed connections: here one route."""
    from aiohttp import web

    async def ready(_: web.Request) -> web.Response:
        return web.Response(text="ready (aiohttp)")

    app = web.Application()
    app.router.add_get("/v2/health/ready", ready)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    return runner


def _route_rules(state: Path, slot: int, ports: list[int], policy: str) -> tuple[Any, Any, Any]:
    """(the Decider, decide(body) -> instance index or -1, release(index)): the product's route as
    the split's deciders take it, the count acquired by decide and released by release."""
    from bench._route_decider import Decider
    decider = Decider(state, slot, ports, policy)
    ids = [b.instance_id for b in decider.backends]
    index = {iid: i for i, iid in enumerate(ids)}

    def decide(body: bytes) -> int:
        iid = decider.route(body)
        return -1 if iid is None else index[iid]

    def release(i: int) -> None:
        decider.balancer.release(ids[i])

    return decider, decide, release


def _full_rules(state: Path, slot: int, ports: list[int], policy: str) -> tuple[Any, Any]:
    """decide(head, body) and release(i) doing, besides the route, the other Python the embedded
    path runs per request (its cost, not its effect: the front still sends the request's bytes as
    they came): the head parsed into headers, the instance's request headers, the routing and
    in-flight metrics and the generation's timer at the request; the count, the client's response
    headers and head, the timer's event and end at the answer's end. Left out: the per-read SSE
    count (`SseCounter`), which would run per event, not per request."""
    from collections import deque

    import httptools
    from multidict import CIMultiDict

    from orchestrator.dataplane.headers import client_response_headers, upstream_request_headers
    from orchestrator.dataplane.metrics import ProxyMetrics
    from orchestrator.dataplane.response_head import response_head

    decider, route, unroute = _route_rules(state, slot, ports, policy)
    balancer = decider.balancer
    metrics = ProxyMetrics()
    ids = [b.instance_id for b in decider.backends]
    open_requests: list[deque] = [deque() for _ in ids]  # (timer, gauge) per request, per instance
    answer_headers = CIMultiDict({"Content-Type": "text/event-stream", "Transfer-Encoding": "chunked"})

    class _Head:
        def __init__(self) -> None:
            self.headers: CIMultiDict[str] = CIMultiDict()

        def on_header(self, name: bytes, value: bytes) -> None:
            self.headers.add(name.decode("latin-1"), value.decode("latin-1"))

    def decide(head: bytes, body: bytes) -> int:
        parsed = _Head()
        httptools.HttpRequestParser(parsed).feed_data(head)
        i = route(body)
        if i < 0:
            return -1
        iid = ids[i]
        timer = metrics.timer("generate_stream")
        metrics.routed(balancer.policy, balancer.last_reason, iid)
        if balancer.last_decision is not None:
            metrics.route_decision(balancer.last_decision, timer)
        gauge = metrics.inflight_child(iid)
        gauge.inc()
        up = upstream_request_headers(parsed.headers, "127.0.0.1", False)
        b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in up.items())  # the head to send
        open_requests[i].append((timer, gauge))
        return i

    def release(i: int) -> None:
        unroute(i)
        iid = ids[i]
        timer, gauge = open_requests[i].popleft()
        gauge.dec()
        metrics.count(iid, 200)
        response_head(200, "OK", client_response_headers(answer_headers, keep_length=False), version=(1, 1),
                      framed=True, keep_alive=True)
        timer.events(iid, 1)
        timer.attempt_over()

    return decide, release


async def _driven(front: ModuleType, sock: socket.socket, ports: list[int], decide: Any, release: Any,
                  ready: Path | None, handoff: bool = False, rounds: int = 1, decide_head: bool = False) -> None:
    """The front on an asyncio loop (uvloop where installed), as a data-plane worker would run it
    beside its other routes: the loop watches the front's epoll fd and calls poll() when it is
    readable, so the policy runs on the loop's thread with the rest of the worker's state. With
    `handoff`, requests that are not hot native routes are answered by aiohttp on the same loop,
    their connections handed over with the bytes already read."""
    loop = asyncio.get_running_loop()
    kw: dict[str, Any] = {}
    if handoff:
        runner = await _aiohttp_side()
        adopted: set[asyncio.Task] = set()  # the loop keeps weak references to tasks only

        def take(fd: int, first: bytes) -> None:
            conn = socket.socket(fileno=fd)
            task = loop.create_task(loop.connect_accepted_socket(lambda: _Primed(runner.server(), first), conn))
            adopted.add(task)
            task.add_done_callback(adopted.discard)

        kw = {"handoff": take, "hot_suffixes": HOT_SUFFIXES}
    loop.add_reader(front.start(sock.fileno(), ports, decide, release, decide_head=decide_head, **kw),
                    front.poll, rounds)
    if ready is not None:
        ready.write_text("listening\n")
    await asyncio.Event().wait()


if __name__ == "__main__":
    sys.exit(main())
