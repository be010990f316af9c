"""Load balancers in front of the instances: embedded aiohttp (+ gRPC) or a managed NGINX."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ..config import Settings
from .backends import ReadyBackends


def make_proxies(settings: Settings, backends: ReadyBackends, state_dir: Path) -> list[Any]:
    """The proxies for `--proxy`; each has start(), stop(grace_s), inflight(), pids()."""
    logger = logging.getLogger("trtllm-orch.proxy")
    if settings.proxy == "none":
        return []
    if settings.proxy == "nginx":
        from .nginx import NginxProxy
        return [NginxProxy(settings, backends, state_dir, logger)]
    from .embedded import EmbeddedProxy
    proxies: list[Any] = [EmbeddedProxy(settings, backends, logger)]
    if settings.grpc_listen:
        from .grpc_proxy import GrpcProxy
        proxies.append(GrpcProxy(settings, backends, logger))
    return proxies
