"""LLM-level proxy metrics without a real engine: the last-minute recorder, the token
clock, SSE event counting over any chunk split, the hold hook, and the embedded proxy
against a fake SSE upstream (events, TTFT, inter-token gaps, routing decisions)."""

from __future__ import annotations

import asyncio
import json
import math
import random

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.config import Settings
from orchestrator.routing.backends import Backend, ReadyBackends
from orchestrator.dataplane.embedded import EmbeddedProxy
from orchestrator.dataplane.hold import HoldGate
from orchestrator.dataplane.metrics import ProxyMetrics, SseCounter
from orchestrator.dataplane.recent import HIST_RATIO, RecentLLM

pytestmark = pytest.mark.unit


def samples(metrics: ProxyMetrics) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(metrics.render().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(metrics: ProxyMetrics, name: str, **labels) -> float:
    return samples(metrics).get((name, tuple(sorted(labels.items()))), 0.0)


# --- the last minute ------------------------------------------------------------------

def percentile(sorted_values: list[float], q: float) -> float:
    """The exact nearest-rank percentile: what the bucket counts are checked against."""
    rank = max(1, math.ceil(q * len(sorted_values) - 1e-9))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def test_bucket_percentiles_are_the_exact_nearest_rank_or_at_most_a_bucket_above():
    from orchestrator.dataplane.recent import histogram_percentile, log_histogram
    values = [float(i) / 1000 for i in range(1, 101)]
    for q in (0.5, 0.99):
        truth = percentile(values, q)
        assert truth <= histogram_percentile(log_histogram(values), q) <= truth * HIST_RATIO
    assert 0.007 <= histogram_percentile(log_histogram([0.007]), 0.99) <= 0.007 * HIST_RATIO


def test_a_values_bucket_is_the_least_whose_bound_holds_it():
    """bucket_of (a bisection of the bounds up to 1.5e16 s, a log past them) against its
    definition, the least i with v <= HIST_BASE_S * HIST_RATIO**i, on values at every bound, a hair
    either side, random ones, below the first bound and past the table; and log_histogram's counts
    against counting value by value."""
    from collections import Counter

    from orchestrator.dataplane.recent import HIST_BASE_S, bucket_of, log_histogram

    def least(v: float) -> int:
        i = 0
        while HIST_BASE_S * HIST_RATIO ** i < v:
            i += 1
        return i

    bounds = [HIST_BASE_S * HIST_RATIO ** i for i in range(1010)]
    rng = random.Random(3)
    values = [0.0, -1.0, HIST_BASE_S / 2] + bounds + [math.nextafter(b, 0.0) for b in bounds] + \
        [math.nextafter(b, math.inf) for b in bounds] + [10 ** rng.uniform(-6, 17) for _ in range(3000)]
    for v in values:
        assert bucket_of(v) == least(v), v
    rng.shuffle(values)
    truth = {str(i): n for i, n in sorted(Counter(least(v) for v in values).items())}
    assert list(log_histogram(values).items()) == list(truth.items())  # ascending, as the sums are read


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_log_histogram_counts_alike_compiled_or_not(monkeypatch, compiled):
    """_log_buckets.counts and the Python's sort-and-bisect give the same buckets in the same
    (ascending) order on unsorted values at every bound and a hair either side, random ones and
    below the first bound; the compiled one answers them itself (None only where it hands over:
    a value past the table, an int), and what it hands over is counted by the Python alike."""
    from collections import Counter

    from orchestrator.dataplane import recent

    if compiled and recent._NATIVE is None:
        pytest.skip("the compiled module is not built here")
    if not compiled:
        monkeypatch.setattr(recent, "_NATIVE", None)
    rng = random.Random(5)
    bounds = list(recent._BOUNDS)
    inside = [0.0, -2.5, recent.HIST_BASE_S / 3] + bounds + [math.nextafter(b, 0.0) for b in bounds] + \
        [math.nextafter(b, math.inf) for b in bounds[:-1]] + [10 ** rng.uniform(-6, 1) for _ in range(5000)]
    rng.shuffle(inside)
    if compiled:
        assert recent._NATIVE.counts(list(inside), recent._BOUNDS, recent._KEYS) is not None
        assert recent._NATIVE.counts([0.1, math.nextafter(bounds[-1], math.inf)], recent._BOUNDS, recent._KEYS) is None
        assert recent._NATIVE.counts([0.1, 3], recent._BOUNDS, recent._KEYS) is None
    for values in (inside, inside[:1], [], inside[:50] + [1e18, 7, 0.25]):
        truth = Counter(recent.bucket_of(v) for v in values)
        counted = recent.log_histogram(list(values))
        assert list(counted.items()) == [(str(i), truth[i]) for i in sorted(truth)]


def test_several_percentiles_read_at_once_are_each_read_alone():
    """histogram_percentiles walks the buckets once for every q asked, in any order: each answer is
    the nearest-rank bucket bound read on its own (the definition, written out here)."""
    from orchestrator.dataplane.recent import _bound, histogram_percentiles, log_histogram

    def alone(counts: dict[str, int], q: float) -> float:
        buckets = sorted((int(k), n) for k, n in counts.items())
        rank = max(1, math.ceil(q * sum(n for _, n in buckets) - 1e-9))
        seen = 0
        for index, n in buckets:
            seen += n
            if seen >= rank:
                return _bound(index)
        raise AssertionError("empty")

    rng = random.Random(8)
    for size in (1, 2, 3, 7, 100, 2000):
        counts = log_histogram([rng.lognormvariate(-3, 1.5) for _ in range(size)])
        qs = (0.99, 0.0, 0.5, 1.0, 0.5, 0.9, 0.01)
        assert histogram_percentiles(counts, *qs) == [alone(counts, q) for q in qs]
    with pytest.raises(ValueError):
        histogram_percentiles({}, 0.5)


def test_recent_window_rates_and_percentiles():
    now = [1000.0]
    rec = RecentLLM(window_s=60, clock=lambda: now[0])
    for i in range(10):
        rec.first_token("0", 0.010 * (i + 1), now[0] + i)
        rec.events("0", 5, now[0] + i)
    now[0] += 10
    s = rec.summary()["0"]
    assert s["generations"] == 10
    # read from log buckets: at most HIST_RATIO above the exact percentile, never below
    assert 50.0 <= s["ttft_p50_ms"] <= 50.0 * HIST_RATIO + 0.1 and 100.0 <= s["ttft_p99_ms"] <= 100.0 * HIST_RATIO + 0.1
    assert s["tokens_per_s"] == 5.0  # 50 events over the 10 s this instance has been seen
    now[0] += 55  # the first 5 seconds fall out of the window
    s = rec.summary()["0"]
    assert s["generations"] == 5 and s["tokens_per_s"] == round(25 / 60, 1)
    now[0] += 120
    assert rec.summary() == {}  # idle for a whole window: forgotten


def test_recent_percentiles_of_a_full_minute_stay_within_a_bucket_of_the_exact_ones():
    """A minute of ended seconds is kept as bucket counts; its percentiles are the exact ones
    or up to HIST_RATIO above, and a first token noted late for an ended second still counts."""
    import random

    rng = random.Random(7)
    now = [1000.0]
    rec = RecentLLM(window_s=60, clock=lambda: now[0])
    values = []
    for sec in range(60):
        for k in range(300):
            v = rng.lognormvariate(-3.0, 0.8)
            values.append(v)
            rec.first_token("0", v, 1000.0 + sec + k / 301)
    now[0] = 1059.5
    s = rec.summary(histogram=True)["0"]
    exact = sorted(values)
    for q, key in ((0.50, "ttft_p50_ms"), (0.99, "ttft_p99_ms")):
        truth = percentile(exact, q) * 1000
        assert truth - 0.05 <= s[key] <= truth * HIST_RATIO + 0.05, (key, s[key], truth)
    assert sum(s["ttft_hist"].values()) == s["generations"] == 18_000
    rec.first_token("0", 5.0, 1058.2)  # its second ended and was summarised already
    s = rec.summary(histogram=True)["0"]
    assert sum(s["ttft_hist"].values()) == s["generations"] == 18_001
    assert s["ttft_p99_ms"] <= percentile(sorted(values + [5.0]), 0.99) * 1000 * HIST_RATIO + 0.05
    # Seconds leave the window with their counts: 30 s later only the last half is counted.
    now[0] = 1089.5
    s = rec.summary(histogram=True)["0"]
    kept = sorted(values[29 * 300:] + [5.0])
    assert sum(s["ttft_hist"].values()) == s["generations"] == len(kept)
    assert percentile(kept, 0.5) * 1000 - 0.05 <= s["ttft_p50_ms"] <= percentile(kept, 0.5) * 1000 * HIST_RATIO + 0.05


def test_workers_ttft_percentiles_merge_from_their_bucket_counts_not_by_averaging():
    from orchestrator.controlplane.workers import merge_llm_rows
    from orchestrator.dataplane.recent import HIST_RATIO

    def row(ttfts: list[float]) -> dict:
        rec = RecentLLM(window_s=60, clock=lambda: 1000.0)
        for t in ttfts:
            rec.first_token("0", t, 1000.0)
            rec.events("0", 4, 1000.0)
        return rec.summary(1000.0, histogram=True)["0"]

    # One worker served 99 fast answers, another one slow answer: the instance's p99 over the
    # 100 is a fast one, p50 fast too. Averaging the workers' own percentiles gave ~1 s.
    fast, slow = row([0.020 + 0.0001 * i for i in range(99)]), row([2.0])
    merged = merge_llm_rows([fast, slow])
    exact = sorted([0.020 + 0.0001 * i for i in range(99)] + [2.0])
    assert merged["generations"] == 100 and merged["tokens_per_s"] == fast["tokens_per_s"] + slow["tokens_per_s"]
    for q, key in ((0.50, "ttft_p50_ms"), (0.99, "ttft_p99_ms")):
        truth = percentile(exact, q) * 1000
        assert truth <= merged[key] <= truth * HIST_RATIO + 0.1, (key, merged[key], truth)
    # One worker alone: its own exact figures; an older worker without counts: the mean.
    assert merge_llm_rows([fast])["ttft_p99_ms"] == fast["ttft_p99_ms"]
    old = {k: v for k, v in slow.items() if k != "ttft_hist"}
    assert merge_llm_rows([fast, old])["ttft_p50_ms"] == round((99 * fast["ttft_p50_ms"] + old["ttft_p50_ms"]) / 100, 1)
    # cost-model's picks add up, and its estimates' median error merges like the TTFTs (it
    # was dropped: `top` showed no ROUTE or EST ERR with data-plane workers).
    a, b = RecentLLM(clock=lambda: 1000.0), RecentLLM(clock=lambda: 1000.0)
    for rec, reason, errors in ((a, "hit", [0.1] * 9), (b, "miss", [0.5] * 3)):
        rec.first_token("0", 0.05, 1000.0)
        for e in errors:
            rec.routed("0", reason, 1000.0)
            rec.estimate_error("0", e, 1000.0)
    both = merge_llm_rows([a.summary(1000.0, histogram=True)["0"], b.summary(1000.0, histogram=True)["0"]])
    assert both["routes"] == {"hit": 9, "miss": 3}
    assert 0.1 <= both["ttft_est_err"] <= 0.1 * HIST_RATIO + 0.001  # 9 of the 12 errors are 0.1
    plain = RecentLLM(clock=lambda: 1000.0)
    plain.first_token("0", 0.1, 1000.0)
    assert "ttft_hist" not in plain.summary(1000.0)["0"]  # status shows percentiles, not buckets


# --- token clock and SSE ----------------------------------------------------------------

def test_sse_counter_over_every_split():
    stream = b"".join(b'data: {"text_output":"w%d"}\n\n' % i for i in range(7))
    for cut in range(1, len(stream)):
        counter = SseCounter()
        assert counter.feed(stream[:cut]) + counter.feed(stream[cut:]) == 7, cut
    counter = SseCounter()
    assert sum(counter.feed(stream[i:i + 1]) for i in range(len(stream))) == 7


def test_token_timer_first_token_then_gaps(monkeypatch):
    clock = iter([100.0, 100.25, 100.30, 100.40])
    monkeypatch.setattr("orchestrator.dataplane.metrics.time.monotonic", lambda: next(clock))
    m = ProxyMetrics()
    timer = m.timer("generate_stream")  # started at 100.0
    timer.events("1")  # 100.25: TTFT 0.25
    timer.events("1", 2)  # 100.30: one gap of 0.05 and one of 0 (same read)
    timer.events("1", 0)  # nothing arrived: no clock read, nothing recorded
    labels = {"instance": "1", "api": "generate_stream"}
    assert value(m, "trtllm_orch_proxy_time_to_first_token_seconds_count", **labels) == 1
    assert value(m, "trtllm_orch_proxy_time_to_first_token_seconds_sum", **labels) == pytest.approx(0.25)
    assert value(m, "trtllm_orch_proxy_inter_token_seconds_count", **labels) == 2
    assert value(m, "trtllm_orch_proxy_inter_token_seconds_sum", **labels) == pytest.approx(0.05)
    assert value(m, "trtllm_orch_proxy_output_events_total", **labels) == 3


async def test_hold_hook_and_held_gauge():
    m = ProxyMetrics()
    backends = ReadyBackends()
    gate = HoldGate(backends, hold_s=5.0, max_held=10, on_held=m.watch_held("http", lambda: gate.held))
    gate.start()
    waiter = asyncio.ensure_future(gate.ready())
    await asyncio.sleep(0.05)
    assert value(m, "trtllm_orch_proxy_held_requests", proxy="http") == 1 and m.held_now() == 1
    backends.publish((Backend("0", "127.0.0.1", 1, 2, 3),))
    assert await waiter
    assert m.held_now() == 0
    assert value(m, "trtllm_orch_proxy_hold_seconds_count", proxy="http", outcome="routed") == 1
    gate.hold_s = 0.05
    backends.publish(())
    assert await gate.ready() == ()
    assert value(m, "trtllm_orch_proxy_hold_seconds_count", proxy="http", outcome="timed_out") == 1
    gate.close()


# --- the embedded proxy against a fake SSE upstream -------------------------------------------

async def _sse(request: web.BaseRequest) -> web.StreamResponse:
    body = json.loads(await request.read())
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(body["max_tokens"]):
        await asyncio.sleep(0.01)
        await resp.write(b'data: {"text_output":" w%d"}\n\n' % i)
    await resp.write_eof()
    return resp


async def _plain(request: web.BaseRequest) -> web.StreamResponse:
    await request.read()
    await asyncio.sleep(0.02)
    return web.json_response({"text_output": "a b c"})


async def test_embedded_proxy_records_llm_metrics():
    app = web.Server(lambda r: _sse(r) if r.path.endswith("generate_stream") else _plain(r))
    runner = web.ServerRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    backends = ReadyBackends()
    backends.publish((Backend("0", "127.0.0.1", port, 0, 0),))
    proxy = EmbeddedProxy(Settings(listen="127.0.0.1:0", metrics_listen="", grpc_listen="",
                                   lb_policy="least-outstanding"), backends)
    await proxy.start()
    try:
        base = f"http://127.0.0.1:{proxy.bound_port}/v2/models/ensemble"
        async with aiohttp.ClientSession() as session:
            for _ in range(3):
                async with session.post(f"{base}/generate_stream", json={"max_tokens": 4}) as resp:
                    events = (await resp.read()).count(b"\n\n")
                    assert events == 4
                async with session.post(f"{base}/generate", json={"max_tokens": 4}) as resp:
                    assert resp.status == 200
            async with session.get(f"{base}/ready") as resp:  # metadata: no generation
                await resp.read()
    finally:
        await proxy.stop(1.0)
        await runner.cleanup()
    m = proxy.metrics
    stream = {"instance": "0", "api": "generate_stream"}
    plain = {"instance": "0", "api": "generate"}
    assert value(m, "trtllm_orch_proxy_output_events_total", **stream) == 12
    assert value(m, "trtllm_orch_proxy_time_to_first_token_seconds_count", **stream) == 3
    assert value(m, "trtllm_orch_proxy_inter_token_seconds_count", **stream) == 9
    assert value(m, "trtllm_orch_proxy_output_events_total", **plain) == 3
    assert value(m, "trtllm_orch_proxy_time_to_first_token_seconds_count", **plain) == 3
    assert value(m, "trtllm_orch_proxy_time_to_first_token_seconds_sum", **plain) >= 3 * 0.02
    # Every forwarded request was a routing decision, metadata included.
    assert value(m, "trtllm_orch_proxy_routing_decisions_total", policy="least-outstanding",
                 reason="least-outstanding", instance="0") == 7
    recent = m.recent.summary()["0"]
    assert recent["generations"] == 6 and recent["ttft_p50_ms"] is not None


async def test_a_scrape_does_not_stop_the_loop_that_relays_streams():
    # A scrape renders every worker's files (5-12 ms at 1-8 workers): on the serving loop it
    # stopped every stream of that worker as long. Here a collector finishes only once the loop
    # has run a callback scheduled after the scrape began: on the loop it would wait in vain.
    import threading

    from prometheus_client.core import GaugeMetricFamily

    loop_ran = threading.Event()

    class WaitsForTheLoop:
        def describe(self):  # registering it must not collect (that runs on this thread)
            return []

        def collect(self):
            asyncio.run_coroutine_threadsafe(_set(loop_ran), loop)
            ran = loop_ran.wait(5)
            family = GaugeMetricFamily("loop_ran_during_scrape", "1 if the loop ran during the render")
            family.add_metric((), 1.0 if ran else 0.0)
            return [family]

    loop = asyncio.get_running_loop()
    metrics = ProxyMetrics()
    metrics.registry.register(WaitsForTheLoop())
    body = (await metrics.render_off_loop()).decode()
    assert "loop_ran_during_scrape 1.0" in body
    assert "trtllm_orch_proxy_requests" in body  # the rest of the exposition is all there


async def _set(event) -> None:
    event.set()


def test_many_observations_at_once_count_as_one_by_one():
    """The compiled front's batches (front/ledger.py) fold a histogram's values at once: bounds
    included, past the last finite bound, the same buckets and sum as observe() one by one."""
    from prometheus_client import CollectorRegistry, Histogram
    from orchestrator.dataplane.metrics import observe_many
    values = [0.0, 0.001, 0.0011, 0.5, 0.5, 2.0, 1e9, 0.25]
    one, many = (Histogram(name, "", buckets=(0.001, 0.25, 0.5, 1.0), registry=CollectorRegistry())
                 for name in ("one", "many"))
    for v in values:
        one.observe(v)
    observe_many(many, values)
    samples = [[(s.name.split("_", 1)[1], s.labels, s.value) for s in next(iter(h.collect())).samples
                if not s.name.endswith("_created")] for h in (one, many)]
    assert samples[0] == samples[1]
    assert ("bucket", {"le": "0.5"}, 6.0) in samples[1]
