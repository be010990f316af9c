"""Routing policies: which ready instance gets the next attempt. Pure logic.

The daemon owns readiness (`ReadyBackends`); this module only chooses among
the instances it is handed. It keeps two pieces of proxy-local state:

- in-flight counts per instance, for least-outstanding and for `status`;
- a short cool-down after a connect failure. Until the daemon's health checks
  remove a dead instance (seconds), every request would otherwise try it first
  (a refused connection leaves its in-flight count at zero, so least-outstanding
  would love it). A cooling instance is still used when nothing else is left:
  the cool-down deprioritises, it never ejects; ejecting is the daemon's call.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Collection, Sequence

from ..config import LB_POLICIES
from .backends import Backend

LEAST_OUTSTANDING = "least-outstanding"
ROUND_ROBIN = "round-robin"
DEFAULT_COOLDOWN_S = 1.0


class Balancer:
    __slots__ = ("policy", "inflight", "_rng", "_clock", "_cooldown_s", "_cooling", "_rr")

    def __init__(self, policy: str = LEAST_OUTSTANDING, *, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 cooldown_s: float = DEFAULT_COOLDOWN_S) -> None:
        if policy not in LB_POLICIES:
            raise ValueError(f"lb_policy={policy!r}: must be one of {', '.join(LB_POLICIES)}")
        self.policy = policy
        self.inflight: dict[str, int] = {}
        self._rng = rng or random.Random()
        self._clock = clock
        self._cooldown_s = cooldown_s
        self._cooling: dict[str, float] = {}  # instance_id -> monotonic time the cool-down ends
        self._rr = 0

    # --- choice ----------------------------------------------------------------
    def pick(self, backends: Sequence[Backend], exclude: Collection[str] = ()) -> Backend | None:
        """The instance for the next attempt, or None when every candidate is excluded."""
        if not backends:
            return None
        cooling = self._cooling
        if cooling:
            now = self._clock()
            for iid, until in list(cooling.items()):
                if until <= now:
                    del cooling[iid]
        if self.policy == ROUND_ROBIN:
            return self._round_robin(backends, exclude, cooling)
        return self._least_outstanding(backends, exclude, cooling)

    def _least_outstanding(self, backends: Sequence[Backend], exclude: Collection[str],
                           cooling: dict[str, float]) -> Backend | None:
        inflight = self.inflight
        best: list[Backend] = []
        best_n = -1
        fallback: list[Backend] = []
        for b in backends:
            iid = b.instance_id
            if iid in exclude:
                continue
            if cooling and iid in cooling:
                fallback.append(b)
                continue
            n = inflight.get(iid, 0)
            if best_n < 0 or n < best_n:
                best = [b]
                best_n = n
            elif n == best_n:
                best.append(b)
        if not best:
            if not fallback:
                return None
            return self._least_outstanding(fallback, (), {})
        return best[0] if len(best) == 1 else self._rng.choice(best)

    def _round_robin(self, backends: Sequence[Backend], exclude: Collection[str],
                     cooling: dict[str, float]) -> Backend | None:
        n = len(backends)
        start = self._rr
        fallback: Backend | None = None
        for i in range(n):
            b = backends[(start + i) % n]
            iid = b.instance_id
            if iid in exclude:
                continue
            if cooling and iid in cooling:
                if fallback is None:
                    fallback = b
                continue
            self._rr = (start + i + 1) % n
            return b
        if fallback is not None:
            self._rr = (backends.index(fallback) + 1) % n
        return fallback

    # --- bookkeeping -------------------------------------------------------------
    def acquire(self, instance_id: str) -> None:
        self.inflight[instance_id] = self.inflight.get(instance_id, 0) + 1

    def release(self, instance_id: str) -> None:
        n = self.inflight.get(instance_id, 0) - 1
        if n > 0:
            self.inflight[instance_id] = n
        else:
            self.inflight.pop(instance_id, None)

    def connect_failed(self, instance_id: str) -> None:
        self._cooling[instance_id] = self._clock() + self._cooldown_s

    def succeeded(self, instance_id: str) -> None:
        if self._cooling:
            self._cooling.pop(instance_id, None)

    def is_cooling(self, instance_id: str) -> bool:
        until = self._cooling.get(instance_id)
        return until is not None and until > self._clock()

    def snapshot(self) -> dict[str, int]:
        return dict(self.inflight)
