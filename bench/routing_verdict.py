"""Issue 24's verdicts over routing_sim runs written apart (one run per shape, say, to fit a call).

    .venv/bin/python -m bench.routing_verdict RUN.json [RUN.json ...] [--target prefix-affinity@4] [--out DIR]

Merges the runs' rows (a later file's row for the same cell and target wins) and judges
`--target` (default: the product's default policy as `--proxy-workers auto` runs it on the 16-core
GPU machines, 4 workers: `prefix-affinity@4`; the policy alone where no run has that target) per cell against
the best of least-outstanding and NGINX (routing_cells.verdicts): within 3% in TTFT p90 (all seeds'
requests pooled) and tokens/s; the 90% interval of that ratio over the seeds, and whether a miss is
beyond that noise; against NGINX alone in the tenant cells (uniform, zipf), the "half NGINX's TTFT
p90, 1.3 x its tokens/s" goal.

The interval (`interval` says which): where one run holds a cell's target and both baselines and
judged the target itself, that run's (`pooled`: each resample pools the drawn seeds' requests, as the
goal's ratio does). Else one from the written rows, which keep each seed's p90 and no more (`seeds`:
around the seeds' ratio, `ttft_p90_vs_best_seeds_gm`, each seed weighing alike; where one seed's
queue dominates the pooled p90, it can sit below the pooled ratio).

Output: a table, bench/results/routing_verdict-<stamp>.{json,md,png} (`--no-write`: none).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from bench import routing_cells as rc
from bench.common import table, write_result_md

GPU_MACHINE_CPUS = 16  # the lent GPU machines the routing benchmarks run on


def default_target() -> str:
    """The product's default policy as `--proxy-workers auto` runs it on those machines."""
    from orchestrator.config import Settings
    return f"{rc.default_policy()}@{Settings().worker_count(GPU_MACHINE_CPUS)}"


Verdict = dict[str, Any]


