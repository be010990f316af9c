"""Load balancers in front of the instances: embedded aiohttp (+ gRPC) or a managed NGINX."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orchestrator.config import Settings
from orchestrator.routing.backends import Backend, ReadyBackends


def planned_backends(plan: Any) -> tuple[Backend, ...]:
    """Every instance of the plan as a Backend (addresses only), ready or not."""
    return tuple(Backend(i.instance_id, i.bind_address, i.ports.http, i.ports.grpc, i.ports.metrics)
                 for i in plan.instances)


def front_built() -> bool:
    """Whether this install has the compiled front (the workers run the same install)."""
    from orchestrator import native
    from orchestrator.dataplane.front import MODULE
    return native.load(MODULE) is not None


def check_front(settings: Settings) -> None:
    """EnvironmentProblem where --front compiled is asked and the C module is not built: `up` starts
    nothing rather than serve at a fraction of the rate the deployment was sized for (--front auto
    is the fall back to aiohttp with a warning)."""
    if settings.proxy == "embedded" and settings.front == "compiled" and not front_built():
        from orchestrator.dataplane.front import REQUIRED
        from orchestrator.errors import EnvironmentProblem
        raise EnvironmentProblem(REQUIRED)


def make_proxies(settings: Settings, backends: ReadyBackends, state_dir: Path, *,
                 planned: tuple[Backend, ...] = (), on_change: Callable[[], None] | None = None,
                 adopt: list[Any] | None = None, adopt_nginx: Any = None) -> list[Any]:
    """The proxies for `--proxy`; each has start(), stop(grace_s), inflight(), pids().

    planned: every instance of the plan (nginx lists them all, ready or not).
    on_change: called when a proxy's own state changes (nginx restarted its master), so
    the daemon can rewrite state.json and tell systemd; proxies may also have status().
    adopt: data-plane workers a previous daemon left serving (live restore: the embedded data
    plane's, or the side workers of the other modes); adopt_nginx: its NGINX master
    (controlplane/adoption.AdoptableNginx), for `--proxy nginx`.
    """
    logger = logging.getLogger("trtllm-orch.proxy")
    if settings.proxy == "none":
        from orchestrator.controlplane.side_workers import SideWorkers, runs_side_workers
        if runs_side_workers(settings):
            # The OpenAI API for a system NGINX, which forwards /v1/ here (render-nginx).
            return [SideWorkers(settings, backends, state_dir, logger, adopt=adopt, on_change=on_change)]
        return []
    if settings.proxy == "nginx":
        from orchestrator.nginx.proxy import NginxProxy
        return [NginxProxy(settings, backends, state_dir, logger, planned=planned, on_change=on_change,
                           adopt=adopt_nginx, adopt_workers=adopt)]
    # The embedded proxy runs in worker processes beside the daemon (the data plane):
    # the daemon's own crash, GC pause or upgrade touches no client connection.
    from orchestrator.controlplane.workers import WorkerPool
    if settings.front == "auto" and not front_built():
        # Said here too: each worker says it in its own log, which `up` does not print, and the
        # workers then serve small answers at a fraction of the rate.
        from orchestrator.dataplane.front import NOT_BUILT
        logger.warning(NOT_BUILT)
    return [WorkerPool(settings, backends, state_dir, logger, on_change=on_change, adopt=adopt or [])]
