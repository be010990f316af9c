"""decision_cost, this tree against an earlier one, on many cores at once: a before/after that a
noisy machine cannot tilt.

    .venv/bin/python -m bench.decision_cost_ab --baseline-tree DIR [--rounds 8] [--cores 1,2,3,4]

`decision_cost --baseline-tree` runs before and after one after the other, minutes apart; on a
shared machine their medians moved by 15-50% between neighbouring runs of the same code (the
2-core box of 2026-11-27: prefix-affinity tenant/quiet 23-47 us). Here every configuration runs on
both trees at the same time, each process pinned to a core of its own (`taskset`, where there is
one), the trees' cores swapped every round: what slows the machine slows both alike. Each process
is `decision_cost.measure` (median of its 5 x 2000 picks); per configuration and tree, the median
and minimum over the rounds, and after / before of the medians.

On a machine with one thread per core, `--cores` a few cores apart from the first (the first takes
interrupts and this script). The trees' code runs with `decision_cost.py` of this tree, as
`decision_cost --baseline-tree` does (an older tree may lack it).

Output: a table, bench/results/decision_cost_ab-<stamp>.{json,md,png} (`--out DIR`: there instead).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.decision_cost import child

REPO = Path(__file__).resolve().parent.parent
CONFIGS = (("prefix-affinity", "tenant", "quiet"), ("prefix-affinity", "long", "quiet"),
           ("prefix-affinity", "tenant", "busy"), ("prefix-affinity", "long", "busy"),
           ("cost-model", "tenant", "quiet"), ("cost-model", "tenant", "busy"), ("cost-model", "long", "busy"),
           ("least-outstanding", "tenant", "busy"))


def one_round(trees: dict[str, Path], cores: list[int], instances: int, swap: bool) -> list[dict[str, Any]]:
    """Every configuration on both trees, as many at once as there are cores."""
    order = ("after", "before") if swap else ("before", "after")
    todo = [(tree, cfg) for cfg in CONFIGS for tree in order]
    pin = shutil.which("taskset")
    rows = []
    for start in range(0, len(todo), len(cores)):
        batch = []
        for (tree, (policy, kind, rate)), core in zip(todo[start:start + len(cores)], cores):
            cmd, env = child(trees[tree], (policy, instances, kind, rate))
            if pin:
                cmd = [pin, "-c", str(core), *cmd]
            batch.append((tree, core, subprocess.Popen(cmd, env=env, cwd=trees[tree], stdout=subprocess.PIPE,
                                                       text=True)))
        for tree, core, proc in batch:
            out, _ = proc.communicate()
            if proc.returncode:
                raise SystemExit(f"decision_cost_ab: a measurement on the {tree} tree failed (exit {proc.returncode})")
            row = json.loads(out.strip().splitlines()[-1])
            row.update(tree=tree, core=core)
            print(json.dumps(row), file=sys.stderr)
            rows.append(row)
    return rows


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for policy, kind, rate in CONFIGS:
        mine = [r for r in rows if (r["policy"], r["prompts"], r["rate"]) == (policy, kind, rate)]
        if not mine:
            continue
        row: dict[str, Any] = {"policy": policy, "prompts": kind, "rate": rate}
        for tree in ("before", "after"):
            theirs = [r for r in mine if r["tree"] == tree]
            us = [r["us"] for r in theirs]
            row[f"{tree}_median_us"] = round(statistics.median(us), 1)
            row[f"{tree}_min_us"] = min(us)
            # the proxy's hashing of the prompt, once per request (not part of the decision)
            row[f"{tree}_hints_us"] = round(statistics.median(r["hints_us"] for r in theirs), 1)
        row["after_over_before"] = round(row["after_median_us"] / row["before_median_us"], 3)
        out.append(row)
    return out


def plot(result: dict[str, Any], plt: Any) -> Any:
    from bench.common import bars
    summary = result["summary"]
    fig, ax = plt.subplots(figsize=(12, 5))
    bars(ax, [f"{r['policy']}\n{r['prompts']}/{r['rate']}" for r in summary],
         {"before (median)": [r["before_median_us"] for r in summary],
          "after (median)": [r["after_median_us"] for r in summary]},
         ylabel="us per Balancer.pick", title=f"decision cost at {result['instances']} instances, "
         f"both trees at once on pinned cores, {result['rounds']} rounds; before = {result['baseline']}")
    ax.axhline(20, color="k", lw=0.6, ls="--")
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(REPO))
    from bench.common import bench_parser, machine, table, tree_name, write_result_md

    ap = bench_parser(__doc__)
    ap.add_argument("--baseline-tree", type=Path, required=True, help="a checkout of an earlier commit")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--instances", type=int, default=16)
    ap.add_argument("--cores", default="", help="comma-separated CPUs to pin to (default: all but the first)")
    a = ap.parse_args(argv)
    if a.rounds < 1:
        ap.error(f"--rounds={a.rounds}: must be at least 1")
    if not (a.baseline_tree / "orchestrator").is_dir():
        ap.error(f"--baseline-tree={a.baseline_tree}: not a checkout of this project")
    try:
        cores = [int(c) for c in a.cores.split(",")] if a.cores else list(range(1, max(2, os.cpu_count() or 2)))
    except ValueError:
        ap.error(f"--cores={a.cores!r}: must be comma-separated CPU numbers")
    trees = {"before": a.baseline_tree.resolve(), "after": REPO}
    rows = []
    for k in range(a.rounds):
        for row in one_round(trees, cores, a.instances, swap=bool(k % 2)):
            rows.append({**row, "round": k})
    summary = summarise(rows)
    baseline = tree_name(a.baseline_tree)
    report = table(summary, ["policy", "prompts", "rate", "before_median_us", "after_median_us", "after_over_before",
                             "before_min_us", "after_min_us", "before_hints_us", "after_hints_us"])
    write_result_md("decision_cost_ab", {"bench": "decision_cost_ab", "summary": summary, "rows": rows,
                                         "baseline": baseline, "instances": a.instances, "rounds": a.rounds,
                                         "cores": cores, "machine": machine()}, plot, a.out,
                    f"before = {baseline}, after = this tree; {a.rounds} rounds, both trees at once on cores {cores}, "
                    f"{a.instances} instances; us = decision_cost.measure (median of 5 x 2000 picks)", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
