"""Routing policies on the twin's engine in virtual time: issue 24's whole matrix
(bench/routing_cells.py) in minutes, without Triton.

    .venv/bin/python -m bench.routing_sim [--seconds 60] [--shapes 8,64] [--rooms 1.5,4]
        [--workloads uniform,zipf,chat,unique,mixed] [--loads r0,r1,r2,closed]
        [--targets cost-model,prefix-affinity,least-outstanding,round-robin,nginx] [--jobs 2]
        [--seeds 1,2] [--index shared|local] [--jitter 0.3]
        [--reuse EARLIER.json [--rerun cost-model]] [--out DIR]

Two `demo/twin/engine.py` engines (the code the twin's tritonserver runs: in-flight batching,
paged KV cache with prefix reuse and LRU eviction, guaranteed_no_evict admission, per-token
prefill cost) advance in virtual time. The router is the proxy's own policy class, fed the
proxy's in-flight counts and engine snapshots every 100 ms (as the engine monitor scrapes
them, with the same fields parse_engine_metrics reads: the last iteration's stats, its
start time and context tokens, the input/output histograms' sums and count); `nginx` is
least_conn (fewest in flight, ties in turn), `least-outstanding` ties at random. The
cost model is told each request's observed TTFT, as the proxy tells it. The prompt-aware
policies get the prefix index the data-plane workers share (dataplane/shared_prefix.py, as
`up --proxy embedded` runs them; `--index local`: a policy's own PrefixIndex). A target
`POLICY@N` (e.g. `cost-model@4`, what `--proxy-workers auto` gives on 16 cores) runs the policy
as N data-plane workers: each request to one at random, each keeping its own journal.

Faithful to: the engine's scheduling, KV accounting and eviction, timing in the twin's model,
the scrape cadence. Not modelled: CPU (the real twin's iterations stretch when its host is
busy: `--jitter` puts a lognormal factor on each iteration's time, so the rates are learnt
from noisy spans), network and Triton's own queues, NGINX's per-worker counts. bench/routing_bench.py runs
a subset of the same cells on the real twin to check the simulator against it.

Output: a table per cell and bench/results/routing_sim-<stamp>.{json,png} (`--no-write` to skip,
`--out DIR` to write them there, as every benchmark's `--out`). Progress on stderr, one
line per cell and target. `--reuse` takes an earlier run's rows for the targets not in
`--rerun` (a change to the cost model leaves the baselines as they were). Each row also says
where the time went (`_where_time_went`): how far apart the picks left the instances' in-flight
counts, and the TTFT of the requests that found most of their prompt cached against the rest.
"""

from __future__ import annotations

import argparse
import heapq
import inspect
import itertools
import json
import math
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from bench import routing_cells as rc
from bench.common import machine, pct, table, write_result
from bench.decision_cost import measure
from orchestrator.dataplane.shared_pending import SharedPending
from orchestrator.dataplane.shared_stamps import SharedStamps
from orchestrator.dataplane.shared_prefix import SharedPrefixIndex
from orchestrator.health.engine_state import EngineSnapshot, EngineView
from orchestrator.routing.backends import Backend
from orchestrator.routing.balancer import POLICIES
from orchestrator.routing.journal import Journal
from orchestrator.routing.llm_policies import RouteHints, SharedTurns

from tests.harness import DEMO_REPO

sys.path.insert(0, str(DEMO_REPO.parent))
from twin.engine import Engine, EngineConfig, Sequence  # noqa: E402
from twin.tokens import decode, encode  # noqa: E402

SCRAPE_S = 0.1
INDEX_EPOCH_S = 1000.0


class NginxLeastConn:
    """NGINX `least_conn`: the fewest active connections; among equals, in turn."""

    def __init__(self, rng: random.Random) -> None:
        self._next = 0

    def choose(self, backends, skip, inflight, hints=None):
        n = len(backends)
        best, best_n = None, None
        for k in range(n):
            b = backends[(self._next + k) % n]
            c = inflight.get(b.instance_id, 0)
            if best_n is None or c < best_n:
                best, best_n, pos = b, c, (self._next + k) % n
        self._next = (pos + 1) % n
        return best


