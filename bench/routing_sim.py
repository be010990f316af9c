"""Routing policies on the twin's engine in virtual time: routing_bench's workload A, long runs,
parameter sweeps, in seconds and without Triton (issue 11: tuning prefix-affinity's slack).

    .venv/bin/python -m bench.routing_sim [--seconds 120] [--rates 14,22] [--slacks 4,8,12,16]

Two `demo/twin/engine.py` engines (the same code the twin's tritonserver runs: in-flight
batching, paged KV cache with prefix reuse and LRU eviction, per-token prefill cost) advance
in virtual time; the router is the proxy's own policy class (orchestrator/proxy) fed the
proxy's in-flight counts and engine snapshots every 100 ms, as the engine monitor scrapes
them. Requests are routing_bench's workload A (same generator, same parameters), Poisson
arrivals; no network, no proxy CPU, no Triton. What it cannot show: CPU contention, the
100 ms scrape lag's interaction with real timing, anything of NGINX.

Prints, per policy/slack and rate: TTFT p50/p90/p99, output tokens/s, KV hit rate, each
instance's share, and the routing decisions (prefix-overloaded = a spill past the slack).
`--tenants 1` gives the hot-single-prefix case the slack also guards.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import random
import sys
from typing import Any

from bench import routing_bench as rb
from orchestrator.health.engine_state import EngineSnapshot, EngineView
from orchestrator.routing.backends import Backend
from orchestrator.routing.balancer import POLICIES
from orchestrator.routing.llm_policies import PrefixAffinity, RouteHints

sys.path.insert(0, str(rb.DEMO_REPO.parent))
from twin.engine import Engine, EngineConfig, Sequence  # noqa: E402
from twin.tokens import encode  # noqa: E402

SCRAPE_S = 0.1


def simulate(policy: str, rate: float, seconds: float, a: argparse.Namespace, slack: float | None = None,
             seed: int = 1, instances: int = 2, closed: int = 0) -> dict[str, Any]:
    """Workload A at `rate` (open loop); with `closed` > 0 workload B instead, closed loop at
    that concurrency (`rate` unused)."""
    now = [0.0]
    clock = lambda: now[0]  # noqa: E731
    cfg = EngineConfig(max_batch_size=a.slots, max_tokens_in_paged_kv_cache=a.kv_tokens, tokens_per_block=a.block,
                       enable_kv_cache_reuse=True, decode_ms=a.decode_ms, prefill_ms_per_token=a.prefill_ms)
    engines = [Engine(cfg, clock_ns=lambda: int(now[0] * 1e9)) for _ in range(instances)]
    views = [EngineView() for _ in range(instances)]
    backends = [Backend(str(i), "sim", 1, 2, 3, engine=views[i]) for i in range(instances)]
    rng = random.Random(seed)
    if policy == "prefix-affinity":
        router = PrefixAffinity(rng, clock=clock, **({} if slack is None else {"slack": slack}))
    elif policy == "kv-aware":
        router = POLICIES[policy](rng, clock=clock)  # type: ignore[call-arg]
    else:
        router = POLICIES[policy](rng)
    inflight: dict[str, int] = {}
    busy = [False] * instances
    stats: list[Any] = [None] * instances
    heap: list[tuple[float, int, str, Any]] = []
    order = itertools.count()
    if closed:
        reqs = rb.workload_b(f"sim{seed}", a)
        for k in range(closed):
            heapq.heappush(heap, (0.0, next(order), "arrive", k))
        issued = [closed]
    else:
        reqs = rb.workload_a(f"sim{seed}", rate, seconds, a)
        for k, r in enumerate(reqs):
            heapq.heappush(heap, (r.at, next(order), "arrive", k))
    heapq.heappush(heap, (0.0, next(order), "scrape", None))
    recs: dict[int, dict[str, Any]] = {}
    reasons: dict[str, int] = {}
    window_tokens = 0

    def step(i: int) -> None:
        it = engines[i].step()
        busy[i] = True
        heapq.heappush(heap, (now[0] + it.duration_s, next(order), "iteration", (i, it)))

    while heap:
        t, _, kind, data = heapq.heappop(heap)
        now[0] = t
        if kind == "scrape":
            for i in range(instances):
                s = stats[i]
                views[i].update(EngineSnapshot(
                    at=t, active=s.active if s else 0, max_active=a.slots, waiting=s.waiting if s else 0,
                    kv_max=a.kv_tokens // a.block, kv_used=s.kv_used if s else 0, tokens_per_block=a.block,
                    kv_reused=s.kv_reused if s else 0, iteration=float(s.iteration) if s else 0.0))
            if any(h[2] != "scrape" for h in heap):
                heapq.heappush(heap, (t + SCRAPE_S, next(order), "scrape", None))
        elif kind == "arrive":
            req = reqs[data]
            doc = json.loads(req.body)
            b = router.choose(backends, (), inflight, RouteHints.from_prompt(doc["text_input"]))
            reason = getattr(router, "last_reason", "") or policy
            reasons[reason] = reasons.get(reason, 0) + 1
            i = int(b.instance_id)
            inflight[b.instance_id] = inflight.get(b.instance_id, 0) + 1
            recs[data] = {"at": t, "ttft": None, "e2e": None, "instance": i, "blocks": req.prompt_blocks, "reused": 0}
            engines[i].enqueue(Sequence(data, encode(doc["text_input"]), doc["max_tokens"]))
            if not busy[i]:
                step(i)
        else:
            i, it = data
            stats[i] = it.stats
            for ev in it.events:
                rec = recs[ev.seq.req_id]
                if ev.tokens:
                    if rec["ttft"] is None:
                        rec["ttft"] = t - rec["at"]
                        rec["reused"] = ev.seq.reused_blocks
                    if t <= seconds:
                        window_tokens += len(ev.tokens)
                if ev.finished:
                    inflight[str(i)] -= 1
                    rec["e2e"] = t - rec["at"]
                    if closed and t < seconds:
                        heapq.heappush(heap, (t, next(order), "arrive", issued[0]))
                        issued[0] += 1
            busy[i] = False
            if engines[i].has_work() or it.stats.active > 0:
                step(i)
    ttft = [r["ttft"] * 1000 for r in recs.values()]
    e2e = [r["e2e"] * 1000 for r in recs.values()]
    n = len(recs)
    return {"policy": policy if slack is None else f"{policy} slack {slack:g}", "rate": rate, "n": n,
            "ttft_p50_ms": rb.pct(ttft, 50), "ttft_p90_ms": rb.pct(ttft, 90), "ttft_p99_ms": rb.pct(ttft, 99),
            "e2e_p99_ms": rb.pct(e2e, 99), "out_tok_s": round(window_tokens / seconds, 1),
            "kv_hit_rate": round(sum(r["reused"] for r in recs.values()) / max(1, sum(r["blocks"] for r in recs.values())), 3),
            "share": "/".join(f"{sum(1 for r in recs.values() if r['instance'] == i) / n:.2f}" for i in range(instances)),
            "spills": reasons.get("prefix-overloaded", 0)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--rates", default="14,22")
    ap.add_argument("--slacks", default="4,8,12,16", help="prefix-affinity slacks to compare")
    ap.add_argument("--policies", default="least-outstanding,kv-aware")
    ap.add_argument("--tenants", type=int, default=12)
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--b", type=int, default=0, help="workload B, closed loop at this concurrency, instead of A")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--kv-tokens", type=int, default=16384)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--decode-ms", type=float, default=20.0)
    ap.add_argument("--prefill-ms", type=float, default=0.1)
    a = ap.parse_args()
    rows = []
    for rate in [float(x) for x in a.rates.split(",")] if not a.b else [0.0]:
        for p in filter(None, a.policies.split(",")):
            rows.append(simulate(p, rate, a.seconds, a, closed=a.b))
        for s in filter(None, a.slacks.split(",")):
            rows.append(simulate("prefix-affinity", rate, a.seconds, a, slack=float(s), closed=a.b))
    what = (f"workload B (closed loop c{a.b})" if a.b else
            f"workload A: {a.tenants} tenants x {a.prefix_tokens}-token prefixes")
    print(f"{what} in virtual time, {a.seconds:g} s, 2 instances x {a.slots} slots, KV {a.kv_tokens} tokens, "
          f"decode {a.decode_ms:g} ms, prefill {a.prefill_ms:g} ms/token")
    print(rb.table(rows, ["policy", "rate", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "e2e_p99_ms", "out_tok_s",
                          "kv_hit_rate", "share", "spills", "n"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
