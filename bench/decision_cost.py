"""What one routing decision costs a data-plane worker: issue 24's "under 20 us at 16 instances".

    .venv/bin/python -m bench.decision_cost [--instances 2,4,8,16] [--baseline-tree DIR]

Times `Balancer.pick` as a data-plane worker runs it: the in-flight counts of the workers'
shared table (4 workers' rows in use), the workers' shared prefix index and pending prefill
(cost-model; the other workers' prompt tokens at two thirds of the instances), busy engines whose
snapshots the policies have learnt from (rates, KV counters), prebuilt RouteHints (hashing
the prompt is the proxy's, timed apart as `hints_us`). Per policy (the default
prefix-affinity, cost-model, least-outstanding for scale), per instance count, per prompt
kind, per decision rate (the virtual clock's step between decisions):

    prompts  tenant: 12 tenants' 2048-character system prompts + an 80-character question
             (8 chunk keys, all shared); long: 4 documents of 12k characters + a 4k-character
             unique tail (64 keys, 48 shared)
    rate     busy: 4000 decisions/s (a saturated worker); quiet: 50/s

Median of 5 rounds of 2000 decisions. With `--baseline-tree DIR` (a checkout of an earlier
commit) every configuration also runs on that tree's code, in alternation with this one, so
the two are compared on the same noisy machine minutes apart: `before_us` beside `us`.

Output: a table, bench/results/decision_cost-<stamp>.{json,md,png} (`--out DIR`: there instead).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
POLICIES = ("prefix-affinity", "cost-model", "least-outstanding")
RATES = {"busy": 4000.0, "quiet": 50.0}
PROMPTS = ("tenant", "long")
WORKER_ROWS = 4
ROUNDS = 5
DECISIONS = 2000
# A snapshot reaches a worker after the daemon took it (a scrape, then the feed's hop over a unix
# socket): its time is this much before the worker's clock when the worker's view is told of it.
FEED_DELAY_S = 0.0005


def prompts(kind: str, n: int, rng: random.Random) -> list[str]:
    from bench import routing_cells as rc
    if kind == "tenant":
        heads = rc.tenant_prefixes("cost", 12)
        return [heads[rng.randrange(12)] + f" Question {j}: " + rc.text(rng, 80) for j in range(n)]
    docs = [rc.text(random.Random(f"doc{d}"), 12288)[:12288] for d in range(4)]
    return [docs[rng.randrange(4)] + rc.text(rng, 4096) for _ in range(n)]


def measure(policy_name: str, instances: int, kind: str, rate: str) -> dict[str, Any]:
    """One configuration on the code importable from sys.path."""
    with tempfile.TemporaryDirectory(prefix="decision-cost-") as tmp:
        return _measure(policy_name, instances, kind, rate, Path(tmp))


def _measure(policy_name: str, instances: int, kind: str, rate: str, tmp: Path) -> dict[str, Any]:
    from orchestrator.dataplane.shared_prefix import SharedPrefixIndex
    from orchestrator.dataplane.shared_table import GlobalInflight, SharedTable, WorkerCounts
    from orchestrator.health.engine_state import EngineSnapshot, EngineView
    from orchestrator.routing.backends import Backend
    from orchestrator.routing.balancer import Balancer, SharedRouting
    from orchestrator.routing.llm_policies import RouteHints

    now = [1000.0]
    clock = lambda: now[0]  # noqa: E731
    views = [EngineView() for _ in range(instances)]
    backends = [Backend(str(i), "h", 1, 2, 3, engine=views[i]) for i in range(instances)]
    table = SharedTable.create(tmp / "table")
    if hasattr(table, "use_rows"):  # an older tree sums every row
        table.use_rows(WORKER_ROWS)
    for i in range(instances):  # other workers' requests in flight
        table.add_inflight(i % WORKER_ROWS, i, i % 7)
    index = SharedPrefixIndex.create(tmp / "prefixes", clock=clock)
    shared = SharedRouting(GlobalInflight(table), WorkerCounts(table, 0), index)
    try:  # the workers' pending prefill (cost-model), as a worker has it; an older tree has none
        from orchestrator.dataplane.shared_pending import SharedPending
        from orchestrator.routing.journal import Journal
        pending = SharedPending.create(tmp / "pending")
        for i in range(instances):  # prompt tokens other workers routed and did not see prefilled
            pending.lane(1 + i % (WORKER_ROWS - 1), table.rows).add(str(i), 500.0 * (i % 3))
        lane = pending.lane(0, table.rows)
        routed = tuple(SharedPending.create(tmp / name).lane(0, table.rows)
                       for name in ("routed-blocks", "routed-requests"))
        try:  # and the workers' routed blocks and requests (the write logs), where the tree shares them
            journal = Journal(lane, routed)
        except TypeError:
            journal = Journal(lane)
        shared = shared._replace(journal=journal)
    except ImportError:
        pass
    try:  # the workers' turns among ties (the default), where the tree shares them
        from orchestrator.dataplane.shared_stamps import SharedStamps
        from orchestrator.routing.llm_policies import SharedTurns
        stamps = SharedStamps.create(tmp / "turns")
        for i in range(instances):  # other workers' choices, a while ago
            stamps.put(str(i), now[0] - 1.0 - 0.01 * i)
        shared = shared._replace(turns=SharedTurns(stamps))
    except ImportError:
        pass
    # What the daemon sends with each snapshot (EngineSnapshot.routed, controlplane/workers.py's
    # `_routed`): every worker's count there, as the latest choice over it read it (an older tree
    # has no such field: its snapshots go without).
    turns = getattr(shared, "turns", None)
    sends_routed = "routed" in getattr(EngineSnapshot, "__dataclass_fields__", {})

    def routed(i: int) -> dict[str, int]:
        if not sends_routed:
            return {}
        now_count = table.inflight(i)
        return {"routed": now_count if turns is None else turns.stamps.routed(str(i), now_count)}

    balancer = Balancer(policy_name, rng=random.Random(1), clock=clock, shared=shared)
    policy = balancer._policy
    if hasattr(policy, "_clock"):
        policy._clock = clock
    state = {"k": 0, "ts": 0.0}

    def scrape() -> None:
        """Every engine's next snapshot: 5 iterations of 20 ms since the last, 2000 prompt tokens
        in every other scrape, as a busy engine's; fed to the views as the worker's feed does,
        FEED_DELAY_S after it was taken, with the daemon's count (`routed`)."""
        k = state["k"]
        for i, v in enumerate(views):
            v.update(EngineSnapshot(at=now[0] - FEED_DELAY_S, active=6, max_active=8, scheduled=6, kv_max=256,
                                    kv_used=100, tokens_per_block=64, iteration=float(5 * k + i),
                                    timestamp_us=int(state["ts"] * 1e6), context_tokens=2000 * (k % 2),
                                    finished=3 * k, input_tokens=6300 * k, output_tokens=60 * k, kv_reused=40 * k,
                                    **routed(i)))
        state["ts"] += 0.1 + 0.0001 * 2000 * (k % 2)
        state["k"] = k + 1

    for _ in range(60):
        scrape()
        now[0] += 0.1
    texts = prompts(kind, DECISIONS, random.Random(2))
    hints = [RouteHints.from_prompt(p) for p in texts]
    step = 1.0 / RATES[rate]
    next_scrape = now[0] + 0.1

    def picks() -> float:
        """Seconds spent in Balancer.pick over every hint, the engines scraped every 100 ms of the
        virtual clock in between (not timed: a scrape is not a decision)."""
        nonlocal next_scrape
        spent = 0.0
        clock_ns = time.perf_counter
        for h in hints:
            now[0] += step
            if now[0] >= next_scrape:
                scrape()
                next_scrape += 0.1
            t0 = clock_ns()
            balancer.pick(backends, hints=h)
            spent += clock_ns() - t0
        return spent

    picks()
    if policy_name == "cost-model":  # the choice in seconds (not the cold start's batch count) is what is timed
        assert policy.ratio.source != "prior" and all(policy.book.rates(b.instance_id) for b in backends)
    pick_us, hints_us = [], []
    for _ in range(ROUNDS):
        pick_us.append(picks() / len(hints) * 1e6)
        t0 = time.perf_counter()
        for p in texts:
            RouteHints.from_prompt(p)
        hints_us.append((time.perf_counter() - t0) / len(texts) * 1e6)
    return {"policy": policy_name, "instances": instances, "prompts": kind, "rate": rate,
            "keys": len(hints[0].prompt_keys), "us": round(statistics.median(pick_us), 1),
            "hints_us": round(statistics.median(hints_us), 1), "reason": balancer.last_reason,
            # the prefix index's slots in C (_prefix_slots.c) or in Python (not built; an older tree)
            "compiled": getattr(index, "compiled", False), "cells_compiled": _cells_compiled()}


