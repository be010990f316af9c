"""An engine's rates, learnt online from what it reports, and what a request would cost there
in seconds: the model behind the `cost-model` policy (cost_policy.py). Pure logic.

Rates come from the engines' scrapes (the engine monitors' snapshots), every snapshot in
order as the instance's EngineView publishes it. Every data-plane worker receives the same
snapshots in the same order, so every worker learns the same rates:

    iter_s      seconds per engine iteration while busy, per instance: over two scrapes, the
                advance of the last iteration's start (TRT-LLM's `timestamp`) over that of
                `iteration_counter`; the prefill of that instance's traffic is in it
    out_tokens  output tokens per finished request, per instance (TRT-LLM's output histogram
                over the input histogram's count): how many iterations a request holds a slot
    prefill_s   seconds per prompt token computed (not taken from the KV cache), per engine
                shape (slots, KV blocks, block size: the same engine on the same GPUs computes
                alike, and pooling the instances' samples halves the noise and keeps it from
                making one instance look dearer than its twin): the slope of a least-squares fit
                of the busy spans, T = a * n + prefill_s * c + b, with n the iterations in the
                span and c the prompt tokens its first iteration had in context phase
                (`total_context_tokens`, the scraped iteration's own); the span's other
                iterations are unseen, so a long span weighs less. No rates at all until that
                slope is SIGNIFICANCE standard errors above zero: the first spans of a cold
                start fitted it near zero or at half the truth, and a cached prefix then looked
                worth little next to a queue
    decode_s    seconds per iteration without prompt tokens, per engine shape, as prefill_s:
                the shape's mean iteration less prefill_s times the mean context tokens of the
                scraped iterations (a scrape sees the last finished iteration: an unbiased sample
                of them, standing for its span's iterations; ratios of forgotten sums, right from
                the first scrapes). Per instance, twins came out apart and the cheaper-looking
                one drew the traffic (RateBook._refresh)

The prefill and decode rates are kept on a grid of 1/16 octave, as the token ratio is
(tokens.py): a worker that learnt a hair differently (it started later) decides alike.

Estimated time to first token for a request with `uncached` prompt tokens to prefill there
(its own not likely cached, and those routed there before it and not prefilled yet), behind
`n` requests (ours from every worker, and what the engine holds that we did not send):

    wait  = max(0, n - slots + 1) * out_tokens * iter_s / slots   (slots free one by one)
    ttft  = wait + prefill_s * uncached + decode_s

`slots` is what runs at once: the batch slots, or while the engine reports requests waiting
for KV blocks, how many ran at once in such scrapes (it runs what fits). Everything is in the
engine's units: nothing here was tuned on one engine shape. The constants left are about the
scrape cadence (FORGET, FORGET_FIT), a prior for output lengths (PRIOR_OUT_TOKENS) and the
confidence asked of the prefill fit (SIGNIFICANCE).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from orchestrator.health.engine_state import EngineSnapshot

# Each sample counts this much less per newer sample: the per-instance sums remember ~100 busy
# scrapes (10 s at the monitor's 10 Hz), a shape's pooled fit ~500 samples (25 s of two busy
# instances). The prefill slope is seen only through one iteration per span, so its fit needs
# the longer memory: routing_sim (mixed long/short, 8 slots, closed loop, 30 s) with 0.99 per
# instance learnt 0.76x and 2.5x the twin's 0.1 ms/token on its two instances; pooled at 0.998,
# 0.94x on both. Not set per engine shape: both are counts of scrapes.
FORGET = 0.99
FORGET_FIT = 0.998
# Output tokens per request before any request finished, or where the version exports no output
# histogram: a chat answer's order of magnitude. Only the queueing term uses it.
PRIOR_OUT_TOKENS = 64.0
# Steps per octave (about 4%) of what is learnt: the rates, the estimates' error and the token
# ratio (tokens.py). Every data-plane worker learns from a slightly different sample, and on the
# grid they agree (a decision must not depend on which worker took the request).
GRID = 16
# The prefill slope is used once it is this many standard errors above zero (about 95% one-sided):
# a slope fitted from the first few noisy spans can come out near zero (a cached prefix would
# then look worthless and the first seconds' tenants be split for good) or several times too
# high. Statistics, not a property of an engine: with exact spans (the simulator) it is met at
# the first spans with a prompt in them.
SIGNIFICANCE = 2.0


def grid_step(x: float) -> int:
    """The grid step nearest to x > 0 (on_grid(x) is at_step of it)."""
    return round(math.log2(x) * GRID)


def at_step(step: float) -> float:
    return 2.0 ** (step / GRID)


def on_grid(x: float) -> float:
    return at_step(grid_step(x)) if x > 0 else 0.0


class _Fit3:
    """Weighted least squares of y = a*x1 + b*x2 + c with exponential forgetting; `solve`
    answers only once b is told apart from zero (SIGNIFICANCE standard errors)."""

    __slots__ = ("s",)

    def __init__(self) -> None:
        # sums of w, w*x1, w*x2, w*x1^2, w*x1*x2, w*x2^2, w*y, w*x1*y, w*x2*y, w*y^2, w^2
        self.s = [0.0] * 11

    def add(self, x1: float, x2: float, y: float, w: float) -> None:
        s = self.s
        for i in range(11):
            s[i] *= FORGET_FIT
        s[0] += w
        s[1] += w * x1
        s[2] += w * x2
        s[3] += w * x1 * x1
        s[4] += w * x1 * x2
        s[5] += w * x2 * x2
        s[6] += w * y
        s[7] += w * x1 * y
        s[8] += w * x2 * y
        s[9] += w * y * y
        s[10] += w * w

    def solve(self) -> tuple[float, float, float] | None:
        """(a, b, c), or None while x2 has not varied enough to tell its slope, or the samples
        are too few or too noisy to tell it from zero."""
        w, s1, s2, s11, s12, s22, sy, s1y, s2y, syy, sww = self.s
        if w <= 0:
            return None
        # Centred on the weighted means: a 2x2 system for (a, b), then c.
        m1, m2, my = s1 / w, s2 / w, sy / w
        v11 = s11 / w - m1 * m1
        v12 = s12 / w - m1 * m2
        v22 = s22 / w - m2 * m2
        c1y = s1y / w - m1 * my
        c2y = s2y / w - m2 * my
        det = v11 * v22 - v12 * v12
        # x2's variance left after x1 explains what it can: zero while every sample had the
        # same context tokens (no prefill seen yet), and then the slope is unknown.
        if v22 <= 0 or det <= 1e-9 * v22 * max(v11, 1e-12):
            return None
        a = (c1y * v22 - c2y * v12) / det
        b = (c2y * v11 - c1y * v12) / det
        # The slope's standard error: residual variance (weighted mean square) over the
        # effective number of samples less the 3 fitted (Kish's n = w^2 / sum w^2 under the
        # forgetting), times x2's share of the design's inverse.
        dof = (w * w / sww if sww > 0 else 0.0) - 3.0
        if dof < 1.0 or b <= 0:
            return None
        resid = max(0.0, syy / w - my * my - a * c1y - b * c2y)
        # SIGNIFICANCE as Student's t for so few degrees of freedom (Cornish-Fisher, within 2% of
        # the table from 2 on; 3 samples fit 3 unknowns exactly and say nothing of the error)
        z = SIGNIFICANCE
        t = z + (z ** 3 + z) / (4 * dof) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * dof * dof)
        if b * b * det * dof < t * t * resid * v11:
            return None
        return a, b, my - a * m1 - b * m2


@dataclass(frozen=True)
class Rates:
    iter_s: float
    prefill_s: float
    decode_s: float
    out_tokens: float


class EngineRates:
    """One instance: its shape, iteration time, output length and KV writes (module doc)."""

    __slots__ = ("last", "slots", "kv_blocks", "block_tokens", "_span_s", "_span_n", "_out", "_fin",
                 "iter_s", "out_tokens", "_fits_n", "_fits_w")

    def __init__(self) -> None:
        self.last: EngineSnapshot | None = None
        self.slots = 0
        self.kv_blocks = 0
        self.block_tokens = 0
        self._span_s = 0.0  # forgotten sums of busy span seconds and iterations
        self._span_n = 0.0
        self._out = 0.0  # forgotten sums of output tokens and finished requests
        self._fin = 0.0
        self.iter_s: float | None = None
        self.out_tokens = PRIOR_OUT_TOKENS
        # How many requests run at once while some wait for KV blocks (forgotten sums): the
        # batch a KV-bound engine really has.
        self._fits_n = 0.0
        self._fits_w = 0.0

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.slots, self.kv_blocks, self.block_tokens

    def running(self) -> int:
        """Requests that run at once now: the batch slots, or while the last scrape showed
        requests waiting for KV blocks, how many ran at once in such scrapes."""
        snap = self.last
        if snap is not None and snap.waiting > 0 and self._fits_w > 0:
            return max(1, min(self.slots, round(self._fits_n / self._fits_w)))
        return self.slots

    def update(self, snap: EngineSnapshot) -> tuple[tuple[float, float, float] | None, tuple[float, float] | None]:
        """Learn from the next snapshot. Returns the busy span for the shape's fit (iterations,
        context tokens of its first, seconds) and the input histogram's advance (tokens,
        requests); either None."""
        prev, self.last = self.last, snap
        self.slots = snap.max_active or self.slots
        self.kv_blocks = snap.kv_max or self.kv_blocks
        self.block_tokens = snap.tokens_per_block or self.block_tokens
        if snap.waiting > 0 and snap.scheduled > 0:
            self._fits_n = self._fits_n * FORGET + snap.scheduled
            self._fits_w = self._fits_w * FORGET + 1.0
        if prev is None or snap.iteration is None or prev.iteration is None:
            return None, None
        if snap.iteration < prev.iteration or snap.finished < prev.finished:
            return None, None  # the engine restarted: its counters began again
        n = snap.iteration - prev.iteration
        span = (snap.timestamp_us - prev.timestamp_us) / 1e6
        sample = None
        # Both scrapes busy: the engine iterated back to back in between (TRT-LLM's counters
        # freeze while it idles, and the scrape before an idle gap shows active 0).
        if n > 0 and span > 0 and prev.active > 0 and snap.active > 0 and prev.timestamp_us > 0:
            sample = (n, float(prev.context_tokens), span)
            # A ratio of forgotten sums: an average started at 0 took ~100 scrapes to forget its start.
            self._span_s = self._span_s * FORGET + span
            self._span_n = self._span_n * FORGET + n
            self.iter_s = self._span_s / self._span_n
        d_fin = snap.finished - prev.finished
        d_out = snap.output_tokens - prev.output_tokens
        if d_fin > 0 and d_out > 0:
            k = FORGET ** d_fin  # over the last ~100 finished requests
            self._out = self._out * k + d_out
            self._fin = self._fin * k + d_fin
            self.out_tokens = self._out / self._fin
        moved = (snap.input_tokens - prev.input_tokens, d_fin) if d_fin > 0 else None
        return sample, moved

def cached_blocks(depth_blocks: int, written: float, requests: int, running: int, free_blocks: int) -> int:
    """Of a prefix of `depth_blocks` blocks routed to an instance, the leading blocks likely
    still cached when the next request runs there, after `requests` requests computing `written`
    blocks were routed there in between. Fewer of them than run at once (`running`): the one
    that carried the prefix still runs beside the next, and holds its blocks. Else they were
    released into the free pool (`free_blocks` not held by running requests) as its most recently
    used, tail first, and each computed block takes the least recently used free one: the prefix
    loses its tail once the pool's older blocks are gone."""
    if requests < running:
        return depth_blocks
    older = free_blocks - depth_blocks
    lost = written - max(0, older)
    if lost <= 0:
        return depth_blocks
    if lost >= depth_blocks:
        return 0
    return depth_blocks - int(math.ceil(lost))


