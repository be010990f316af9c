"""What the last minute looked like per instance: TTFT percentiles and output events per second.

Prometheus histograms answer "p99 over the last minute" only through a Prometheus
server (rate() over buckets); `status` and `top` must answer it alone. So the proxy
also keeps the last minute here, in one-second buckets per instance: recording is
an append or an addition (the per-request path). A second that has ended is counted once
and kept as counts per log bucket (`log_histogram`), which are added to the window's
running sums and taken out again when the second leaves the window; a summary reads its
percentiles from those sums (at most HIST_RATIO above the exact ones). It sorted the
whole raw minute on every summary, which a worker makes every second on the loop that
serves traffic: 21-25 ms per call at 120k TTFTs (one instance at 2000 answers/s, or 8 at
375/s), a stall of every connection on that worker; now 0.6 and 2.3 ms, most of it the
one second that just ended.

Everything runs on the event loop; no lock.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from orchestrator import native

# The counting of a second's values, compiled (_log_buckets.c), where the install built it
_NATIVE = native.load("orchestrator.dataplane._log_buckets")

WINDOW_S = 60
# Per instance and second. Beyond it the percentiles come from the first samples of
# that second, which is fine for an operator's view and bounds the memory.
MAX_SAMPLES_PER_S = 2000


class _Second:
    __slots__ = ("sec", "ttft", "firsts", "events", "routes", "est_err", "ttft_hist", "err_hist")

    def __init__(self, sec: int) -> None:
        self.sec = sec
        self.ttft: list[float] = []
        self.firsts = 0  # generations that produced a first event
        self.events = 0
        self.routes: dict[str, int] | None = None  # routing reason -> picks (cost-model)
        self.est_err: list[float] | None = None  # |observed - estimated| / observed TTFT
        # Once the second has ended: its values as log-bucket counts (the lists are emptied).
        self.ttft_hist: dict[str, int] | None = None
        self.err_hist: dict[str, int] | None = None

    def compact(self) -> None:
        self.ttft_hist = log_histogram(self.ttft)
        self.ttft = []
        if self.est_err:
            self.err_hist = log_histogram(self.est_err)
            self.est_err = None


# Percentiles of several workers' windows cannot be merged; counts in shared buckets can.
# Each worker also sends its window's TTFTs (and estimate errors) as counts per log bucket: bucket i holds
# (HIST_BASE_S * HIST_RATIO**(i-1), HIST_BASE_S * HIST_RATIO**i], so a merged percentile
# is read as its bucket's upper bound, at most 5% above the exact one and never below.
HIST_BASE_S = 1e-5
HIST_RATIO = 1.05
_LOG_RATIO = math.log(HIST_RATIO)


# The buckets' upper bounds, each worked out as `_bound` does: a bucket is found by a bisection of
# these (a log, a ceiling and powers per bucket were half of a second's histogram, 0.2 ms a
# second and instance on the 2-core box at 2000 TTFTs a second); up to 1.5e16 s, bucket_of past it.
_BOUNDS = tuple(HIST_BASE_S * HIST_RATIO ** i for i in range(1000))
_KEYS = tuple(str(i) for i in range(len(_BOUNDS)))  # the compiled counting's keys, made once


def _bucket_of_large(v: float) -> int:
    i = max(0, math.ceil(math.log(max(v, HIST_BASE_S) / HIST_BASE_S) / _LOG_RATIO - 1e-9))
    while HIST_BASE_S * HIST_RATIO ** i < v:  # float rounding: the bound must hold v
        i += 1
    return i


def bucket_of(v: float) -> int:
    """The log bucket that holds v: the least i with v <= HIST_BASE_S * HIST_RATIO**i."""
    if v <= _BOUNDS[-1]:
        return bisect.bisect_left(_BOUNDS, v)
    return _bucket_of_large(v)


def _bound(i: int) -> float:
    return _BOUNDS[i] if i < len(_BOUNDS) else HIST_BASE_S * HIST_RATIO ** i


def log_histogram(values: list[float]) -> dict[str, int]:
    """Counts per log bucket of `values`, keyed by the bucket's index as a string (a JSON object),
    in ascending order. Compiled where built (_log_buckets.c: a bisection of _BOUNDS per value, no
    sort; a second's 2000 values on the 2-core box: 360 -> 57 us); else the list is sorted in place
    and bisected once per bucket in use, not a log per value."""
    if _NATIVE is not None:
        found = _NATIVE.counts(values, _BOUNDS, _KEYS)
        if found is not None:  # None: a value the table does not reach, or not a float
            return found
    values.sort()
    counts: dict[str, int] = {}
    pos, n = 0, len(values)
    while pos < n:
        i = bucket_of(values[pos])
        end = bisect.bisect_right(values, _bound(i), pos)
        counts[str(i)] = end - pos
        pos = end
    return counts


def histogram_percentiles(counts: dict[str, int], *qs: float) -> list[float]:
    """Nearest-rank percentiles of merged `log_histogram` counts, each its bucket's upper bound, in
    the order asked: the buckets sorted and walked once for all of them (a summary reads p50 and p99
    of every instance each second)."""
    if not qs:
        return []
    total = sum(counts.values())
    wanted = sorted((max(1, math.ceil(q * total - 1e-9)), k) for k, q in enumerate(qs))
    out = [0.0] * len(qs)
    seen = 0
    at = 0
    for key in sorted(counts, key=int):
        seen += counts[key]
        while seen >= wanted[at][0]:
            out[wanted[at][1]] = _bound(int(key))
            at += 1
            if at == len(wanted):
                return out
    raise ValueError("empty histogram")


def histogram_percentile(counts: dict[str, int], q: float) -> float:
    """Nearest-rank percentile of merged `log_histogram` counts: the bucket's upper bound."""
    return histogram_percentiles(counts, q)[0]


class _Window:
    """One instance's last minute: its seconds, and the counts of those already ended."""

    __slots__ = ("seconds", "since", "ttft", "errors")

    def __init__(self, since: float) -> None:
        self.seconds: deque[_Second] = deque()
        self.since = since  # first record: the window's real span
        # Sums of the ended seconds' counts, kept up as seconds end and leave: a summary reads
        # ~100 buckets instead of adding up 60 seconds' worth (6.7 ms a call at eight instances).
        self.ttft: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()

    def compact(self, s: _Second) -> None:
        s.compact()
        self.ttft.update(s.ttft_hist)
        if s.err_hist:
            self.errors.update(s.err_hist)

    def drop_before(self, sec: int) -> None:
        seconds = self.seconds
        while seconds and seconds[0].sec < sec:
            s = seconds.popleft()
            if s.ttft_hist is not None:
                self.ttft.subtract(s.ttft_hist)
                if s.err_hist:
                    self.errors.subtract(s.err_hist)

    def late(self, counts: Counter[str], hist: dict[str, int], value: float) -> None:
        """A value for an ended second (its timestamp taken before a summary, noted after)."""
        key = str(bucket_of(value))
        hist[key] = hist.get(key, 0) + 1
        counts[key] += 1


class RecentLLM:
    def __init__(self, window_s: int = WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._windows: dict[str, _Window] = {}

    def _second(self, instance: str, now: float) -> tuple[_Window, _Second]:
        sec = int(now)
        w = self._windows.get(instance)
        if w is None:
            w = self._windows[instance] = _Window(now)
        dq = w.seconds
        if dq and dq[-1].sec == sec:
            return w, dq[-1]
        s = _Second(sec)
        dq.append(s)
        w.drop_before(sec - self.window_s + 1)
        return w, s

    # --- per request (hot path) --------------------------------------------------
    def first_token(self, instance: str, seconds: float, now: float) -> None:
        w, s = self._second(instance, now)
        s.firsts += 1
        if s.ttft_hist is not None:
            w.late(w.ttft, s.ttft_hist, seconds)
        elif len(s.ttft) < MAX_SAMPLES_PER_S:
            s.ttft.append(seconds)

    def events(self, instance: str, n: int, now: float) -> None:
        self._second(instance, now)[1].events += n

    def routed(self, instance: str, reason: str, now: float, n: int = 1) -> None:
        """n picks of `instance` by a policy that says why (cost-model: hit, miss, spill, load)."""
        s = self._second(instance, now)[1]
        if s.routes is None:
            s.routes = {}
        s.routes[reason] = s.routes.get(reason, 0) + n

    def estimate_error(self, instance: str, relative: float, now: float) -> None:
        w, s = self._second(instance, now)
        if s.ttft_hist is not None:
            if s.err_hist is None:
                s.err_hist = {}
            w.late(w.errors, s.err_hist, relative)
            return
        if s.est_err is None:
            s.est_err = []
        if len(s.est_err) < MAX_SAMPLES_PER_S:
            s.est_err.append(relative)

    # --- for status ----------------------------------------------------------------
    def summary(self, now: float | None = None, histogram: bool = False) -> dict[str, dict[str, Any]]:
        """Per instance seen in the last window: ttft p50/p99 (ms), output events/s, generations;
        with `histogram`, the TTFTs' bucket counts too (a worker's, for the daemon's merge)."""
        now = self.clock() if now is None else now
        current = int(now)
        out: dict[str, dict[str, Any]] = {}
        for instance, w in list(self._windows.items()):
            w.drop_before(int(now - self.window_s))
            seconds = w.seconds
            if not seconds:
                del self._windows[instance]  # idle for a whole window: forget it
                continue
            for s in seconds:
                if s.ttft_hist is None and s.sec < current:
                    w.compact(s)  # ended: counted once, kept as counts
            ttft = +w.ttft  # the ended seconds (+: without the buckets emptied since)
            errors = +w.errors
            routes: dict[str, int] = {}
            for s in seconds:
                if s.ttft_hist is None:  # the second under way: not in the window's sums yet
                    ttft.update(log_histogram(s.ttft))  # (a bag of samples: sorted in place or not)
                    if s.est_err:
                        errors.update(log_histogram(s.est_err))
                if s.routes:
                    for reason, k in s.routes.items():
                        routes[reason] = routes.get(reason, 0) + k
            events = sum(s.events for s in seconds)
            # Rate over the part of the window this instance has been seen in (a fresh
            # instance is not diluted by the seconds before it existed), at least 1 s.
            span = max(1.0, min(float(self.window_s), now - w.since))
            p50, p99 = histogram_percentiles(ttft, 0.50, 0.99) if ttft else (None, None)
            out[instance] = {
                "ttft_p50_ms": round(p50 * 1000, 1) if p50 is not None else None,
                "ttft_p99_ms": round(p99 * 1000, 1) if p99 is not None else None,
                "tokens_per_s": round(events / span, 1),
                "generations": sum(s.firsts for s in seconds),
                "window_s": round(span, 1),
            }
            if histogram:
                out[instance]["ttft_hist"] = dict(ttft)
            if routes:  # routing reasons of the last minute (the policy's own words)
                out[instance]["routes"] = routes
            if errors:  # median relative error of its TTFT estimates
                out[instance]["ttft_est_err"] = round(histogram_percentile(errors, 0.5), 3)
                if histogram:
                    out[instance]["est_err_hist"] = dict(errors)
        return out
