"""Startup: time from `up` to all READY for 1 instance alone vs 2 instances (issue 2).

Instances start in parallel, so 2 x TP2 should take about as long as 1 x TP2, not
twice as long. Measured from the daemon's own log: its "daemon pid=..." line (after
arg parsing, planning and binding the endpoint) to the last "STARTING -> READY",
plus the wall time the CLI took until `status` first said all READY. Rounds
alternate the two layouts; medians are reported and the ratio is taken per round.

    python -m bench.startup_bench [--rounds 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bench.common import med, table, write_result
from tests.harness import Run, log_times, transitions

LAYOUTS = {"1 x TP2": dict(gpus="0-1", tp=2, assume_gpus=2), "2 x TP2": dict(gpus="0-3", tp=2, assume_gpus=4)}


def one(tmp: Path, name: str, layout: dict) -> dict:
    run = Run(tmp / name.replace(" ", ""), **layout)
    run.state_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.monotonic()
        run.start(wait_ready=False)
        run.wait_ready(timeout=120)
        wall = time.monotonic() - t0
        log = run.daemon_log()
        t_daemon = log_times(log, " daemon pid=")[0]
        readies = [t for t, _, old, new, _ in transitions(log) if old == "STARTING" and new == "READY"]
        return {"daemon_to_all_ready_s": round(max(readies) - t_daemon, 3), "cli_wall_s": round(wall, 3)}
    finally:
        run.close()


def plot(result: dict, plt):
    """Every round's time to all READY per layout (daemon's own clock, and the CLI's wall time)."""
    fig, ax = plt.subplots(figsize=(7, 3.4))
    layouts = list(result["samples"])
    for key, marker in (("daemon_to_all_ready_s", "o"), ("cli_wall_s", "x")):
        xs = [i for i, layout in enumerate(layouts) for _ in result["samples"][layout]]
        ys = [s[key] for layout in layouts for s in result["samples"][layout]]
        ax.scatter(xs, ys, marker=marker, label=key.replace("_s", " (s)").replace("_", " "))
    ax.set_xticks(range(len(layouts)))
    ax.set_xticklabels(layouts)
    ax.set_ylabel("s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"startup_bench: to all READY (2 instances / 1: x{result['ratio_2_over_1']:.2f})", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    samples: dict[str, list[dict]] = {k: [] for k in LAYOUTS}
    with tempfile.TemporaryDirectory(prefix="startup-bench-") as tmp:
        for r in range(args.rounds):
            order = list(LAYOUTS) if r % 2 == 0 else list(reversed(LAYOUTS))
            for name in order:
                samples[name].append(one(Path(tmp) / f"r{r}", name, LAYOUTS[name]))
    rows = [{"layout": k, "daemon->all READY s (median)": med([s["daemon_to_all_ready_s"] for s in v]),
             "CLI wall s (median)": med([s["cli_wall_s"] for s in v]),
             "rounds": " ".join(str(s["daemon_to_all_ready_s"]) for s in v)} for k, v in samples.items()]
    ratios = [b["daemon_to_all_ready_s"] / a["daemon_to_all_ready_s"]
              for a, b in zip(samples["1 x TP2"], samples["2 x TP2"])]
    print(table(rows, list(rows[0])))
    print(f"2 instances / 1 instance, median of per-round ratios: {med(ratios):.2f} "
          f"(1.0 = fully parallel, 2.0 = sequential)")
    path = write_result("startup_bench", {"bench": "startup_bench", "samples": samples,
                                          "ratio_2_over_1": med(ratios), "rows": rows}, plot)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