class RateBook:
    """Every instance's EngineRates and every shape's fit, fed each snapshot in order."""

    def __init__(self) -> None:
        self.engines: dict[str, EngineRates] = {}
        self._fits: dict[tuple[int, int, int], _Fit3] = {}
        self._shape_rates: dict[tuple[int, int, int], float] = {}  # shape -> prefill_s
        # shape -> forgotten sums of its instances' busy spans: seconds, iterations, and prompt
        # tokens (each span's scraped iteration stands for the span's n: instances whose
        # iterations differ in length weigh by iterations, not by spans). decode_s, as
        # prefill_s, is the shape's: see _refresh.
        self._shape_spans: dict[tuple[int, int, int], list[float]] = {}
        self._rates: dict[str, Rates] = {}

    def observe(self, iid: str, snap: EngineSnapshot) -> tuple[float, float] | None:
        """A new snapshot of instance `iid`; returns its input histogram's advance, if any."""
        er = self.engines.get(iid)
        if er is None:
            er = self.engines[iid] = EngineRates()
        if not snap.has_engine:
            return None
        sample, moved = er.update(snap)
        shape = er.shape
        if sample is not None:
            fit = self._fits.get(shape)
            if fit is None:
                fit = self._fits[shape] = _Fit3()
            n, c, span = sample
            fit.add(n, c, span, 1.0 / n)
            solved = fit.solve()
            if solved is not None:
                self._shape_rates[shape] = on_grid(max(0.0, solved[1]))
            sums = self._shape_spans.get(shape)
            if sums is None:
                sums = self._shape_spans[shape] = [0.0, 0.0, 0.0]
            sums[0] = sums[0] * FORGET_FIT + span
            sums[1] = sums[1] * FORGET_FIT + n
            sums[2] = sums[2] * FORGET_FIT + c * n
        self._refresh(iid, er)
        return moved

    def _refresh(self, iid: str, er: EngineRates) -> None:
        prefill_s = self._shape_rates.get(er.shape)
        if er.iter_s is None or prefill_s is None:
            return  # no seconds before the prefill slope is known (SIGNIFICANCE)
        # An iteration is decode_s plus prefill_s per prompt token it computes: what is left of
        # the shape's mean iteration once its mean prompt tokens are taken out. The shape's, not
        # the instance's: the same engine decodes alike, and an instance's own figure (its mean
        # iteration less the prompt tokens of the few iterations its scrapes saw) came out apart
        # from its twin's, by up to a quarter (routing_sim: 13.7 and 17.0 ms for a true 20). On
        # 64 slots with free ones the estimate is little more than this term and the pending
        # prefill, and the real twin sent 58-66% of the requests of cells without a shared
        # prompt to whichever instance looked cheaper (TTFT p90 1.27-1.40 x least-outstanding's;
        # 0.86-0.99 x with the shape's, 50/50: bench/README.md).
        span_s, span_n, ctx = self._shape_spans[er.shape]
        shape_iter_s = span_s / span_n
        decode_s = on_grid(max(shape_iter_s - prefill_s * ctx / span_n, 0.1 * shape_iter_s))
        self._rates[iid] = Rates(on_grid(er.iter_s), prefill_s, decode_s, er.out_tokens)

    def rates(self, iid: str) -> Rates | None:
        """The instance's rates; before its engine was ever busy, those of a busy instance of
        the same shape (the same engine); None while there is none."""
        r = self._rates.get(iid)
        if r is not None:
            return r
        er = self.engines.get(iid)
        if er is None:
            return None
        shape = er.shape
        for other, oer in self.engines.items():
            if oer.shape == shape and other in self._rates:
                return self._rates[other]
        return None

    def forget(self, iid: str) -> None:
        """The instance restarts: its counters begin again (its shape's rates stay)."""
        er = self.engines.get(iid)
        if er is not None:
            er.last = None


def ttft_estimate(r: Rates, slots: int, n: float, uncached: float) -> float:
    """Seconds to the first token of a request behind `n` requests, with `uncached` prompt
    tokens to prefill (see the module doc)."""
    wait = 0.0
    if slots and n >= slots:
        wait = (n - slots + 1) * r.out_tokens * r.iter_s / slots
    return wait + r.prefill_s * uncached + r.decode_s
