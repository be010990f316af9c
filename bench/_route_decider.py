"""The Python half of the split design issue 22 asks to measure: NGINX carries every byte,
Python only decides the route.

    python -m bench._route_decider --state DIR --slot K --sock PATH --done PATH --ports P0,P1,...

NGINX hands each request, body included, to one of these deciders over a keep-alive unix
socket; the decider answers `X-Accel-Redirect: @i<N>`, and NGINX replays the request to
instance N from a named location (which keeps the method, URI and body) and relays the
answer itself. The decision is the product's: `routing.balancer.Balancer` with the default
policy, on the workers' shared in-flight table and shared prefix index (DIR/table,
DIR/prefixes, as `dataplane/worker.py` opens them), so the measured cost is what a real
split would pay per request. Completions come back as NGINX access-log lines over a unix
datagram socket (`access_log syslog:server=unix:PATH`, the instance's address last in
`$upstream_addr`): the decider releases the in-flight count there, so least-loaded and
prefix-affinity see the same global numbers the embedded workers do.

Not a product path and not used by one: no hold, retries, passive health, limits, metrics or
OpenAI routes (each would add to the cost measured here). bench/dataplane_bench.py starts it
as the `split` target.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

import httptools

from orchestrator.dataplane.shared_prefix import SharedPrefixIndex
from orchestrator.dataplane.shared_table import GlobalInflight, SharedTable, WorkerCounts
from orchestrator.routing.backends import Backend
from orchestrator.routing.balancer import Balancer, SharedRouting
from orchestrator.routing.llm_policies import RouteHints
from orchestrator.routing.prompt import prompt_of_json


class Decider:
    """One process's routing state: the ready set, the balancer, address -> instance."""

    def __init__(self, state: Path, slot: int, ports: list[int], policy: str) -> None:
        table = SharedTable.open(state / "table")
        shared = SharedRouting(GlobalInflight(table), WorkerCounts(table, slot),
                               SharedPrefixIndex.open(state / "prefixes"))
        self.balancer = Balancer(policy, shared=shared)
        self.backends = tuple(Backend(str(i), "127.0.0.1", p, p, p) for i, p in enumerate(ports))
        self.by_addr = {f"127.0.0.1:{p}".encode(): str(i) for i, p in enumerate(ports)}
        self.answers = {str(i): (b"HTTP/1.1 200 OK\r\nX-Accel-Redirect: @i%d\r\nContent-Length: 0\r\n\r\n" % i)
                        for i in range(len(ports))}
        self.busy = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n"

    def route(self, body: bytes) -> str | None:
        """The instance the product's balancer picks for this body, its count acquired."""
        balancer = self.balancer
        hints = RouteHints.from_prompt(prompt_of_json(body)) if balancer.wants_prompt_of(len(body)) else None
        b = balancer.pick(self.backends, (), hints)
        if b is None:
            return None
        balancer.acquire(b.instance_id)
        return b.instance_id

    def decide(self, body: bytes) -> bytes:
        iid = self.route(body)
        return self.busy if iid is None else self.answers[iid]

    def done(self, line: bytes) -> None:
        """One access-log datagram: `<pri>... : <decider addr> : <instance addr>`."""
        iid = self.by_addr.get(line.rpartition(b" ")[2].strip())
        if iid is not None:
            self.balancer.release(iid)


class _Request(asyncio.Protocol):
    """Keep-alive HTTP/1.1 from NGINX: parse with httptools, answer each request in one write."""

    decider: Decider

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.parser = httptools.HttpRequestParser(self)
        self.body: list[bytes] = []

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body = b"".join(self.body)
        self.body = []
        self.transport.write(self.decider.decide(body))  # type: ignore[attr-defined]


class _Done(asyncio.DatagramProtocol):
    decider: Decider

    def datagram_received(self, data: bytes, addr: object) -> None:
        self.decider.done(data)


async def serve(args: argparse.Namespace) -> None:
    decider = Decider(args.state, args.slot, [int(p) for p in args.ports.split(",")], args.policy)
    _Request.decider = _Done.decider = decider
    loop = asyncio.get_running_loop()
    server = await loop.create_unix_server(_Request, str(args.sock), backlog=4096)  # NGINX opens hundreds at once
    os.chmod(args.sock, 0o666)  # NGINX's workers run as nobody when its master is root
    import socket
    done = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    done.bind(str(args.done))
    os.chmod(args.done, 0o666)
    done.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    await loop.create_datagram_endpoint(_Done, sock=done)
    async with server:
        await server.serve_forever()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--state", type=Path, required=True)
    ap.add_argument("--slot", type=int, required=True)
    ap.add_argument("--sock", type=Path, required=True)
    ap.add_argument("--done", type=Path, required=True)
    ap.add_argument("--ports", required=True)
    ap.add_argument("--policy", default="prefix-affinity")
    args = ap.parse_args()
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
