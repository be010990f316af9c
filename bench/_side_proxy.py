"""Run orchestrator.dataplane.embedded.EmbeddedProxy alone, with a fixed ready set (bench helper).

    python -m bench._side_proxy --listen 127.0.0.1:PORT --policy round-robin ID:HOST:HTTP:GRPC:METRICS...

Stops on SIGTERM/SIGINT (graceful, as the daemon stops it).
"""

from __future__ import annotations

import argparse
import asyncio
import signal

from orchestrator.config import Settings
from orchestrator.routing.backends import Backend, ReadyBackends
from orchestrator.dataplane.embedded import EmbeddedProxy, install_uvloop_if_available


async def main(args: argparse.Namespace) -> None:
    backends = ReadyBackends()
    bs = []
    for spec in args.backend:
        iid, host, http, grpc, metrics = spec.split(":")
        bs.append(Backend(iid, host, int(http), int(grpc), int(metrics)))
    backends.publish(tuple(bs))
    settings = Settings(listen=args.listen, grpc_listen="", metrics_listen="", lb_policy=args.policy)
    proxy = EmbeddedProxy(settings, backends)
    await proxy.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await proxy.stop(2.0)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--listen", required=True)
    p.add_argument("--policy", default="least-outstanding")
    p.add_argument("--uvloop", action="store_true")
    p.add_argument("backend", nargs="+")
    a = p.parse_args()
    if a.uvloop:
        install_uvloop_if_available()
    asyncio.run(main(a))
