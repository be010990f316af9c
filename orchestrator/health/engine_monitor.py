"""An instance's engine monitor: scrapes its metrics port while it serves.

Owned by the instance (started when it becomes READY, cancelled when it stops).
Every `period_s` it reads the TRT-LLM metric families into the instance's
`EngineView` (what the routing policies read) and feeds the stall detector; a
stall is reported once per episode to `on_stall` (the instance then suspects
itself: out of rotation, canary, restart if that fails). A scrape that fails
or times out leaves the view to go stale: routing then falls back to the
proxy's own in-flight counts, and the probes judge the instance.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import aiohttp

from orchestrator.health.engine_state import EngineView, parse_engine_metrics
from orchestrator.health.metrics_stall import StallDetector


class EngineMonitor:
    def __init__(self, session: aiohttp.ClientSession, metrics_url: str, view: EngineView,
                 period_s: float, stall_after_s: float, on_stall: Callable[[str], None]) -> None:
        self._session = session
        self._url = metrics_url
        self.view = view
        self.period_s = period_s
        self._stall = StallDetector(stall_after_s) if stall_after_s > 0 else None
        self._on_stall = on_stall
        self._stalled = False
        self.scrapes = 0
        self.failures = 0

    async def run(self) -> None:
        self.view.clear()
        if self._stall is not None:
            self._stall.reset()
        timeout = aiohttp.ClientTimeout(total=max(self.period_s * 5, 0.5))
        while True:
            started = time.monotonic()
            with contextlib.suppress(asyncio.TimeoutError, aiohttp.ClientError):
                await self._scrape(timeout)
            await asyncio.sleep(max(0.0, self.period_s - (time.monotonic() - started)))

    async def _scrape(self, timeout: aiohttp.ClientTimeout) -> None:
        self.failures += 1  # undone below when the scrape completes
        async with self._session.get(self._url, timeout=timeout) as resp:
            if resp.status != 200:
                return
            text = await resp.text()
        self.failures -= 1
        self.scrapes += 1
        snap = parse_engine_metrics(text)
        self.view.update(snap)
        if self._stall is None:
            return
        if self._stall.observe(snap):
            if not self._stalled:
                self._stalled = True
                self._on_stall(self._stall.reason)
        else:
            self._stalled = False
