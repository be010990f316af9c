"""The routing cost model's parts as pure logic: the token ratio, the rate fits learnt from
engine snapshots, the write log and cache survival, the TTFT estimate."""

from __future__ import annotations

import math
import random

import pytest

from orchestrator.health.engine_state import EngineSnapshot
from orchestrator.routing.cost_model import (PRIOR_OUT_TOKENS, EngineRates, RateBook, Rates, _Fit3,
                                             cached_blocks, on_grid, ttft_estimate)
from orchestrator.routing.journal import WriteLog
from orchestrator.routing.tokens import PRIOR_TOKENS_PER_CHAR, SAMPLE_EVERY, TokenRatio

pytestmark = pytest.mark.unit


# --- tokens --------------------------------------------------------------------------------
def test_ratio_starts_from_the_prior_and_calibrates_from_the_engines_input_lengths():
    r = TokenRatio()
    assert r.value == PRIOR_TOKENS_PER_CHAR and r.source == "prior"
    for _ in range(200):
        r.prompt(1000)  # our prompts: 1000 characters each
    r.engine(d_tokens=3 * 500, d_finished=3)  # the engine's: 500 tokens each
    assert r.source == "engine" and r.value == pytest.approx(0.5, rel=0.05)
    assert r.tokens(2000) == pytest.approx(1000, rel=0.05)


def test_ratio_sits_on_a_grid_so_slightly_different_samples_agree():
    a, b = TokenRatio(), TokenRatio()
    for r, chars in ((a, 1000), (b, 1010)):  # two workers that saw a hair different prompts
        r.prompt(chars)
        r.engine(1000, 1)
    assert a.value == b.value == 1.0


