"""The HTTP checks an instance's supervisor runs against its group's rank 0.

One object per instance, so the state machine asks "is it ready / alive / able
to generate" without knowing about sessions and URLs; unit tests of the state
machine replace it with scripted answers (tests/fakes.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiohttp

from orchestrator.health.canary import run_canary
from orchestrator.health.engine_monitor import EngineMonitor
from orchestrator.health.engine_state import EngineView
from orchestrator.health.probes import ProbeResult, probe_instance, wait_until_ready


class InstanceChecks:
    def __init__(self, session: aiohttp.ClientSession, base_url: str, metrics_url: str = ""):
        self._session = session
        self._base_url = base_url
        self._metrics_url = metrics_url

    async def monitor_engine(self, view: EngineView, period_s: float, stall_after_s: float,
                             on_stall: Callable[[str], None], silent_after_s: float = 0.0,
                             on_silent: Callable[[str], None] | None = None) -> None:
        """Scrape the engine's metrics into `view` until cancelled; tell `on_silent` when the
        instance has answered nothing for `silent_after_s` (see engine_monitor.py)."""
        await EngineMonitor(self._session, self._metrics_url, view, period_s, stall_after_s, on_stall,
                            silent_after_s, on_silent).run()

    async def wait_ready(self, model: str, deadline_s: float, is_alive: Callable[[], bool]) -> ProbeResult:
        return await wait_until_ready(self._session, self._base_url, model, deadline_s, poll_s=0.1,
                                      is_alive=is_alive)

    async def probe(self, model: str, timeout_s: float) -> ProbeResult:
        return await probe_instance(self._session, self._base_url, model, timeout_s)

    async def canary(self, model: str, body: dict[str, Any], deadline_s: float) -> ProbeResult:
        return await run_canary(self._session, self._base_url, model, body, deadline_s)
