"""How long a data-plane worker's stats summary stops its loop, once a second (issue 22).

    .venv/bin/python -m bench.summary_stall [--instances 1,8,16] [--rates 375,2000] [--baseline-tree DIR]

Each second a worker sends the daemon its last minute (`RecentLLM.summary(now, histogram=True)`,
worker.py), on the loop that relays every one of its connections: for as long as it runs, none
of them moves. Per instance count and TTFTs a second per instance: a child process fills a
minute at that rate (virtual clock, uniform TTFTs over 10-500 ms: ~80 log buckets), then times
`--summaries` summaries, each half a second into a new second (the one just ended counted, half
of the next under way, as a worker's are). Reported: the median and worst call, ms.

Three codes per configuration, in alternation, on the same machine minutes apart:

    compiled   this tree (its compiled modules where built: _log_buckets.c)
    python     this tree with TRTLLM_ORCH_PURE_PYTHON=1 (an install without a C compiler)
    before     `--baseline-tree DIR`'s (a checkout of an earlier commit), where given

Output: a table, bench/results/summary_stall-<stamp>.{json,md,png} (`--out DIR`: there instead).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SUMMARIES = 12


def measure(instances: int, rate: int, summaries: int) -> dict[str, Any]:
    """In the child: `summaries` summaries of a full minute, timed (ms)."""
    from orchestrator.dataplane.recent import WINDOW_S, RecentLLM

    clock = [0.0]
    recent = RecentLLM(clock=lambda: clock[0])
    rng = random.Random(1)
    start = 1000.0

    def fill(first: float, last: float) -> None:
        """TTFTs taken from `first` to `last` (virtual seconds), `rate` a second per instance."""
        steps = int((last - first) * rate)
        for k in range(steps):
            at = first + k / rate
            for i in range(instances):
                recent.first_token(str(i), rng.uniform(0.01, 0.5), at)

    fill(start, start + WINDOW_S + 0.5)
    recent.summary(start + WINDOW_S + 0.5, histogram=True)  # the minute's seconds counted once
    took = []
    for k in range(summaries):
        now = start + WINDOW_S + 1.5 + k
        fill(now - 1.0, now)
        t0 = time.perf_counter()
        recent.summary(now, histogram=True)
        took.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": round(statistics.median(took), 3), "worst_ms": round(max(took), 3)}


def run_in(tree: Path, instances: int, rate: int, summaries: int, pure: bool = False) -> dict[str, Any]:
    """`measure` in a child process on `tree`'s code (this file handed to it as a script)."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    env.pop("TRTLLM_ORCH_PURE_PYTHON", None)
    if pure:
        env["TRTLLM_ORCH_PURE_PYTHON"] = "1"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(instances), str(rate), str(summaries)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, cwd=tree).stdout
    return json.loads(out.strip().splitlines()[-1])


def plot(result: dict[str, Any], plt: Any) -> Any:
    from bench.common import bars

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    groups = [f"{r['instances']} x {r['rate']}/s" for r in rows]
    series = {code: [r.get(f"{code}_ms") for r in rows] for code in ("before", "python", "compiled")
              if any(r.get(f"{code}_ms") is not None for r in rows)}
    bars(ax, groups, series, ylabel="summary (median ms): the worker's loop stopped",
         title="a worker's stats summary each second, by instances x TTFTs a second each", fmt="{:.2f}")
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        print(json.dumps(measure(*(int(x) for x in argv[1:4]))))
        return 0
    sys.path.insert(0, str(REPO))
    from bench.common import bench_parser, machine, table, tree_name, write_result_md

    ap = bench_parser(__doc__)
    ap.add_argument("--instances", default="1,8,16")
    ap.add_argument("--rates", default="375,2000", help="TTFTs a second per instance")
    ap.add_argument("--summaries", type=int, default=SUMMARIES)
    ap.add_argument("--baseline-tree", type=Path, help="a checkout of an earlier commit, measured alike")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args(argv)

    rows = []
    for n in (int(x) for x in a.instances.split(",")):
        for rate in (int(x) for x in a.rates.split(",")):
            row: dict[str, Any] = {"instances": n, "rate": rate}
            for code, tree, pure in (("compiled", REPO, False), ("python", REPO, True),
                                     ("before", a.baseline_tree, False)):
                if tree is None:
                    continue
                got = run_in(tree.resolve(), n, rate, a.summaries, pure)
                row[f"{code}_ms"], row[f"{code}_worst_ms"] = got["median_ms"], got["worst_ms"]
            print(json.dumps(row), file=sys.stderr)
            rows.append(row)
    cols = ["instances", "rate"] + [c for c in ("compiled_ms", "compiled_worst_ms", "python_ms", "python_worst_ms",
                                                "before_ms", "before_worst_ms") if c in rows[0]]
    report = table(rows, cols)
    if a.no_write:
        print(report)
        return 0
    baseline = tree_name(a.baseline_tree) if a.baseline_tree is not None else None
    write_result_md("summary_stall", {"bench": "summary_stall", "rows": rows, "baseline": baseline,
                                      "summaries": a.summaries, "machine": machine()}, plot, a.out,
                    f"baseline: {baseline or 'none'}; ms = median (worst) of {a.summaries} summaries a second "
                    "apart, each of a full minute", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