class StaticPartition:
    """Reference only (not a product policy): tenant t on instance t mod instances, fixed; other
    workloads by least in flight. What a perfect partition of the tenants' prefixes gives."""

    def __init__(self, rng: random.Random) -> None:
        self._lo = POLICIES["least-outstanding"](rng)
        self.prompt = ""

    def choose(self, backends, skip, inflight, hints=None):
        m = re.search(r" tenant (\d+)\]", self.prompt[:80]) or re.search(r"\[sim\d+-(\d+)\] User", self.prompt[:400])
        if m is None:
            return self._lo.choose(backends, skip, inflight, hints)
        return backends[int(m.group(1)) % len(backends)]


class Workers:
    """`policy@N`: N data-plane workers' policies of one kind, each request to one of them at
    random (as the kernel spreads connections), sharing what the product's workers share (the
    in-flight counts, also as each snapshot was published; the prefix index; cost-model's
    pending prefill and write logs; the default's turns among ties) and each keeping its own
    learnt state. The summary reads the first one's rates."""

    def __init__(self, policies: list[Any], rng: random.Random, stamps: Any = None) -> None:
        self.policies = policies
        self._rng = rng
        self.stamps = stamps  # their shared turns and counts (dataplane/shared_stamps.py), if any
        self.last_reason = ""
        self.last_decision = None

    def choose(self, backends, skip, inflight, hints=None):
        policy = self._rng.choice(self.policies)
        b = policy.choose(backends, skip, inflight, hints)
        self.last_reason = getattr(policy, "last_reason", "")
        self.last_decision = getattr(policy, "last_decision", None)
        return b

    def __getattr__(self, name: str) -> Any:
        return getattr(self.policies[0], name)


def _workers(target: str, n: int, rng: random.Random, clock, policy_kw: dict | None, index_dir: str | None) -> Workers:
    cls = POLICIES[target]
    params = inspect.signature(cls).parameters
    shared: dict[str, Any] = {}
    if index_dir is not None and "index" in params:
        shared["index"] = SharedPrefixIndex.create(Path(index_dir) / "prefixes", clock=clock)
    files: list[SharedPending] = []
    if index_dir is not None and "journal" in params:  # pending prefill, routed blocks and requests
        files = [SharedPending.create(Path(index_dir) / name) for name in ("pending", "blocks", "requests")]
    turns = SharedStamps.create(Path(index_dir) / "turns") if index_dir is not None and "turns" in params else None
    policies = []
    for k in range(n):
        kw = dict(policy_kw or {}, **shared)
        if files:
            lanes = [f.lane(k, lambda: n) for f in files]
            kw["journal"] = Journal(lanes[0], (lanes[1], lanes[2]))
        if turns is not None:
            kw["turns"] = SharedTurns(turns)
        own = random.Random(rng.random())
        policies.append(cls(own) if target in ("least-outstanding", "round-robin") else cls(own, clock=clock, **kw))
    return Workers(policies, rng, turns)


def make_router(target: str, rng: random.Random, clock, policy_kw: dict | None = None, index_dir: str | None = None):
    """The target's router. With `index_dir`, a policy that takes a prefix index gets the one the
    data-plane workers share (dataplane/shared_prefix.py, a file there), as `up --proxy embedded`
    runs it; without, the in-process PrefixIndex of a policy left to itself. `policy@N`: that
    policy as N data-plane workers (`Workers`)."""
    base, _, n = target.partition("@")
    if n:
        return _workers(base, int(n), rng, clock, policy_kw, index_dir)
    if target == "nginx":
        return NginxLeastConn(rng)
    if target == "partition":
        return StaticPartition(rng)
    cls = POLICIES[target]
    if target in ("least-outstanding", "round-robin"):
        return cls(rng)
    kw = dict(policy_kw or {})
    if index_dir is not None and "index" in inspect.signature(cls).parameters:
        kw["index"] = SharedPrefixIndex.create(Path(index_dir) / "prefixes", clock=clock)
    return cls(rng, clock=clock, **kw)


