"""Routing on what the engines report: `kv-aware` and `prefix-affinity`. Pure logic.

Both measure an instance's load in requests:
    ours     requests this proxy has in flight there (exact, instant);
    foreign  requests the engine holds that we did not send (another proxy, a
             direct client): active + waiting from its last snapshot, minus ours;
    kv       KV-cache pressure: a nearly full cache makes new prompts wait for
             blocks whatever the free batch slots, so used/max counts as up to
             half a batch of extra load.
Engine numbers lag (a scrape every 100 ms), which is why our own count is the
base and the engine only adds what we cannot see. When any candidate's snapshot
is stale (or the server exports no TRT-LLM metrics) every candidate is measured
by `ours` alone, so loads stay comparable.

`prefix-affinity` sends a prompt to an instance that already served its leading
chunks (their KV blocks are likely cached there: the prefill is skipped), but
only while that instance's load is within `slack` requests of the least loaded
one: a hot shared prefix must not pin all traffic to one instance.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from .backends import Backend
from .prefix_index import PrefixIndex, chunk_keys

KV_WEIGHT = 0.5  # a full KV cache counts as half a batch of extra requests


@dataclass(frozen=True)
class RouteHints:
    """What a policy may know about the request; built by the proxy, only when the policy wants it."""

    prompt_keys: tuple[bytes, ...] = ()

    @classmethod
    def from_prompt(cls, prompt: str | None) -> "RouteHints | None":
        return cls(tuple(chunk_keys(prompt))) if prompt else None


def loads(backends: Sequence[Backend], inflight: Mapping[str, int], now: float) -> dict[str, float]:
    """instance_id -> load in requests (see the module doc)."""
    snaps = {}
    for b in backends:
        snap = b.engine.fresh(now) if b.engine is not None else None
        if snap is None:
            return {b.instance_id: float(inflight.get(b.instance_id, 0)) for b in backends}
        snaps[b.instance_id] = snap
    out = {}
    for iid, snap in snaps.items():
        ours = inflight.get(iid, 0)
        foreign = max(0, snap.active + snap.queued - ours)
        capacity = snap.max_active or 1
        out[iid] = ours + foreign + KV_WEIGHT * capacity * snap.kv_fraction
    return out


def _least(candidates: list[Backend], load: Mapping[str, float], rng: random.Random) -> Backend:
    low = min(load[b.instance_id] for b in candidates)
    best = [b for b in candidates if load[b.instance_id] == low]
    return best[0] if len(best) == 1 else rng.choice(best)


class KvAware:
    """Least load as the engines report it (see `loads`)."""

    def __init__(self, rng: random.Random, clock: Callable[[], float] = time.monotonic) -> None:
        self._rng = rng
        self._clock = clock
        self.last_reason = ""

    def choose(self, backends: Sequence[Backend], skip: Collection[str], inflight: Mapping[str, int],
               hints: RouteHints | None = None) -> Backend | None:
        candidates = [b for b in backends if b.instance_id not in skip]
        if not candidates:
            return None
        load = loads(candidates, inflight, self._clock())
        self.last_reason = "load"
        return _least(candidates, load, self._rng)


class PrefixAffinity:
    def __init__(self, rng: random.Random, clock: Callable[[], float] = time.monotonic,
                 index: PrefixIndex | None = None, slack: float = 4.0) -> None:
        self._rng = rng
        self._clock = clock
        self.index = index or PrefixIndex(clock=clock)
        self.slack = slack
        self.last_reason = ""

    def choose(self, backends: Sequence[Backend], skip: Collection[str], inflight: Mapping[str, int],
               hints: RouteHints | None = None) -> Backend | None:
        candidates = [b for b in backends if b.instance_id not in skip]
        if not candidates:
            return None
        load = loads(candidates, inflight, self._clock())
        keys = list(hints.prompt_keys) if hints is not None else []
        chosen = None
        if keys:
            _, depth = self.index.match(keys)
            holders = [b for b in candidates if depth.get(b.instance_id)]
            if holders:
                low = min(load.values())
                within = [b for b in holders if load[b.instance_id] - low <= self.slack]
                if within:
                    deepest = max(depth[b.instance_id] for b in within)
                    chosen = _least([b for b in within if depth[b.instance_id] == deepest], load, self._rng)
                    self.last_reason = "prefix"
                else:
                    self.last_reason = "prefix-overloaded"  # the starvation guard
            else:
                self.last_reason = "prefix-miss"
        else:
            self.last_reason = "no-prompt"
        if chosen is None:
            chosen = _least(candidates, load, self._rng)
        if keys:
            self.index.record(keys, chosen.instance_id)
        return chosen

    def forget(self, instance_id: str) -> None:
        self.index.forget_instance(instance_id)
