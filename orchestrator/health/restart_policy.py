"""When to restart a failed instance, and when to stop trying.

The supervisor asks this after every failure. Pure logic: the clock and the rng
are injected so every rule is tested without sleeping.

Rules, and why:
- The first failure after a stable READY (or the first ever) restarts at once:
  one crash is usually a one-off, and restart overhead is what users feel.
- Failures with no stable READY in between back off initial * 2^(k-1) for the
  k-th repeat, +-20% jitter (instances that die together, e.g. on a shared NCCL
  fault, must not restart in lockstep), never above cap_s.
- READY for stable_after_s forgives the backoff: the instance proved it can run.
- max_failures within window_s gives up (FAILED): a crash loop that outlives the
  backoff is a broken model or GPU, and restarting it forever hides that.
  The window counts failures, not repeats, so a stable READY does not hide a
  slow crash loop.
"""

from __future__ import annotations

import collections
import random
import time
from dataclasses import dataclass
from typing import Callable

JITTER = 0.2
# 2**60 * any sane initial_s is far past any cap; clamping avoids OverflowError.
_MAX_EXPONENT = 60


@dataclass(frozen=True)
class RestartDecision:
    give_up: bool
    delay_s: float
    reason: str  # one line for logs and `status`


def ordinal(n: int) -> str:
    if 10 <= n % 100 <= 20:
        suffix = "th"
    else:
        suffix = {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


class RestartPolicy:
    def __init__(self, initial_s: float, cap_s: float, stable_after_s: float, max_failures: int,
                 window_s: float, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.configure(initial_s, cap_s, stable_after_s, max_failures, window_s)
        self._rng = rng if rng is not None else random.Random()
        self._clock = clock
        self._failures: collections.deque[float] = collections.deque()  # monotonic times, oldest first
        self._repeats = 0  # failures since the last stable READY (or ever)
        self._ready_since: float | None = None

    def configure(self, initial_s: float, cap_s: float, stable_after_s: float, max_failures: int,
                  window_s: float) -> None:
        """Set the knobs (also on a reload: the failure history is kept)."""
        for name, value in (("initial_s", initial_s), ("cap_s", cap_s), ("stable_after_s", stable_after_s)):
            if value < 0:
                raise ValueError(f"{name}={value!r}: must be zero or more")
        if max_failures < 1:
            raise ValueError(f"max_failures={max_failures!r}: must be at least 1")
        if window_s <= 0:
            raise ValueError(f"window_s={window_s!r}: must be positive")
        self.initial_s = initial_s
        self.cap_s = cap_s
        self.stable_after_s = stable_after_s
        self.max_failures = max_failures
        self.window_s = window_s

    def record_ready(self) -> None:
        """The instance became READY; the stable timer starts now.

        Idempotent while READY (a repeat call keeps the first start), so calling it
        on every good probe cannot keep the backoff from being forgiven.
        """
        if self._ready_since is None:
            self._ready_since = self._clock()

    def record_failure(self) -> RestartDecision:
        now = self._clock()
        if self._ready_since is not None and now - self._ready_since >= self.stable_after_s:
            self._repeats = 0
        self._ready_since = None
        self._expire(now)
        self._failures.append(now)
        count = len(self._failures)
        window = f"{self.window_s:g}s"
        if count >= self.max_failures:
            return RestartDecision(True, 0.0, f"{count} failures within {window}: giving up")
        self._repeats += 1
        delay = self._delay(self._repeats)
        when = f"in {delay:.1f}s" if delay > 0 else "now"
        return RestartDecision(False, delay, f"{ordinal(count)} failure in {window}: restarting {when}")

    def reset(self) -> None:
        """A manual `restart ID`: the operator vouches for the instance, forget its history."""
        self._failures.clear()
        self._repeats = 0
        self._ready_since = None

    @property
    def failures_in_window(self) -> int:
        self._expire(self._clock())
        return len(self._failures)

    @property
    def repeats(self) -> int:
        """Failures since the last stable READY: the backoff exponent's source."""
        return self._repeats

    def _expire(self, now: float) -> None:
        # A failure exactly window_s old no longer counts.
        while self._failures and now - self._failures[0] >= self.window_s:
            self._failures.popleft()

    def _delay(self, repeat: int) -> float:
        if repeat <= 1:
            return 0.0
        base = self.initial_s * 2.0 ** min(repeat - 2, _MAX_EXPONENT)
        base = min(base, self.cap_s)
        jittered = base * self._rng.uniform(1.0 - JITTER, 1.0 + JITTER)
        # cap_s is a promise to the operator, so it bounds the jittered value too.
        return min(jittered, self.cap_s)
