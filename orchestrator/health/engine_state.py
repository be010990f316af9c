"""What the engine says about itself: TRT-LLM's metric families on an instance's
metrics port, read into one snapshot per scrape.

The instance's engine monitor (health/engine_monitor.py) scrapes at 10 Hz or
more, off the request path, and keeps the latest snapshot in its `EngineView`;
routing policies read the view through the instance's `Backend`, and fall back
to the proxy's own in-flight counts when the snapshot is stale.

The scanner reads only the lines it needs (a full Prometheus parse of Triton's
~150 lines per scrape would cost more than everything else we do with them).
Several TRT-LLM models on one server are summed: routing is per instance.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

_LINE = re.compile(r'^(nv_trt_llm_[a-z_]+|nv_inference_pending_request_count'
                   r'|nv_llm_(?:in|out)put_token_len_(?:sum|count))\{([^}]*)\}\s+(\S+)')
# The response histograms (one observation per finished request), summed over models.
_HISTOGRAMS = {"nv_llm_input_token_len_sum": "input_tokens", "nv_llm_input_token_len_count": "finished",
               "nv_llm_output_token_len_sum": "output_tokens"}
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

# (family, its category label) -> snapshot field, per category value
_FIELDS = {
    ("nv_trt_llm_request_metrics", "request_type"): {
        "active": "active", "max": "max_active", "waiting": "waiting", "scheduled": "scheduled",
        "context": "context"},
    ("nv_trt_llm_kv_cache_block_metrics", "kv_cache_block_type"): {
        "max": "kv_max", "free": "kv_free", "used": "kv_used", "tokens_per": "tokens_per_block",
        "reused": "kv_reused"},
    ("nv_trt_llm_general_metrics", "general_type"): {"iteration_counter": "iteration", "timestamp": "timestamp_us"},
    ("nv_trt_llm_inflight_batcher_metrics", "inflight_batcher_specific_metric"): {
        "total_context_tokens": "context_tokens"},
}


@dataclass(frozen=True)
class EngineSnapshot:
    at: float  # monotonic time of the scrape
    active: int = 0
    max_active: int = 0
    waiting: int = 0
    scheduled: int = 0
    context: int = 0
    kv_max: int = 0
    kv_free: int = 0
    kv_used: int = 0
    tokens_per_block: int = 0
    kv_reused: int = 0
    iteration: float | None = None  # None: the server exports no TRT-LLM engine metrics
    pending: int = 0  # Triton's own queue in front of the backend
    # Prompt tokens of finished requests, cumulative (nv_llm_input_token_len's sum; 0 where
    # the version exports no such histogram): the denominator of the reuse hit rate.
    input_tokens: int = 0
    # What the routing cost model learns rates from (routing/cost_model.py); 0 where the
    # version exports none. The last iteration's start (microseconds, the engine's clock) and
    # its prompt tokens in context phase; finished requests (the input histogram's count) and
    # their output tokens (the output histogram's sum), cumulative.
    timestamp_us: int = 0
    context_tokens: int = 0
    finished: int = 0
    output_tokens: int = 0
    # Not the engine's: our requests in flight there, every data-plane worker's, as the latest
    # choice over the instance before the daemon published the snapshot read them, and at least
    # as many as then (None: not known; controlplane/workers.py's `_routed`). What the engine
    # holds beyond it is another's (routing/llm_policies.py's `foreign`). A worker's own notes of
    # the count at its own choices miss what the other workers sent meanwhile
    # (llm_policies.SharedTurns has the simulator's numbers).
    routed: int | None = None
    # Not the engine's either: the daemon's eviction verdict as of this snapshot (routing/
    # eviction.py's `gone_before`: a prefix last routed here before this monotonic time is surely
    # gone; -inf: none is), worked out once from every snapshot since the instance joined, so
    # every worker, however late it started, judges alike (the later of it and the policy's own
    # cutoff holds: a daemon restarted under live restore knows less than the workers it
    # adopted). None: not sent (an older daemon, the simulator): each policy judges from the
    # snapshots it saw.
    gone_before: float | None = None

    @property
    def has_engine(self) -> bool:
        return self.iteration is not None

    @property
    def kv_fraction(self) -> float:
        return self.kv_used / self.kv_max if self.kv_max else 0.0

    @property
    def queued(self) -> int:
        """Requests the engine has but does not run yet."""
        return self.waiting + self.pending

    def as_dict(self) -> dict[str, float | int | None]:
        """Every field the engine reports, for the data-plane feed (EngineSnapshot(**d) rebuilds
        it). Not `routed` nor `gone_before`, which the feed sends beside it: a worker of an older
        release, adopted by live restore, knows no such field, and a snapshot with it would not
        build there."""
        d = asdict(self)
        del d["routed"], d["gone_before"]
        return d

    def describe(self) -> dict[str, float | int | None]:
        return {"active": self.active, "max_active": self.max_active, "waiting": self.queued,
                "kv_fraction": round(self.kv_fraction, 3), "kv_used_blocks": self.kv_used,
                "kv_max_blocks": self.kv_max, "iteration": self.iteration}


def parse_engine_metrics(text: str, at: float | None = None) -> EngineSnapshot:
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("nv_"):
            continue
        m = _LINE.match(line)
        if m is None:
            continue
        family, labels_text, raw = m.groups()
        try:
            value = float(raw)
        except ValueError:
            continue
        if family == "nv_inference_pending_request_count":
            values["pending"] = values.get("pending", 0.0) + value
            continue
        hist = _HISTOGRAMS.get(family)
        if hist is not None:
            values[hist] = values.get(hist, 0.0) + value
            continue
        if family.startswith("nv_llm_"):
            continue
        labels = dict(_LABEL.findall(labels_text))
        for (name, label), fields in _FIELDS.items():
            if family == name:
                field = fields.get(labels.get(label, ""))
                if field is not None:
                    values[field] = values.get(field, 0.0) + value
                break
    iteration = values.pop("iteration", None)
    ints = {k: int(v) for k, v in values.items()}
    return EngineSnapshot(at=time.monotonic() if at is None else at, iteration=iteration, **ints)


class EngineView:
    """The latest snapshot of one instance's engine, and how it changes.

    Owned by the instance (its engine monitor writes); proxies read it through the
    instance's `Backend`. Also keeps what `status` shows over time: the KV reuse hit
    rate over the snapshots of the last minute.
    """

    def __init__(self, stale_after_s: float = 1.0) -> None:
        self.stale_after_s = stale_after_s
        self.latest: EngineSnapshot | None = None
        self._first_of_window: EngineSnapshot | None = None
        # Told of every snapshot: the data-plane supervisor publishes them to the workers
        # (the owner publishes; nobody polls the view).
        self.listeners: list[Callable[[EngineSnapshot], None]] = []

    def update(self, snap: EngineSnapshot) -> None:
        if self._first_of_window is None or snap.at - self._first_of_window.at > 60:
            self._first_of_window = snap
        self.latest = snap
        for listener in self.listeners:
            listener(snap)

    def clear(self) -> None:
        """The instance left (restart): its engine's numbers are gone with it."""
        self.latest = None
        self._first_of_window = None

    def fresh(self, now: float | None = None) -> EngineSnapshot | None:
        """The latest snapshot if it is recent enough to route on, else None."""
        snap = self.latest
        if snap is None or not snap.has_engine:
            return None
        now = time.monotonic() if now is None else now
        return snap if now - snap.at <= self.stale_after_s else None

    def describe(self) -> dict | None:
        snap = self.latest
        if snap is None or not snap.has_engine:
            return None
        out = snap.describe()
        out["age_s"] = round(time.monotonic() - snap.at, 2)
        first = self._first_of_window
        out["kv_reused_blocks"] = snap.kv_reused
        if first is not None and snap.kv_reused >= first.kv_reused:
            out["kv_reused_last_minute"] = snap.kv_reused - first.kv_reused
        out["kv_reuse_hit_rate"] = self.reuse_hit_rate()
        return out

    def reuse_hit_rate(self) -> float | None:
        """Of the prompt blocks of the last minute, the fraction served from the KV cache:
        reused blocks over prompt tokens in blocks (TRT-LLM exports no missed-block count,
        so the denominator is the input-token histogram's sum). None: no prompt finished in
        the window, or the counters went back (a restart), or the engine exports no
        input-token histogram."""
        snap, first = self.latest, self._first_of_window
        if snap is None or first is None or not snap.tokens_per_block:
            return None
        reused = snap.kv_reused - first.kv_reused
        prompt_blocks = (snap.input_tokens - first.input_tokens) / snap.tokens_per_block
        if reused < 0 or prompt_blocks <= 0:
            return None
        return round(min(1.0, reused / prompt_blocks), 3)
