"""An instance's engine monitor: scrapes its metrics port while it serves.

Owned by the instance (started when it becomes READY, cancelled when it stops).
Every `period_s` it reads the TRT-LLM metric families into the instance's
`EngineView` (what the routing policies read) and feeds the stall detector; a
stall is reported once per episode to `on_stall` (the instance then suspects
itself: out of rotation, canary, restart if that fails). A scrape that fails
or times out leaves the view to go stale: routing then falls back to the
proxy's own in-flight counts, and the probes judge the instance.

The scrapes are also the instance's heartbeat. An instance whose metrics port has
answered nothing for `silent_after_s` (any HTTP answer counts, even an error) is
reported once to `on_silent`: its processes are stopped, or its node or the link to
it is gone. Nothing else sees that fast: a stopped process or a cut cable refuses
nothing and closes nothing, so requests to it just wait. Each scrape's timeout ends
where the silence would be reached, so the report comes `silent_after_s` after the
last answer, not a scrape period later. A timeout that fires late says that our own
event loop was late, not that the instance was silent: it does not count, and the
next scrape gets a short timeout of its own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aiohttp

from orchestrator.health.engine_state import EngineView, parse_engine_metrics
from orchestrator.health.metrics_stall import StallDetector

# Shortest timeout of one scrape: however late we look, the instance gets this long to answer.
MIN_SCRAPE_S = 0.25
# A timeout that fires this much after its due time was our loop's lateness, not silence.
LATE_S = 0.2
# Timers may fire a hair early: a scrape that timed out at the silence mark is the silence.
EARLY_S = 0.02


class EngineMonitor:
    def __init__(self, session: aiohttp.ClientSession, metrics_url: str, view: EngineView,
                 period_s: float, stall_after_s: float, on_stall: Callable[[str], None],
                 silent_after_s: float = 0.0, on_silent: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._session = session
        self._url = metrics_url
        self.view = view
        self.period_s = period_s
        self._stall = StallDetector(stall_after_s) if stall_after_s > 0 else None
        self._on_stall = on_stall
        self._stalled = False
        self.silent_after_s = silent_after_s if on_silent is not None else 0.0
        self._on_silent = on_silent
        self._clock = clock
        self.silent = False  # reported, and no answer since
        self.last_answer = 0.0
        self.scrapes = 0
        self.failures = 0

    async def run(self) -> None:
        self.view.clear()
        if self._stall is not None:
            self._stall.reset()
        self.silent = False
        self.last_answer = self._clock()  # it just became ready: that was an answer
        regular = max(self.period_s * 5, 0.5)
        while True:
            started = self._clock()
            timeout = regular
            if self.silent_after_s and not self.silent:
                # End this scrape where the silence would be reached.
                timeout = min(regular, max(self.last_answer + self.silent_after_s - started, MIN_SCRAPE_S))
            why = await self._scrape_once(timeout)
            now = self._clock()
            self.heard(now, why, late=why == "timeout" and now - started > timeout + LATE_S)
            await asyncio.sleep(max(0.0, self.period_s - (now - started)))

    def heard(self, now: float, why: str | None, late: bool = False) -> None:
        """One scrape's outcome: None when the instance answered, else why not. Pure
        bookkeeping (the silence verdict), tested without a network."""
        if why is None:
            self.silent = False  # it answers again: the next silence is news
            self.last_answer = now
            return
        if self.silent or not self.silent_after_s or late:
            return
        quiet = now - self.last_answer
        if quiet + EARLY_S >= self.silent_after_s:
            self.silent = True
            assert self._on_silent is not None
            self._on_silent(f"silent: no answer from its metrics port for {quiet:.2f}s (last scrape: {why})")

    async def _scrape_once(self, timeout_s: float) -> str | None:
        """None when the instance answered (any status); else a few words on why not."""
        try:
            await self._scrape(aiohttp.ClientTimeout(total=timeout_s))
        except asyncio.TimeoutError:
            return "timeout"
        except aiohttp.ClientError as exc:
            return type(exc).__name__
        return None

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