def _cells_compiled() -> bool:
    """Whether the shared files' column sums and writes run in C (_shared_cells.c; an older tree
    has none)."""
    try:
        from orchestrator.dataplane import shared_cells
    except ImportError:
        return False
    return shared_cells.NATIVE is not None


def child(tree: Path, config: tuple[str, int, str, str]) -> tuple[list[str], dict[str, str]]:
    """The command and environment that print `measure(*config)` as JSON, run on `tree`'s code (this
    file is handed over: an older tree lacks it). The tree goes first on the path, before whatever
    the environment already has there (the wheels carried to the GPU machine)."""
    code = ("import json, sys, runpy; sys.path.insert(0, sys.argv[1]); "
            "m = runpy.run_path(sys.argv[2]); "
            "print(json.dumps(m['measure'](sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6])))")
    path = os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))
    return [sys.executable, "-c", code, str(tree), __file__, *map(str, config)], {**os.environ, "PYTHONPATH": path}


def run_in(tree: Path, config: tuple[str, int, str, str]) -> dict[str, Any]:
    """`measure` in a child process on `tree`'s code (`child`)."""
    cmd, env = child(tree, config)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, cwd=tree).stdout
    return json.loads(out.strip().splitlines()[-1])


def plot(result: dict[str, Any], plt: Any) -> Any:
    rows = result["rows"]
    fig, axes = plt.subplots(1, len(PROMPTS), figsize=(12, 5.5), sharey=True)
    colors = {"prefix-affinity": "tab:olive", "cost-model": "tab:green", "least-outstanding": "tab:gray"}
    for ax, kind in zip(axes, PROMPTS):
        for policy in POLICIES:
            for rate, style in (("busy", "-"), ("quiet", ":")):
                pts = sorted((r["instances"], r["us"], r.get("before_us")) for r in rows
                             if r["policy"] == policy and r["prompts"] == kind and r["rate"] == rate)
                if not pts:
                    continue
                xs = [p[0] for p in pts]
                ax.plot(xs, [p[1] for p in pts], style, marker="o", color=colors[policy], label=f"{policy} {rate}")
                if any(p[2] is not None for p in pts):
                    ax.plot(xs, [p[2] for p in pts], style, marker="x", color=colors[policy], alpha=0.35,
                            label=f"{policy} {rate} (before)")
        ax.axhline(20, color="k", lw=0.6, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("instances")
        ax.set_title(f"{kind} prompts")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("us per Balancer.pick")
    axes[0].set_yscale("log")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=7)
    fig.suptitle("decision cost: a data-plane worker's pick (shared table + shared prefix index); dashed: 20 us",
                 fontsize=9)
    fig.tight_layout(rect=(0, 0.16, 1, 1))
    return fig


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(REPO))
    # here, not at the top: run_in hands this file to an older tree, whose bench.common may lack these
    from bench.common import bench_parser, machine, table, tree_name, write_result_md

    ap = bench_parser(__doc__)
    ap.add_argument("--instances", default="2,4,8,16")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--prompts", default=",".join(PROMPTS))
    ap.add_argument("--rates", default=",".join(RATES))
    ap.add_argument("--baseline-tree", type=Path, help="a checkout of an earlier commit, measured alike")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args(argv)

    rows = []
    for policy in a.policies.split(","):
        for kind in a.prompts.split(","):
            for rate in a.rates.split(","):
                for n in (int(x) for x in a.instances.split(",")):
                    config = (policy, n, kind, rate)
                    row = run_in(REPO, config)
                    if a.baseline_tree is not None:
                        row["before_us"] = run_in(a.baseline_tree.resolve(), config)["us"]
                    print(json.dumps(row), file=sys.stderr)
                    rows.append(row)
    cols = ["policy", "prompts", "rate", "instances", "keys", "us"] + (["before_us"] if a.baseline_tree else []) + \
        ["hints_us", "reason"]
    report = table(rows, cols)
    if a.no_write:
        print(report)
        return 0
    baseline = tree_name(a.baseline_tree) if a.baseline_tree is not None else None
    write_result_md("decision_cost", {"bench": "decision_cost", "rows": rows, "baseline": baseline,
                                      "worker_rows": WORKER_ROWS, "rounds": ROUNDS, "decisions": DECISIONS,
                                      "machine": machine()}, plot, a.out,
                    f"baseline: {baseline or 'none'}; us = median of {ROUNDS} x {DECISIONS} Balancer.pick", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