def simulate(cell: rc.Cell, target: str, seconds: float, seeds: tuple[int, ...] = (1,),
             policy_kw: dict | None = None, jitter: float = 0.0, index: str = "shared") -> dict[str, Any]:
    """One target on one cell, once per seed (its own arrivals and prompts); the requests of
    every seed pooled. `index`: "shared" (the data-plane workers' prefix index, as the product
    runs) or "local" (the policy's own in-process PrefixIndex). `jitter` > 0: each iteration
    takes its modelled time times a lognormal factor of that sigma (the real twin's iterations
    on a busy host: sleeps overshoot, the loop's thread waits for a core), so the rates are
    learnt from noisy spans."""
    recs: list[dict[str, Any]] = []
    reasons: dict[str, int] = {}
    decide_s: list[float] = []
    tokens = 0
    router = None
    by_seed: list[list[float]] = []
    for seed in seeds:
        r, t, why, dec, router = _one_seed(cell, target, seconds, seed, policy_kw, jitter, index)
        recs += r
        by_seed.append([x["ttft"] * 1000 for x in r])
        tokens += t
        for k, v in why.items():
            reasons[k] = reasons.get(k, 0) + v
        decide_s += dec
    out = summarize(cell, target, seconds * len(seeds), recs, tokens, reasons, decide_s, router)
    out[rc.SEED_P90S] = [pct(x, 90) for x in by_seed]
    out[rc.SEED_TTFTS] = by_seed  # for the verdicts' interval (routing_cells.verdicts); not written
    return out


