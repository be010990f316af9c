"""Side workers: data-plane workers beside a proxy in front that cannot do it all.

`--proxy nginx`: NGINX cannot translate the OpenAI API, so it forwards /v1/ here; and it
cannot hold a request, so this is its `backup` server: a native HTTP request that no instance
took (every one refused, failed or is marked down) comes here, is held for `--hold-s` until
an instance is ready and sent there (configs/nginx.conf.j2). Loopback, a free port unless
--openai-listen. `--proxy none` with --openai-listen: a system NGINX sends /v1/ here
(render-nginx); these workers serve nothing else.

Before, the daemon served /v1/ in its own process: every daemon restart, watchdog restart
and upgrade took it away (503 for ~2 s) while NGINX went on serving the native routes, and
it had one core. Now it is the embedded data plane's WorkerPool: its workers live apart
from the daemon (the next daemon adopts them and takes their socket over), one that dies is
replaced, and they route on the same shared numbers. What differs is only the settings
they run with (`side_settings`), one rule for every such listener.

It owns the pool (which owns the workers, the listening socket and the shared files).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orchestrator.config import Settings, parse_host_port
from orchestrator.controlplane.adoption import AdoptableWorker
from orchestrator.controlplane.workers import WorkerPool
from orchestrator.errors import OrchError
from orchestrator.routing.backends import ReadyBackends

FLAG = "--openai-listen"


def side_settings(s: Settings, port: int = 0) -> Settings:
    """What a side worker runs with: HTTP on one listener (`--proxy none`'s serve /v1/ alone:
    dataplane/worker.py), no gRPC and no /metrics of its own (the daemon's /metrics reads its
    files), aiohttp's front (the compiled one is for the public port's small answers), and the
    proxy in front on this host trusted, so the client address it forwards is kept."""
    return dataclasses.replace(s, listen=s.openai_listen or f"127.0.0.1:{port}", grpc_listen="", metrics_listen="",
                               front="aiohttp", trusted_proxy=(*s.trusted_proxy, "127.0.0.1", "::1"))


def upstream_address(openai_listen: str, port: int) -> str:
    """Where a proxy on this host sends /v1/: the --openai-listen host (loopback where none is
    set, or a wildcard), the workers' port."""
    host = parse_host_port(openai_listen, FLAG)[0] if openai_listen else ""
    host = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def runs_side_workers(s: Settings) -> bool:
    """Whether this config runs side workers: NGINX mode always (its /v1/ and its hold), `--proxy
    none` where a system NGINX's /v1/ is to go to --openai-listen."""
    return s.proxy == "nginx" or (s.proxy == "none" and s.openai == "on" and bool(s.openai_listen))


class SideWorkers:
    """Side workers: start(), stop(grace_s), detach(), apply_settings(), and what the daemon
    asks of a data plane (status, inflight, llm_summary, held_now, abort_instance)."""

    kind = "side"

    def __init__(self, settings: Settings, backends: ReadyBackends, state_dir: Path,
                 logger: logging.Logger | None = None, *, port: int = 0, adopt: list[AdoptableWorker] | None = None,
                 on_change: Callable[[], None] | None = None) -> None:
        """port: the loopback port where --openai-listen is not set (0: a free one). An adopted
        NGINX's config names its last daemon's: where no worker is adopted with its socket, it
        is bound again where free, so the config needs no reload (a reload closes NGINX's idle
        client connections)."""
        self._settings = settings
        self._log = logger or logging.getLogger("trtllm-orch.side")
        self._make = lambda port, adopt: WorkerPool(side_settings(settings, port), backends, state_dir, self._log,
                                                    on_change=on_change, adopt=adopt, listen_flag=FLAG)
        self._port = port
        self._adopt = list(adopt or [])
        self._pool = self._make(port, self._adopt)
        self._bound_port = 0

    @property
    def prom_dir(self) -> Path:
        """Where the workers write their metrics (prometheus_client's multiprocess files)."""
        return self._pool.prom_dir

    @property
    def bound_port(self) -> int:
        return self._bound_port

    @property
    def upstream(self) -> str:
        """Where the proxy in front sends /v1/ (and NGINX what no instance took)."""
        return upstream_address(self._settings.openai_listen, self._bound_port)

    async def start(self) -> None:
        try:
            await self._pool.start()
        except OrchError as exc:
            if not self._port or self._settings.openai_listen or self._adopt:
                raise
            self._log.warning("side workers: port %d not free again (%s): a free one, and NGINX reloads",
                              self._port, exc)
            self._port = 0
            self._pool = self._make(0, [])
            await self._pool.start()
        try:
            self._bound_port = await self._pool.listen_port()
        except BaseException:
            await self._pool.stop(0)
            raise

    async def stop(self, grace_s: float = 5.0) -> None:
        await self._pool.stop(grace_s)

    async def detach(self) -> None:
        await self._pool.detach()

    def apply_settings(self, settings: Settings) -> None:
        self._settings = settings
        self._pool.apply_settings(side_settings(settings, self._bound_port))

    def state_record(self) -> dict[str, Any]:
        """The daemon's record of its data plane (live restore): that of the main settings'
        addresses, which the next daemon compares with its own."""
        return {**self._pool.state_record(), "listen": self._settings.public_addresses(), "workers_kind": self.kind}

    def pids(self) -> list[int]:
        return self._pool.pids()

    def inflight(self) -> dict[str, int]:
        return self._pool.inflight()

    def held_now(self) -> int:
        return self._pool.held_now()

    def llm_summary(self) -> dict[str, dict[str, Any]]:
        return self._pool.llm_summary()

    def abort_instance(self, host: str, port: int, reason: str, answering: bool) -> None:
        self._pool.abort_instance(host, port, reason, answering)

    def status(self) -> dict[str, Any]:
        return {**self._pool.status(), "kind": self.kind, "listen": self.upstream}
