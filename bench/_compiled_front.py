"""One worker of the compiled front (orchestrator/dataplane/front/_front.c): issue 22's plan, measured.

    python -m bench._compiled_front --port P --ports P0,P1,... [--decide c|python|python-full --state DIR --slot K]
                                    [--loop c|asyncio|asyncio-drain [--handoff [--limits H,B,K]]]

Binds 127.0.0.1:P with SO_REUSEPORT (as the NGINX of bench/dataplane_bench.py does: W processes,
one socket each, the kernel spreads the connections), writes `--ready PATH` once listening, and
relays until SIGTERM. `--decide c`: least requests in flight in C (NGINX's least_conn), the bound a
compiled decision reaches. `--decide python`: the product's balancer and default policy, called once
per request from C (bench/_route_decider.py's `Decider`, on the workers' shared table and prefix
index in DIR, slot K), the count released from C when the answer ends; `python-full` also runs the
embedded path's other per-request Python (`_full_rules`). With `--handoff` the front keeps the
product's rules (front/compiled.py: its routes, header hygiene, slow clients cut; `--limits`: the
head, body and keep-alive seconds) and hands every other request to an aiohttp side. Not yet a
worker mode of the product.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

def load() -> ModuleType:
    """The compiled front, as setup.py built it into the tree (`scripts/bootstrap`, or
    `python setup.py build_ext --inplace`)."""
    from orchestrator.dataplane.front.compiled import NATIVE
    if NATIVE is None:
        raise RuntimeError("orchestrator/dataplane/front/_front.c is not built: python setup.py build_ext --inplace")
    return NATIVE


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--ports", required=True)
    ap.add_argument("--decide", choices=("c", "python", "python-full"), default="c",
                    help="python-full: also the product's other per-request Python (headers, metrics)")
    ap.add_argument("--state", type=Path)
    ap.add_argument("--slot", type=int, default=0)
    ap.add_argument("--policy", default="prefix-affinity")
    ap.add_argument("--ready", type=Path)
    ap.add_argument("--loop", choices=("c", "asyncio", "asyncio-drain"), default="c",
                    help="c: the front's own blocking loop; asyncio: an asyncio loop (uvloop) drives it, a batch "
                         "of events per wakeup; asyncio-drain: up to 16 batches per wakeup")
    ap.add_argument("--handoff", action="store_true",
                    help="(--loop asyncio) requests other than the native generate/infer routes go to aiohttp; the "
                         "product's rules apply")
    ap.add_argument("--limits", default="10,30,75",
                    help="with --handoff: a head's, a body's and a kept connection's seconds (the product's defaults)")
    args = ap.parse_args()
    if args.loop != "c":
        try:
            import uvloop
            uvloop.install()
        except ImportError:
            pass
    ports = [int(p) for p in args.ports.split(",")]
    front = load()
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
            limits = tuple(float(x) for x in args.limits.split(",")) if args.handoff else None
            asyncio.run(_driven(front, sock, ports, decide, release, args.ready, limits,
                                rounds=16 if args.loop == "asyncio-drain" else 1))
        else:
            front.serve(sock.fileno(), ports, decide, release)
    except KeyboardInterrupt:
        pass
    return 0


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
    """(the Decider, decide(head, body) -> (instance index, index) or None, release(index, status,
    outcome, events, head_at, first_at)): the product's route as the split's deciders take it, the count
    acquired by decide and released by release (the front's API, front/_front.c)."""
    from bench._route_decider import Decider
    decider = Decider(state, slot, ports, policy)
    ids = [b.instance_id for b in decider.backends]
    index = {iid: i for i, iid in enumerate(ids)}

    def decide(head: bytes, body: bytes) -> tuple[int, int] | None:
        iid = decider.route(body)
        if iid is None:
            return None
        i = index[iid]
        return i, i

    def release(i: int, status: int, outcome: int, events: int, *times: float) -> None:
        decider.balancer.release(ids[i])

    return decider, decide, release


def _full_rules(state: Path, slot: int, ports: list[int], policy: str) -> tuple[Any, Any]:
    """decide(head, body) and release(ctx, status, outcome) doing, besides the route, the other Python the embedded
    path runs per request (its cost, not its effect: the front still sends the request's bytes as
    they came): the head parsed into headers, the instance's request headers, the routing and
    in-flight metrics and the generation's timer at the request; the count, the client's response
    headers and head, the timer's event and end at the answer's end. Left out: the per-read SSE
    count (`SseCounter`), which would run per event, not per request."""
    import httptools
    from multidict import CIMultiDict

    from orchestrator.dataplane.headers import client_response_headers, upstream_request_headers
    from orchestrator.dataplane.metrics import ProxyMetrics
    from orchestrator.dataplane.response_head import response_head

    decider, route, unroute = _route_rules(state, slot, ports, policy)
    balancer = decider.balancer
    metrics = ProxyMetrics()
    ids = [b.instance_id for b in decider.backends]
    answer_headers = CIMultiDict({"Content-Type": "text/event-stream", "Transfer-Encoding": "chunked"})

    class _Head:
        def __init__(self) -> None:
            self.headers: CIMultiDict[str] = CIMultiDict()

        def on_header(self, name: bytes, value: bytes) -> None:
            self.headers.add(name.decode("latin-1"), value.decode("latin-1"))

    def decide(head: bytes, body: bytes) -> tuple[int, tuple[int, Any, Any]] | None:
        parsed = _Head()
        httptools.HttpRequestParser(parsed).feed_data(head)
        routed = route(head, body)
        if routed is None:
            return None
        i = routed[0]
        iid = ids[i]
        timer = metrics.timer("generate_stream")
        metrics.routed(balancer.policy, balancer.last_reason, iid)
        if balancer.last_decision is not None:
            metrics.route_decision(balancer.last_decision, timer)
        gauge = metrics.inflight_child(iid)
        gauge.inc()
        up = upstream_request_headers(parsed.headers, "127.0.0.1", False)
        b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in up.items())  # the head to send
        return i, (i, timer, gauge)

    def release(ctx: tuple[int, Any, Any], status: int, outcome: int, events: int, *times: float) -> None:
        i, timer, gauge = ctx
        unroute(i, status, outcome, events, *times)
        iid = ids[i]
        gauge.dec()
        metrics.count(iid, 200)
        response_head(200, "OK", client_response_headers(answer_headers, keep_length=False), version=(1, 1),
                      framed=True, keep_alive=True)
        timer.events(iid, 1)
        timer.attempt_over()

    return decide, release


async def _driven(front: ModuleType, sock: socket.socket, ports: list[int], decide: Any, release: Any,
                  ready: Path | None, limits: tuple[float, ...] | None = None, rounds: int = 1) -> None:
    """The front on an asyncio loop (uvloop where installed), as a data-plane worker would run it
    beside its other routes (front/compiled.py's `drive`), so the policy runs on the loop's thread
    with the rest of the worker's state. With `limits` (head, body, keep-alive seconds), the
    product's rules apply and the requests that are not the front's are answered by aiohttp on the
    same loop, their connections handed over with the bytes already read."""
    from orchestrator.dataplane.client_guard import ClientLimits
    from orchestrator.dataplane.front.compiled import HandOff, drive, rules
    loop = asyncio.get_running_loop()
    kw: dict[str, Any] = {}
    if limits is not None:
        runner = await _aiohttp_side()
        kw = {"handoff": HandOff(loop, runner.server),
              **rules(ClientLimits(limits[0], limits[1], 1 << 20), limits[2], 1 << 20)}
    drive(loop, front.start(sock.fileno(), ports, decide, release, **kw), rounds)
    if ready is not None:
        ready.write_text("listening\n")
    await asyncio.Event().wait()


if __name__ == "__main__":
    sys.exit(main())
