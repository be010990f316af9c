"""Stall detection from the engine's own heartbeat: TRT-LLM's iteration counter.

A hung executor (a rank stopped inside a collective, a wedged kernel) keeps
/v2/health/ready at 200, but `nv_trt_llm_general_metrics{general_type=
"iteration_counter"}` stops rising. Active requests with a frozen counter for
`stall_after_s` is a stall; a frozen counter with nothing active is an idle
instance. Pure logic on snapshots (health/engine_state.py); the instance's
engine monitor feeds it every scrape and acts on a stall (suspect -> canary ->
restart).
"""

from __future__ import annotations

from orchestrator.health.engine_state import EngineSnapshot


class StallDetector:
    def __init__(self, stall_after_s: float) -> None:
        if stall_after_s <= 0:
            raise ValueError(f"stall_after_s={stall_after_s!r}: must be positive")
        self.stall_after_s = stall_after_s
        self._counter: float | None = None
        self._frozen_since: float | None = None  # first scrape that saw the counter frozen with work
        self.reason = ""  # why the last observe() said stalled, for logs and `status`

    def observe(self, snap: EngineSnapshot) -> bool:
        """Feed one scrape; True while the counter has been frozen with active work for stall_after_s."""
        if snap.iteration is None:  # no engine metrics (yet): say nothing
            self.reason = ""
            return False
        previous, self._counter = self._counter, snap.iteration
        # A counter that went down means the server restarted: progress, not a stall.
        frozen = previous is not None and snap.iteration == previous
        if not frozen or snap.active <= 0:
            self._frozen_since = None
            self.reason = ""
            return False
        if self._frozen_since is None:
            self._frozen_since = snap.at
        stuck_for = snap.at - self._frozen_since
        if stuck_for < self.stall_after_s:
            return False
        self.reason = (f"engine stalled: iteration_counter stuck at {snap.iteration:g} with "
                       f"{snap.active} active requests for {stuck_for:.1f}s")
        return True

    def reset(self) -> None:
        """The instance restarted: old counters mean nothing."""
        self._counter = None
        self._frozen_since = None
        self.reason = ""