def merged_rows(paths: list[Path]) -> tuple[list[dict[str, Any]], list[int], dict[tuple[str, str], Verdict]]:
    """The runs' rows, a later file's winning on the same (cell, target); the seeds, which must be
    the same in every run (a verdict pairs the targets' seeds); and, per (cell, target), the verdict
    of the run that holds that target's row and both baselines' rows as merged, where it judged the
    target (its interval is over the pooled requests)."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    origin: dict[tuple[str, str], int] = {}  # (cell, target) -> the run its row is from
    judged: dict[tuple[int, str, str], Verdict] = {}  # (run, cell, target) -> that run's verdict
    seeds: list[int] | None = None
    for k, p in enumerate(paths):
        run = json.loads(p.read_text())
        if run.get("bench") != "routing_sim":
            raise SystemExit(f"{p}: bench={run.get('bench')!r}, not a routing_sim run")
        if seeds is not None and run["seeds"] != seeds:
            raise SystemExit(f"{p}: seeds={run['seeds']}, the runs before have {seeds}: seeds pair targets")
        seeds = run["seeds"]
        for r in run["rows"]:
            rows[(r["cell"], r["target"])] = r
            origin[(r["cell"], r["target"])] = k
        for target in run.get("targets") or ():
            for v in run.get(rc.verdicts_field(target)) or ():
                judged[(k, v["cell"], target)] = v
    pooled = {}
    for (cell, target), k in origin.items():
        if all(origin.get((cell, b)) == k for b in rc.BASELINES) and (k, cell, target) in judged:
            pooled[(cell, target)] = judged[(k, cell, target)]
    return list(rows.values()), seeds or [], pooled


def judge(rows: list[dict[str, Any]], target: str,
          pooled: dict[tuple[str, str], Verdict] | None = None) -> dict[str, Any]:
    v = rc.verdicts(rows, target)
    for r in v:
        run = (pooled or {}).get((r["cell"], target))
        if run is not None and "ttft_p90_vs_best_ci90" in run and run["ttft_p90_vs_best"] == r["ttft_p90_vs_best"]:
            r["ttft_p90_vs_best_ci90"], r["beyond_noise"] = run["ttft_p90_vs_best_ci90"], run["beyond_noise"]
            r["interval"] = "pooled"
        elif "ttft_p90_vs_best_ci90" in r:
            r["interval"] = "seeds"
    tenant = [r for r in v if set(r["cell"].split("/")) & set(rc.TENANT_WORKLOADS)]  # s8/room4/<workload>/r1
    for r in tenant:
        r["half_nginx"] = r["ttft_p90_vs_nginx"] <= rc.HALF_TTFT and r["tok_s_vs_nginx"] >= rc.GAIN_TOK_S
    return {"target": target, "cells": v,
            "no_worse": sum(r["no_worse"] for r in v),
            "beyond_noise": [r["cell"] for r in v if r.get("beyond_noise")],
            "tenant_cells": len(tenant),
            "half_nginx_ttft": sum(r["ttft_p90_vs_nginx"] <= rc.HALF_TTFT for r in tenant),
            "half_nginx_ttft_and_tok_s": sum(r["half_nginx"] for r in tenant)}


def report(j: dict[str, Any], seeds: list[int], sources: list[str]) -> str:
    misses = [r for r in j["cells"] if not r["no_worse"]]
    cols = ["cell", "ttft_p90_vs_best", "tok_s_vs_best", "ttft_p90_vs_best_ci90", "interval",
            "ttft_p90_vs_best_seeds_gm", "beyond_noise", "ttft_p90_vs_nginx", "tok_s_vs_nginx"]
    return "\n".join([
        f"{j['target']} against the best of least-outstanding and NGINX, {len(j['cells'])} cells, "
        f"seeds {','.join(map(str, seeds))} (runs: {', '.join(sources)})",
        "",
        f"- within 3% in TTFT p90 and tokens/s: {j['no_worse']} of {len(j['cells'])}",
        f"- misses beyond the seeds' noise (the 90% interval's low end above {rc.NO_WORSE_TTFT}, or tokens/s "
        "short): "
        f"{len(j['beyond_noise'])} {j['beyond_noise']}",
        f"- tenant cells at half NGINX's TTFT p90: {j['half_nginx_ttft']} of {j['tenant_cells']}; "
        f"with tokens/s >= {rc.GAIN_TOK_S} x NGINX's too: {j['half_nginx_ttft_and_tok_s']}",
        "",
        "misses:",
        "",
        table(misses, cols) if misses else "(none)",
        "",
        "every cell:",
        "",
        table(j["cells"], cols)])


def plot(result: dict[str, Any], plt: Any) -> Any:
    cells = result["verdict"]["cells"]
    fig, ax = plt.subplots(figsize=(14, 5.5))
    xs = list(range(len(cells)))
    ys = [r["ttft_p90_vs_best"] for r in cells]
    colors = ["tab:green" if r["no_worse"] else "tab:red" if r.get("beyond_noise") else "tab:orange"
              for r in cells]
    with_ci = [(x, r) for x, r in zip(xs, cells) if "ttft_p90_vs_best_ci90" in r]
    if with_ci:  # the interval, around the pooled point or the seeds' ratio (each seed alike)
        gm = [r["ttft_p90_vs_best"] if r.get("interval") == "pooled" else
              r.get("ttft_p90_vs_best_seeds_gm", sum(r["ttft_p90_vs_best_ci90"]) / 2) for _, r in with_ci]
        lo = [min(g, r["ttft_p90_vs_best_ci90"][0]) for g, (_, r) in zip(gm, with_ci)]
        hi = [max(g, r["ttft_p90_vs_best_ci90"][1]) for g, (_, r) in zip(gm, with_ci)]
        below, above = [g - a for g, a in zip(gm, lo)], [b - g for g, b in zip(gm, hi)]
        ax.errorbar([x for x, _ in with_ci], gm, yerr=[below, above], fmt="_", color="0.55", capsize=2,
                    label="90% interval (around the pooled ratio, or the seeds' geometric mean)")
    ax.scatter(xs, ys, c=colors, s=18, zorder=3, label="all seeds pooled")
    ax.axhline(rc.NO_WORSE_TTFT, color="tab:red", lw=0.8, ls="--", label=f"{rc.NO_WORSE_TTFT} (the goal's bound)")
    ax.axhline(1.0, color="0.5", lw=0.6)
    ax.set_yscale("log")
    ax.set_xticks(list(xs), [r["cell"] for r in cells], rotation=90, fontsize=6)
    ax.set_ylabel("TTFT p90 / best of least-outstanding, NGINX")
    ax.set_title(f"{result['verdict']['target']}: {result['verdict']['no_worse']} of {len(cells)} cells within 3% "
                 f"(green), misses within the seeds' noise (orange), beyond it (red); bars: 90% interval")
    ax.legend(fontsize=8)
    return fig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--target", default=None)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    rows, seeds, pooled = merged_rows(a.runs)
    targets = {r["target"] for r in rows}
    target = a.target
    if target is None:
        target = default_target()
        target = target if target in targets else rc.default_policy()
    if target not in targets:
        print(f"error: --target={target!r}: no run has it (they have {', '.join(sorted(targets))})", file=sys.stderr)
        return 2
    j = judge(rows, target, pooled)
    if not j["cells"]:
        print(f"error: --target={target!r}: no cell has it beside nginx (the runs must hold the baselines too)",
              file=sys.stderr)
        return 2
    sources = [os.path.basename(p) for p in a.runs]
    text = report(j, seeds, sources)
    if a.no_write:
        print(text)
        return 0
    write_result_md("routing_verdict", {"bench": "routing_verdict", "runs": sources, "seeds": seeds, "verdict": j},
                    plot, a.out, "Issue 24's verdicts over routing_sim runs (bench/routing_verdict.py).", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
