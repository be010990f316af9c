"""How late the daemon's event loop runs: the loop serves every proxied request,
so a blocking call on it is latency for every client.

A heartbeat task sleeps a fixed tick and records how much later than asked it
woke up. `status` shows the worst lag and the recent 99th percentile; a lag over
`warn_ms` is logged (rate-limited) so a stall leaves a trace.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

log = logging.getLogger("trtllm-orch")


class LoopMonitor:
    def __init__(self, tick_s: float = 0.05, warn_ms: float = 250.0, window: int = 1200) -> None:
        self.tick_s = tick_s
        self.warn_ms = warn_ms
        self.max_ms = 0.0
        self._recent: collections.deque[float] = collections.deque(maxlen=window)  # last minute at 50 ms
        self._last_warning = 0.0

    async def run(self) -> None:
        """Owned by the daemon, which cancels it at the end."""
        while True:
            asked = time.monotonic()
            await asyncio.sleep(self.tick_s)
            self.record((time.monotonic() - asked - self.tick_s) * 1000)

    def record(self, lag_ms: float) -> None:
        lag_ms = max(lag_ms, 0.0)
        self._recent.append(lag_ms)
        self.max_ms = max(self.max_ms, lag_ms)
        now = time.monotonic()
        if lag_ms > self.warn_ms and now - self._last_warning > 10:
            self._last_warning = now
            log.warning("event loop ran %.0f ms late: something blocked it", lag_ms)

    def summary(self) -> dict[str, float]:
        recent = sorted(self._recent)
        p99 = recent[int(0.99 * (len(recent) - 1))] if recent else 0.0
        return {"max": round(self.max_ms, 1), "p99_last_minute": round(p99, 1)}
