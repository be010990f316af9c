"""The compiled front's requests, counted in batches: what `path.py` notes as its requests are
routed and end, folded into the worker's metrics (ProxyMetrics) when `path.py` accounts.

Counted one by one, a 32-event stream's metrics took as much Python as its routing decision
(2-core box, a batch of ten: decide 17 us, the counting 16.6 us per request: twelve value
increments, two histogram observations, four updates of the recent window). Noted here, a
request is a few dict updates; the fold makes one increment per instance, status and value of
the batch, one histogram pass per instance (metrics.observe_many), and adds up the same totals
the one-by-one counting did (tests/test_front_path.py compares them with the embedded path's).

State: one batch, owned by the FrontPath that fills and folds it (the worker's loop thread).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any


class Ledger:
    __slots__ = ("routed", "inflight", "answers", "latency", "firsts", "events", "itl", "tallied")

    def __init__(self) -> None:
        self.routed: defaultdict[tuple[str, str, str], int] = defaultdict(int)  # (policy, reason, instance) -> picks
        self.inflight: defaultdict[str, int] = defaultdict(int)  # instance -> the gauge's change
        self.answers: defaultdict[tuple[str, int], int] = defaultdict(int)  # (instance or NO_INSTANCE, status)
        self.latency: defaultdict[str, list[float]] = defaultdict(list)  # instance -> to its answer head, s
        self.firsts: defaultdict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)  # (TTFT, when)
        self.events: defaultdict[tuple[str, str], int] = defaultdict(int)  # (instance, api) -> output events
        # (instance, api) -> each request's (sum, counts per ITL bucket): added up at the fold, one
        # pass per bucket over the batch (added per request, the buckets' list was 16% of the
        # front's Python on 32-event streams: py-spy, 2-core box)
        self.itl: defaultdict[tuple[str, str], list[tuple[float, tuple[int, ...]]]] = defaultdict(list)
        self.tallied = 0  # requests ended, for the worker's row of the shared table

    def __bool__(self) -> bool:
        return bool(self.tallied or self.routed or self.inflight or self.answers)

    def pick(self, policy: str, reason: str, instance: str) -> None:
        self.routed[policy, reason, instance] += 1
        self.inflight[instance] += 1

    def attempt_over(self, instance: str) -> None:
        self.inflight[instance] -= 1

    def answer(self, instance: str, status: int, latency_s: float | None) -> None:
        self.answers[instance, status] += 1
        if latency_s is not None:
            self.latency[instance].append(latency_s)

    def tokens(self, instance: str, api: str, first: tuple[float, float] | None, events: int,
               itl: tuple[float, tuple[int, ...]] | None) -> None:
        """A generation's output: its first event's (TTFT, when) where not counted yet, its events
        counted here, its inter-token times as the front counted them per bucket."""
        key = (instance, api)
        if first is not None:
            self.firsts[key].append(first)
        if events:
            self.events[key] += events
        if itl is not None:
            self.itl[key].append(itl)

    def fold(self, metrics: Any, tally: Callable[[int], None] | None, now: float) -> None:
        """Add the batch to `metrics` (and the worker's tally); the ledger is spent after."""
        for (policy, reason, instance), n in self.routed.items():
            metrics.routed(policy, reason, instance, n, now)
        for instance, delta in self.inflight.items():
            if delta:
                metrics.inflight_child(instance).inc(delta)
        for (instance, status), n in self.answers.items():
            metrics.count(instance, status, n)
        for instance, values in self.latency.items():
            metrics.observe_latencies(instance, values)
        for (instance, api), firsts in self.firsts.items():
            metrics.first_tokens(instance, api, firsts)
        for (instance, api), n in self.events.items():
            metrics.count_events(instance, api, n, now)
        for (instance, api), itls in self.itl.items():
            totals, counts = zip(*itls)
            metrics.inter_token_counts(instance, api, sum(totals), [sum(bucket) for bucket in zip(*counts)])
        if tally is not None and self.tallied:
            tally(self.tallied)