def _one_seed(cell: rc.Cell, target: str, seconds: float, seed: int, policy_kw: dict | None, jitter: float = 0.0,
              index: str = "shared"):
    tmp = tempfile.mkdtemp(prefix="routing-sim-") if index == "shared" else None
    try:
        return _simulate_seed(cell, target, seconds, seed, policy_kw, jitter, tmp)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _simulate_seed(cell: rc.Cell, target: str, seconds: float, seed: int, policy_kw: dict | None, jitter: float,
                   index_dir: str | None):
    now = [0.0]
    # What the router sees runs INDEX_EPOCH_S ahead of the simulation, which starts at 0: the
    # shared prefix index counts records only after an instance's "forgotten" time, 0.0 in a
    # new file. Its clock, the policy's and the snapshots' times are one clock, as in a proxy.
    clock = lambda: now[0] + INDEX_EPOCH_S  # noqa: E731
    cfg = EngineConfig(max_batch_size=cell.slots, max_tokens_in_paged_kv_cache=cell.kv_tokens,
                       tokens_per_block=rc.BLOCK, enable_kv_cache_reuse=True, decode_ms=rc.DECODE_MS,
                       prefill_ms_per_token=rc.PREFILL_MS)
    n_inst = rc.INSTANCES
    engines = [Engine(cfg, clock_ns=lambda: int(now[0] * 1e9)) for _ in range(n_inst)]
    views = [EngineView() for _ in range(n_inst)]
    backends = [Backend(str(i), "sim", 1, 2, 3, engine=views[i]) for i in range(n_inst)]
    router = make_router(target, random.Random(seed), clock, policy_kw, index_dir)
    hist = [{"finished": 0, "input": 0, "output": 0} for _ in range(n_inst)]
    inflight: dict[str, int] = {}
    busy = [False] * n_inst
    stats: list[Any] = [None] * n_inst
    heap: list[tuple[float, int, str, Any]] = []
    order = itertools.count()
    source = rc.sessions(cell, salt=f"sim{seed}", seed=f"seq{seed}")
    recs: list[dict[str, Any]] = []
    reasons: dict[str, int] = {}
    decide_s: list[float] = []
    tokens_in_window = [0]
    rate = cell.rate()
    if rate is None:
        for _ in range(cell.concurrency):
            heapq.heappush(heap, (0.0, next(order), "start", None))
    else:
        mean_turns = 5.0 if cell.workload == "chat" else 1.0
        rng = random.Random(f"arrivals{seed}/{cell.name}")
        t = 0.0
        while True:
            t += rng.expovariate(rate / mean_turns)
            if t >= seconds:
                break
            heapq.heappush(heap, (t, next(order), "start", None))
    heapq.heappush(heap, (0.0, next(order), "scrape", None))

    noise = random.Random(f"jitter{seed}")

    def step(i: int) -> None:
        it = engines[i].step()
        busy[i] = True
        duration = it.duration_s * math.exp(noise.gauss(0.0, jitter)) if jitter else it.duration_s
        heapq.heappush(heap, (now[0] + duration, next(order), "iteration", (i, it)))

    def send(session: rc.Session, prompt: str, max_tokens: int) -> None:
        t = now[0]
        hints = RouteHints.from_prompt(prompt)
        if target == "partition":
            router.prompt = prompt
        t0 = time.perf_counter()
        b = router.choose(backends, (), inflight, hints)
        decide_s.append(time.perf_counter() - t0)
        reason = getattr(router, "last_reason", "") or target
        reasons[reason] = reasons.get(reason, 0) + 1
        decision = getattr(router, "last_decision", None)
        i = int(b.instance_id)
        counts = [inflight.get(x.instance_id, 0) for x in backends]  # before this pick (imbalance)
        inflight[b.instance_id] = inflight.get(b.instance_id, 0) + 1
        ids = encode(prompt)
        rec = {"at": t, "ttft": None, "e2e": None, "i": i, "blocks": (len(ids) - 1) // rc.BLOCK, "reused": 0,
               "above_least": counts[i] - min(counts), "spread": max(counts) - min(counts),
               "decision": decision, "est": decision.estimate_s if decision is not None else None,
               "cached_est": decision.cached_tokens if decision is not None else None, "session": session}
        recs.append(rec)
        engines[i].enqueue(Sequence(len(recs) - 1, ids, max_tokens))
        if not busy[i]:
            step(i)

    stamps = router.stamps if isinstance(router, Workers) else None

    def routed_at(iid: str) -> int | None:
        """What the daemon sends with a snapshot (WorkerPool._routed): every worker's count as the
        latest choice read it, at least the count now; None for one policy (its own notes)."""
        return None if stamps is None else stamps.routed(iid, inflight.get(iid, 0))

    while heap:
        t, _, kind, data = heapq.heappop(heap)
        now[0] = t
        if kind == "scrape":
            for i in range(n_inst):
                s, h = stats[i], hist[i]
                views[i].update(EngineSnapshot(
                    at=clock(), active=s.active if s else 0, max_active=cell.slots, waiting=s.waiting if s else 0,
                    scheduled=s.scheduled if s else 0, context=s.context if s else 0,
                    kv_max=cell.kv_tokens // rc.BLOCK, kv_used=s.kv_used if s else 0,
                    kv_free=s.kv_free if s else cell.kv_tokens // rc.BLOCK, tokens_per_block=rc.BLOCK,
                    kv_reused=s.kv_reused if s else 0, iteration=float(s.iteration) if s else 0.0,
                    timestamp_us=s.timestamp_us if s else 0, context_tokens=s.total_context_tokens if s else 0,
                    input_tokens=h["input"], finished=h["finished"], output_tokens=h["output"],
                    routed=routed_at(str(i))))
            if any(h[2] != "scrape" for h in heap):
                heapq.heappush(heap, (t + SCRAPE_S, next(order), "scrape", None))
        elif kind == "start":
            session = next(source)
            prompt, max_tokens = session.first()
            send(session, prompt, max_tokens)
        elif kind == "turn":
            session, prompt, max_tokens = data
            send(session, prompt, max_tokens)
        else:
            i, it = data
            stats[i] = it.stats
            for ev in it.events:
                k = ev.seq.req_id
                rec = recs[k]
                if ev.tokens:
                    if rec["ttft"] is None:
                        rec["ttft"] = t - rec["at"]
                        rec["reused"] = ev.seq.reused_blocks
                        if rec["decision"] is not None:
                            rec["decision"].first_token(rec["ttft"])
                    if t <= seconds:
                        tokens_in_window[0] += len(ev.tokens)
                if ev.finished:
                    inflight[str(i)] -= 1
                    rec["e2e"] = t - rec["at"]
                    hist[i]["finished"] += 1
                    hist[i]["input"] += len(ev.seq.prompt)
                    hist[i]["output"] += len(ev.seq.generated)
                    session = rec["session"]
                    nxt = session.next(decode(ev.seq.generated)) if t < seconds else None
                    if nxt is not None:
                        delay = 0.0 if rate is None else random.Random(k).expovariate(1.0 / session.think_s) \
                            if session.think_s else 0.0
                        heapq.heappush(heap, (t + delay, next(order), "turn", (session, *nxt)))
                    elif rate is None and t < seconds:
                        heapq.heappush(heap, (t, next(order), "start", None))
            busy[i] = False
            if engines[i].has_work() or it.stats.active > 0:
                step(i)
    for rec in recs:
        rec.pop("session")
        rec.pop("decision")
    return recs, tokens_in_window[0], reasons, decide_s, router


