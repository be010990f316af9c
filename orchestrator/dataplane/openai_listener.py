"""The OpenAI API on a listener of its own, in front of which sits an NGINX.

Its own module so that the dependency runs one way: this listener is an
EmbeddedProxy restricted to /v1/ (it imports the relay); the OpenAI frontend
(openai_frontend.py) knows only the relay interface it is handed (ProxyPath) and
imports no proxy.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from orchestrator.config import Settings
from orchestrator.errors import OrchError
from orchestrator.dataplane import descriptors
from orchestrator.dataplane.embedded import EmbeddedProxy
from orchestrator.dataplane.metrics import ProxyMetrics


class OpenAIListener:
    """The OpenAI API alone, on a listener of its own, for a proxy that cannot translate.

    `--proxy nginx`: the NginxProxy owns one on loopback (a free port unless
    --openai-listen) and forwards /v1/ to it; `--proxy none`: the daemon runs one when
    --openai-listen is set, for a system NGINX (render-nginx). Requests still go straight
    to the instances from here, with the embedded proxy's hold, routing and retries.
    """

    def __init__(self, settings: Settings, backends: Any, logger: logging.Logger | None = None,
                 metrics: ProxyMetrics | None = None, port: int = 0) -> None:
        """`port`: the loopback port to listen on where --openai-listen is not set (0: a free
        one). An adopted NGINX's config names its last daemon's: bound again where it is free,
        the config needs no reload (a reload closes NGINX's idle client connections)."""
        # The daemon's process, where NGINX opens a connection here per /v1/ request of a burst:
        # its table grown now, once, not under the burst (descriptors.py says why).
        descriptors.reserve_for(settings.max_client_connections)
        self._make = lambda port: EmbeddedProxy(self._own(settings, port), backends, logger, metrics=metrics,
                                                openai_only=True)
        self._port = port
        self._log = logger or logging.getLogger(__name__)
        self._proxy = self._make(port)
        self.metrics = self._proxy.metrics

    @staticmethod
    def _own(s: Settings, port: int = 0) -> Settings:
        # The NGINX in front is on this host: keep the client address it forwards.
        return dataclasses.replace(s, listen=s.openai_listen or f"127.0.0.1:{port}", metrics_listen="",
                                   trusted_proxy=(*s.trusted_proxy, "127.0.0.1", "::1"))

    @property
    def bound_port(self) -> int:
        return self._proxy.bound_port

    async def start(self) -> None:
        try:
            await self._proxy.start()
        except OrchError as exc:
            if not self._port:
                raise
            self._log.warning("OpenAI listener: port %d not free again (%s): a free one, and NGINX reloads",
                              self._port, exc)
            self._port = 0
            self._proxy = self._make(0)
            await self._proxy.start()

    async def stop(self, grace_s: float = 5.0) -> None:
        await self._proxy.stop(grace_s)

    def apply_settings(self, settings: Settings) -> None:
        self._proxy.apply_settings(self._own(settings, self._port))

    def inflight(self) -> dict[str, int]:
        return self._proxy.inflight()
