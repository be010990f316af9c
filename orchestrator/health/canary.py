"""The canary: a tiny real inference, because health endpoints lie.

TRT-LLM's backend reports no per-instance readiness, so a hung rank (an NCCL hang,
a stuck executor) leaves /v2/health/ready at 200 while requests never finish. Only
a real request with a deadline shows it. One generated token keeps it cheap.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Callable

import aiohttp

from orchestrator.health.probes import ProbeResult, describe_error, model_path, one_line, status_reason


def default_canary_body() -> dict[str, Any]:
    # A fresh dict per call: callers may mutate it, and no module-level state is shared.
    return {"text_input": "canary", "max_tokens": 1, "bad_words": "", "stop_words": ""}


async def run_canary(session: aiohttp.ClientSession, base_url: str, model: str, body: dict[str, Any],
                     deadline_s: float) -> ProbeResult:
    """POST /v2/models/{model}/generate; ok iff 200 and the reply is JSON, within deadline_s."""
    path = model_path(model, "generate")
    start = time.monotonic()

    async def post() -> tuple[int, bytes]:
        async with session.post(base_url.rstrip("/") + path, json=body, allow_redirects=False) as resp:
            return resp.status, await resp.read()

    try:
        status, raw = await asyncio.wait_for(post(), deadline_s)  # not asyncio.timeout: Python 3.10
        if status != 200:
            return ProbeResult(False, status_reason("POST", path, status, raw), time.monotonic() - start)
    except asyncio.TimeoutError:  # before OSError: on 3.11+ it is the builtin TimeoutError
        return ProbeResult(False, f"POST {path}: timeout after {deadline_s:g}s", time.monotonic() - start)
    except (aiohttp.ClientError, OSError) as exc:
        return ProbeResult(False, describe_error("POST", path, exc), time.monotonic() - start)
    try:
        json.loads(raw)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are both ValueErrors
        return ProbeResult(False, f"POST {path} -> 200 but not JSON: {one_line(str(exc))}",
                           time.monotonic() - start)
    return ProbeResult(True, "", time.monotonic() - start)


class CanaryScheduler:
    """Decides when the canary runs: every interval_s, and early once the instance
    has been idle idle_s (no proxied request finished) -- a hung rank leaves
    /v2/health/ready at 200, so only a real request shows it. Pure logic.

    "Idle" counts from the later of the last proxied success and the last canary:
    - traffic flowing and succeeding already proves the instance works, so only the
      periodic canary runs (every interval_s);
    - no success for idle_s means either no traffic or traffic that never finishes
      (a hang, with requests piling up); the canary tells them apart quickly, and
      on an idle instance it costs nothing that matters.
    interval_s == 0 disables the canary; idle_s == 0 disables only the early run.
    """

    def __init__(self, interval_s: float, idle_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.configure(interval_s, idle_s)
        self._clock = clock
        now = clock()
        # The instance was just probed ready, so both timers start now, not at -inf.
        self._last_canary = now
        self._last_success = now

    def configure(self, interval_s: float, idle_s: float) -> None:
        if interval_s < 0 or idle_s < 0:
            raise ValueError(f"interval_s={interval_s!r}, idle_s={idle_s!r}: must be zero or more")
        self.interval_s = interval_s
        self.idle_s = idle_s

    def note_traffic(self) -> None:
        """A request through the proxy completed OK on this instance."""
        self._last_success = self._clock()

    def due(self) -> bool:
        if self.interval_s == 0:
            return False
        now = self._clock()
        if now - self._last_canary >= self.interval_s:
            return True
        return self.idle_s > 0 and now - max(self._last_success, self._last_canary) >= self.idle_s

    def ran(self) -> None:
        """The canary finished (call it after a good result); both timers restart from now."""
        self._last_canary = self._clock()