def test_a_tokenizer_wins_over_the_engines_lengths():
    r = TokenRatio(count=lambda text: len(text) // 4)
    r.prompt(400, "x" * 400)  # the first prompt is sampled
    assert r.source == "tokenizer" and r.value == pytest.approx(0.25, rel=0.05)
    r.engine(1000, 1)  # 1 token per character by the engine's count: ignored
    assert r.value == pytest.approx(0.25, rel=0.05)
    for _ in range(SAMPLE_EVERY - 1):
        r.prompt(400, "x" * 400)
    assert r._tok_sum == 100  # only one in SAMPLE_EVERY pays for tokenizing


def test_grid_is_about_four_percent():
    assert on_grid(1.0) == 1.0 and on_grid(0.0) == 0.0
    assert abs(on_grid(1.02) - 1.0) < 1e-9 and on_grid(1.04) > 1.0


@pytest.mark.parametrize("seed", range(6))
def test_a_ratio_that_stays_on_its_grid_step_is_not_worked_out_again_and_reads_the_same(seed):
    """The engines' ratio skips the grid's arithmetic while it stays inside its step: after every
    prompt and engine report, value and source as worked out from scratch (on_grid of the raw
    ratio), through steps crossed up and down and ratios a hair from a step's bound."""
    rng = random.Random(seed)
    r = TokenRatio()
    skipped = 0
    for k in range(3000):
        if rng.random() < 0.05:
            r.engine(d_tokens=rng.uniform(50, 5000), d_finished=rng.choice((1, 2, 5)))
        else:
            # prompt lengths drifting by a few percent between phases: steps crossed both ways
            r.prompt(max(1, int(rng.gauss(1000 * (1.0 + 0.08 * math.sin(k / 300)), 60))))
        if r._engine_n < 1:
            assert r.source == "prior"
            continue
        raw = (r._engine_sum / r._engine_n) / (r.prompts.chars / r.prompts.n)
        assert r.source == "engine" and r.value == on_grid(raw), k
        skipped += r._lo < raw < r._hi
    assert skipped > 2000  # the skip is what runs: not a test of the slow path alone
    # a step's bounds: just inside keeps the step, at them the arithmetic decides
    step_value = r.value
    for raw in (r._lo, r._hi, math.nextafter(r._lo, 0.0), math.nextafter(r._hi, math.inf)):
        r._set(raw, "engine")
        assert r.value == on_grid(raw)
    r._set(step_value, "engine")
    assert r._lo < step_value < r._hi


# --- fits ----------------------------------------------------------------------------------
def test_fit_recovers_slopes_and_says_none_without_variance():
    fit = _Fit3()
    for _ in range(50):
        fit.add(1.0, 0.0, 1.0, 1.0)
    assert fit.solve() is None  # x2 never varied: its slope is unknown
    rng = random.Random(1)
    fit = _Fit3()
    for _ in range(2000):
        x1, x2 = rng.randint(1, 8), rng.choice((0, 100, 2000))
        fit.add(x1, x2, 0.02 * x1 + 0.0001 * x2 - 0.003, 1.0 / x1)
    a, b, c = fit.solve()
    assert a == pytest.approx(0.02, rel=1e-6) and b == pytest.approx(0.0001, rel=1e-6) and c == pytest.approx(-0.003)


def test_fit_answers_once_the_slope_is_told_apart_from_zero():
    rng = random.Random(2)
    fit = _Fit3()
    answers = []
    for k in range(400):  # iterations of 20 ms +- 30%, a 2000-token prompt in a third of the spans
        n, x2 = rng.randint(1, 8), rng.choice((0, 0, 2000))
        fit.add(n, x2, sum(0.02 * math.exp(rng.gauss(0, 0.3)) for _ in range(n)) + 0.0001 * x2, 1.0 / n)
        answers.append(fit.solve())
    assert answers[2] is None  # three samples fit three unknowns exactly: no error estimate
    first = next(k for k, x in enumerate(answers) if x is not None)
    assert 3 < first < 100
    assert answers[-1][1] == pytest.approx(0.0001, rel=0.25)
    flat = _Fit3()  # prompts that cost nothing: never a slope
    for _ in range(400):
        n, x2 = rng.randint(1, 8), rng.choice((0, 0, 2000))
        flat.add(n, x2, sum(0.02 * math.exp(rng.gauss(0, 0.3)) for _ in range(n)), 1.0 / n)
        assert flat.solve() is None or flat.solve()[1] < 2e-6


def test_no_rates_before_the_prefill_slope_is_known():
    book = RateBook()
    for k in range(50):  # busy, but no scraped iteration ever had a prompt in it
        book.observe("0", EngineSnapshot(at=k * 0.1, active=4, max_active=8, kv_max=256, tokens_per_block=64,
                                         iteration=float(5 * k), timestamp_us=k * 100_000, finished=k))
    assert book.engines["0"].iter_s == pytest.approx(0.02) and book.rates("0") is None


def test_decode_rate_is_right_from_the_first_seconds():
    """The mean context tokens of the scraped iterations is a ratio of sums from the start: an
    average started at 0 made decode_s the whole iteration for the first ~100 scrapes."""
    book = RateBook()
    for snap in TwinTrace().snapshots(10):
        book.observe("0", snap)
    assert book.rates("0").decode_s == pytest.approx(0.02, rel=0.3)  # was 0.039


class TwinTrace:
    """Snapshots of an engine whose iterations cost decode_s + prefill_s per context token, scraped
    every 100 ms (the last finished iteration's stats, as TRT-LLM's reporter leaves them)."""

    def __init__(self, decode_s=0.02, prefill_s=0.0001, slots=8, kv_max=256, out_tokens=20, seed=3):
        self.decode_s, self.prefill_s = decode_s, prefill_s
        self.slots, self.kv_max, self.out_tokens = slots, kv_max, out_tokens
        self.rng = random.Random(seed)
        self.t = 0.0  # engine clock: start of the next iteration
        self.iteration = 0
        self.finished = self.input_tokens = self.output_tokens = 0

    def snapshots(self, seconds: float):
        next_scrape = 0.1
        last = None
        while self.t < seconds:
            ctx = self.rng.choice((0, 0, 0, 120, 2100))  # most iterations only decode
            start = self.t
            self.t += self.decode_s + self.prefill_s * ctx
            self.iteration += 1
            if self.rng.random() < 0.3:
                self.finished += 1
                self.input_tokens += 2100
                self.output_tokens += self.out_tokens
            # A scrape while this iteration runs sees the one before: stats are set at its end.
            while last is not None and next_scrape <= self.t:
                s, c, it = last
                yield EngineSnapshot(at=next_scrape, active=6, max_active=self.slots, scheduled=6, kv_max=self.kv_max,
                                     kv_used=100, tokens_per_block=64, iteration=float(it),
                                     timestamp_us=int(s * 1e6), context_tokens=c, finished=self.finished,
                                     input_tokens=self.input_tokens, output_tokens=self.output_tokens)
                next_scrape += 0.1
            last = (start, ctx, self.iteration)


def test_rates_learnt_from_scrapes_of_a_busy_engine():
    book = RateBook()
    for snap in TwinTrace().snapshots(60):
        book.observe("0", snap)
    r = book.rates("0")
    assert r.prefill_s == pytest.approx(0.0001, rel=0.1)
    assert r.decode_s == pytest.approx(0.02, rel=0.15)
    # the mean iteration: decode + prefill of the mean context tokens (444)
    assert r.iter_s == pytest.approx(0.02 + 0.0001 * 444, rel=0.1)
    assert r.out_tokens == pytest.approx(20)


def test_rates_of_a_64_slot_engine_with_another_prefill_cost():
    book = RateBook()
    for snap in TwinTrace(decode_s=0.035, prefill_s=0.00004, slots=64, kv_max=1024).snapshots(60):
        book.observe("0", snap)
    r = book.rates("0")
    assert r.prefill_s == pytest.approx(0.00004, rel=0.1) and r.decode_s == pytest.approx(0.035, rel=0.15)


def test_an_idle_instance_borrows_the_rates_of_its_shape_and_none_of_another():
    book = RateBook()
    for snap in TwinTrace().snapshots(10):
        book.observe("0", snap)
    idle = EngineSnapshot(at=1.0, max_active=8, kv_max=256, tokens_per_block=64, iteration=0.0)
    book.observe("1", idle)
    assert book.rates("1") == book.rates("0")
    book.observe("2", EngineSnapshot(at=1.0, max_active=64, kv_max=256, tokens_per_block=64, iteration=0.0))
    assert book.rates("2") is None


def test_a_restart_is_not_learnt_from():
    er = EngineRates()
    a = EngineSnapshot(at=0.0, active=1, max_active=8, iteration=1000.0, timestamp_us=10_000_000, finished=50)
    b = EngineSnapshot(at=0.1, active=1, max_active=8, iteration=3.0, timestamp_us=10_100_000, finished=1)
    er.update(a)
    assert er.update(b) == (None, None) and er.iter_s is None
    assert er.out_tokens == PRIOR_OUT_TOKENS


def test_kv_bound_engine_runs_fewer_than_its_slots():
    er = EngineRates()
    for k in range(20):
        er.update(EngineSnapshot(at=k * 0.1, active=8, waiting=5, scheduled=3, max_active=8, iteration=float(k)))
    assert er.running() == 3
    er.update(EngineSnapshot(at=2.1, active=8, waiting=0, scheduled=8, max_active=8, iteration=21.0))
    assert er.running() == 8


# --- the cache -----------------------------------------------------------------------------
def test_write_log_counts_what_was_routed_after_a_time():
    log = WriteLog()
    for t in range(10):
        log.add(float(t), 2.0, horizon=1000)
    assert log.since(4.5) == (10.0, 5)
    assert log.since(9.0) == (0.0, 0)
    # before the log, nothing dropped yet: it holds every routing of its own, all after -1
    assert log.since(-1.0) == (20.0, 10)


def test_write_log_forgets_beyond_its_horizon():
    log = WriteLog()
    for t in range(100):
        log.add(float(t), 10.0, horizon=50)
    assert log.since(0.5)[0] == math.inf
    assert log.since(-1.0)[0] == math.inf  # before what it dropped: it cannot tell, so everything
    assert log.since(97.5) == (20.0, 2)


def test_cached_blocks():
    # a request that carried the prefix still runs beside the next one: all of it
    assert cached_blocks(32, written=1000, requests=3, running=8, free_blocks=0) == 32
    # released into a pool with 40 older blocks: 40 written take only those
    assert cached_blocks(32, written=40, requests=9, running=8, free_blocks=72) == 32
    # 10 more: its tail goes first
    assert cached_blocks(32, written=50, requests=9, running=8, free_blocks=72) == 22
    assert cached_blocks(32, written=200, requests=9, running=8, free_blocks=72) == 0
    assert cached_blocks(32, written=math.inf, requests=9, running=8, free_blocks=72) == 0


def test_ttft_estimate_waits_for_slots_then_prefills():
    r = Rates(iter_s=0.05, prefill_s=0.0001, decode_s=0.02, out_tokens=20)
    assert ttft_estimate(r, slots=8, n=3, uncached=1000) == pytest.approx(0.1 + 0.02)
    # 8 running + 2 queued: the third completion frees ours, each 20 * 0.05 / 8 s apart
    assert ttft_estimate(r, slots=8, n=10, uncached=0) == pytest.approx(3 * 20 * 0.05 / 8 + 0.02)


def test_instances_of_one_shape_learn_one_decode_rate():
    """Two engines alike, one busy with prompts, the other mostly decoding: decode_s is what an
    iteration costs without prompt tokens, the same engine's on both. Learnt per instance (the
    instance's mean iteration less the shape's prefill rate times the prompt tokens of the few
    iterations its scrapes saw), it came out apart, and on the real twin the one that looked
    cheaper was sent more (bench/README.md, routing_bench-20261126T163245Z)."""
    book = RateBook()
    busy, quiet = TwinTrace(seed=3), TwinTrace(seed=4)
    quiet.rng.choice = lambda options: 0 if quiet.rng.random() < 0.9 else 2100  # prompts 1 in 10
    for a, b in zip(busy.snapshots(60), quiet.snapshots(60)):
        book.observe("0", a)
        book.observe("1", b)
    r0, r1 = book.rates("0"), book.rates("1")
    assert r0.decode_s == r1.decode_s  # per instance: 15.6 and 15.0 ms
    assert r0.decode_s == pytest.approx(0.02, rel=0.2)
    assert r0.iter_s > r1.iter_s  # each instance keeps its own mean iteration (its queue's pace)