def summarize(cell, target, seconds, recs, window_tokens, reasons, decide_s, router) -> dict[str, Any]:
    ttft = [r["ttft"] * 1000 for r in recs]
    e2e = [r["e2e"] * 1000 for r in recs]
    n = len(recs)
    out = {"cell": cell.name, "target": target, "rate": cell.rate(), "n": n,
           "ttft_p50_ms": pct(ttft, 50), "ttft_p90_ms": pct(ttft, 90), "ttft_p99_ms": pct(ttft, 99),
           "e2e_p99_ms": pct(e2e, 99), "out_tok_s": round(window_tokens / seconds, 1),
           "kv_hit_rate": round(sum(r["reused"] for r in recs) / max(1, sum(r["blocks"] for r in recs)), 3),
           "share": [round(sum(1 for r in recs if r["i"] == i) / n, 3) for i in range(rc.INSTANCES)],
           "reasons": reasons, "decide_us_p50": round(statistics.median(decide_s) * 1e6, 1)}
    out.update(_where_time_went(recs))
    est = [(r["est"], r["ttft"]) for r in recs if r["est"] is not None]
    if est:
        rel = sorted(abs(e - o) / o for e, o in est if o > 0)
        out["est_err_p50"] = round(rel[len(rel) // 2], 3)
        out["est_err_p90"] = round(rel[int(len(rel) * 0.9)], 3)
        out["est_bias_ms"] = round(statistics.mean(o - e for e, o in est) * 1000, 1)
        cached = sum(r["cached_est"] for r in recs if r["cached_est"] is not None)
        reused = sum(r["reused"] * rc.BLOCK for r in recs if r["cached_est"] is not None)
        out["cached_est_over_reused"] = round(cached / reused, 3) if reused else None
    book = getattr(router, "book", None)
    if book is not None:
        rates = {iid: book.rates(iid) for iid in book.engines}
        out["rates"] = {iid: None if r is None else {k: round(getattr(r, k), 6) for k in
                                                     ("iter_s", "prefill_s", "decode_s", "out_tokens")}
                        for iid, r in rates.items()}
        out["tokens_per_char"] = router.ratio.value
    return out


def _where_time_went(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """What tells a policy's losses apart: how far its picks leave the instances' in-flight
    counts apart (`spread_mean`: the largest less the smallest at each pick; `above_least`:
    picks of an instance with more in flight than the least), and the TTFT of requests that
    found most of their prompt cached against those that computed most of it (a cached
    request that still waits long waits for a slot or KV blocks, not for its prefill)."""
    n = len(recs)
    cached = [r["ttft"] * 1000 for r in recs if r["blocks"] and 2 * r["reused"] >= r["blocks"]]
    computed = [r["ttft"] * 1000 for r in recs if r["blocks"] and 2 * r["reused"] < r["blocks"]]
    return {"spread_mean": round(statistics.mean(r["spread"] for r in recs), 2) if n else None,
            "above_least": round(sum(1 for r in recs if r["above_least"] > 0) / n, 3) if n else None,
            "cached_share": round(len(cached) / max(1, len(cached) + len(computed)), 3),
            "cached_ttft_p50_ms": pct(cached, 50), "cached_ttft_p90_ms": pct(cached, 90),
            "computed_ttft_p50_ms": pct(computed, 50), "computed_ttft_p90_ms": pct(computed, 90)}


def _run(args: tuple) -> dict[str, Any]:
    cell, target, seconds, seeds, policy_kw, jitter, index = args
    t0 = time.time()
    r = simulate(cell, target, seconds, seeds, policy_kw, jitter, index)
    r["wall_s"] = round(time.time() - t0, 1)
    return r


class _Inline:
    """ProcessPoolExecutor's map, in this process (--jobs 1)."""

    def __enter__(self) -> "_Inline":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    @staticmethod
    def map(fn, items):
        return map(fn, items)


def plot(result: dict[str, Any], plt: Any) -> Any:
    """Per cell: the engine-aware targets' TTFT p90 and tokens/s over the best of
    least-outstanding and nginx (below / above 1 is better), with issue 24's bounds."""
    rows = result["rows"]
    cells = result["cells"]
    by = {(r["cell"], r["target"]): r for r in rows}
    fig, axes = plt.subplots(2, 1, figsize=(max(12, 0.22 * len(cells)), 8.5), sharex=True)
    xs = range(len(cells))
    looks = {"cost-model": ("tab:green", "o"), "prefix-affinity": ("tab:olive", "x"),
             "round-robin": ("tab:gray", ".")}
    for target in result["targets"]:
        policy, _, workers = target.partition("@")  # a policy as N workers: squares
        if policy not in looks or (cells[0], target) not in by:
            continue
        color, marker = looks[policy][0], "s" if workers else looks[policy][1]
        for ax, key, best in ((axes[0], "ttft_p90_ms", min), (axes[1], "out_tok_s", max)):
            ys = []
            for c in cells:
                base = [by[(c, t)][key] for t in rc.BASELINES if (c, t) in by]
                ys.append(by[(c, target)][key] / best(base) if base and best(base) else float("nan"))
            ax.plot(xs, ys, marker, color=color, label=target, markersize=5)
    bounds = ((axes[0], rc.NO_WORSE_TTFT, rc.HALF_TTFT), (axes[1], rc.NO_WORSE_TOK_S, rc.GAIN_TOK_S))
    for ax, no_worse, goal in bounds:
        ax.axhline(no_worse, color="k", lw=0.6, ls="--")
        ax.axhline(goal, color="k", lw=0.6, ls=":")
        ax.grid(True, alpha=0.3)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("TTFT p90 / best baseline")
    axes[1].set_ylabel("tokens/s / best baseline")
    axes[0].legend(fontsize=8)
    axes[1].set_xticks(list(xs))
    axes[1].set_xticklabels(cells, rotation=90, fontsize=6)
    fig.suptitle(f"routing_sim: issue 24's matrix in virtual time ({result['seconds']:g} s x {len(result['seeds'])} "
                 "seeds per cell and target); baseline = best of least-outstanding and nginx least_conn; dashed: "
                 "no worse than 3%, dotted: TTFT 0.5x / tokens 1.3x", fontsize=9)
    fig.tight_layout()
    return fig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--shapes", default="8,64")
    ap.add_argument("--rooms", default="1.5,4")
    ap.add_argument("--workloads", default=",".join(rc.WORKLOADS))
    ap.add_argument("--loads", default="r0,r1,r2,closed")
    ap.add_argument("--targets", default=",".join(rc.TARGETS))
    ap.add_argument("--seeds", default="1", help="one run per seed, requests pooled")
    ap.add_argument("--jobs", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    ap.add_argument("--policy-kw", default="{}", help="JSON keyword arguments for the engine-aware policies")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--decision-cost", default="2,4,8,16",
                    help="instance counts to bench the cost-model's decision at ('' to skip)")
    ap.add_argument("--index", choices=("shared", "local"), default="shared",
                    help="the prefix index of the prompt-aware policies: the data-plane workers' shared one (as "
                         "the product runs) or an in-process PrefixIndex")
    ap.add_argument("--jitter", type=float, default=0.0,
                    help="sigma of a lognormal factor on each iteration's time (0: the twin's exact time)")
    ap.add_argument("--reuse", help="an earlier run's JSON: its rows for the targets not in --rerun are taken "
                    "as they are (same --seconds and --seeds)")
    ap.add_argument("--rerun", default="cost-model", help="with --reuse: the targets simulated again")
    ap.add_argument("--out", type=Path,
                    help="write the result (JSON, PNG) into this directory instead of bench/results")
    a = ap.parse_args()
    cs = rc.cells(tuple(int(x) for x in a.shapes.split(",")), tuple(float(x) for x in a.rooms.split(",")),
                  tuple(a.workloads.split(",")), tuple(a.loads.split(",")))
    targets = a.targets.split(",")
    kw = json.loads(a.policy_kw)
    seeds = tuple(int(x) for x in a.seeds.split(","))
    reuse: dict[tuple[str, str], dict[str, Any]] = {}
    if a.reuse:
        # Rows of an earlier run at the same seconds and seeds (the baselines do not change when
        # the cost model does): only the targets named in --rerun are simulated again.
        with open(a.reuse) as f:
            old = json.load(f)
        if (old.get("seconds"), tuple(old.get("seeds", ())), old.get("jitter", 0.0)) != (a.seconds, seeds, a.jitter):
            raise SystemExit(f"--reuse {a.reuse}: another --seconds, --seeds or --jitter")
        rerun = set(a.rerun.split(","))
        reuse = {(r["cell"], r["target"]): r for r in old["rows"] if r["target"] not in rerun}
        if old.get("index", "local") != a.index and any(t in POLICIES and "index" in inspect.signature(
                POLICIES[t]).parameters for _, t in reuse):
            raise SystemExit(f"--reuse {a.reuse}: another --index, and a reused target takes one (--rerun it)")
    jobs = [(c, t, a.seconds, seeds, kw if t.startswith(("cost-model", "prefix-affinity", "kv-aware")) else None,
             a.jitter, a.index) for c in cs for t in targets if (c.name, t) not in reuse]
    t0 = time.time()
    done: dict[tuple[str, str], dict[str, Any]] = {}
    with ProcessPoolExecutor(a.jobs) if a.jobs > 1 else _Inline() as pool:
        for k, r in enumerate(pool.map(_run, jobs), 1):
            done[(r["cell"], r["target"])] = r
            print(f"[{k}/{len(jobs)} {time.time() - t0:.0f} s] {r['cell']} {r['target']}: TTFT p90 "
                  f"{r['ttft_p90_ms']} ms, {r['out_tok_s']} tok/s ({r['wall_s']} s)", file=sys.stderr, flush=True)
    rows = [done.get((c.name, t)) or reuse[(c.name, t)] for c in cs for t in targets]
    cols = ["target", "rate", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "out_tok_s", "kv_hit_rate", "share",
            "n", "est_err_p50", "decide_us_p50"]
    for c in cs:
        print(f"\n{c.name}  (KV {c.kv_tokens} tokens, tenants {c.tenants}, "
              f"{'rate ' + str(c.rate()) + ' req/s' if c.rate() else 'closed c' + str(c.concurrency)})")
        cell_rows = [dict(r, share="/".join(f"{x:.2f}" for x in r["share"])) for r in rows if r["cell"] == c.name]
        print(table(cell_rows, cols))
        for r in cell_rows:
            if r["target"] == "cost-model":
                print(f"  cost-model reasons {r['reasons']}  bias {r.get('est_bias_ms')} ms  "
                      f"cached/reused {r.get('cached_est_over_reused')}  ratio {r.get('tokens_per_char')}  "
                      f"rates {r.get('rates')}")
    v = rc.verdicts(rows)
    # The prompt-aware policies' verdicts, each as one policy and as N workers where run (the product's
    # default on 16 cores is `prefix-affinity@4`); the default's as `verdicts`, the others beside it.
    by_policy = {rc.default_policy(): v}
    for t in targets:
        if t.split("@")[0] in (rc.default_policy(), "cost-model") and t not in by_policy:
            by_policy[t] = rc.verdicts(rows, t)
    others = {rc.verdicts_field(p): pv for p, pv in by_policy.items() if pv is not v}
    for policy, pv in by_policy.items():
        if pv:
            print(f"\nverdicts ({policy} vs best of least-outstanding/nginx; vs nginx):")
            print(table(pv, ["cell", "ttft_p90_vs_best", "tok_s_vs_best", "ttft_p90_vs_nginx", "tok_s_vs_nginx",
                             "no_worse", "ttft_p90_vs_best_ci90", "beyond_noise"]))
            print(f"{policy}: no worse in {sum(r['no_worse'] for r in pv)}/{len(pv)} cells")
    # bench/decision_cost.py's busy tenant case, for the record of this run's machine
    costs = [measure(p, int(n), "tenant", "busy") for p in ("prefix-affinity", "cost-model")
             for n in a.decision_cost.split(",") if n]
    for c in costs:
        print(f"{c['policy']} decision among {c['instances']} instances: {c['us']} us per Balancer.pick "
              f"(+ {c['hints_us']} us to hash the prompt's {c['keys']} chunks)")
    print(f"wall {time.time() - t0:.0f} s")
    for policy, pv in by_policy.items():
        if not pv or not policy.startswith(rc.default_policy()):
            continue
        beyond = [r["cell"] for r in pv if r.get("beyond_noise")]
        print(f"{policy}: misses beyond the seeds' noise (90% interval above {rc.NO_WORSE_TTFT}): "
              f"{len(beyond)} {beyond}")
    for r in rows:
        r.pop(rc.SEED_TTFTS, None)
    result = {"bench": "routing_sim", "seconds": a.seconds, "seeds": seeds, "jitter": a.jitter, "index": a.index,
              "policy_kw": kw, "cells": [c.name for c in cs], "targets": targets, "rows": rows, "verdicts": v,
              **others, "decision_cost": costs, "machine": machine()}
    if reuse:
        result["reused"] = {"from": os.path.basename(a.reuse), "targets": sorted({t for _, t in reuse})}
    if not a.no_write:
        print("wrote", write_result("routing_sim", result, plot, results=a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
