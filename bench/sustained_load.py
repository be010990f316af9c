"""A minute and more of load through one data-plane worker (issue 22): what only a long run shows.

    python3 -m bench.sustained_load [--seconds 70] [--events 1] [--label NAME] [--merge A.json B.json ...]

dataplane_bench's setup (8 sse_source backends, wrk with 256 connections, the product's
WorkerPool with one worker pinned to core 0), held for `--seconds` instead of 5: a worker's
last-minute window (dataplane/recent.py) fills, and whatever it costs per second shows in wrk's
latency. Writes <out>/sustained_load-<stamp>.{json,md,png}. To compare two trees, run it in
each with `--label` and `--merge` the JSON files.

Needs wrk and sse_source on PATH (../shared/tools/relay-kit packs them).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import dataplane_bench as db  # noqa: E402
from bench.common import free_port, merged_rows, missing_tools, write_rows  # noqa: E402

KEYS = ("rps", "events_per_s", "p50_ms", "p99_ms", "failed")


def measure(seconds: float, events: int, label: str) -> dict[str, Any]:
    cores = db.layout(1, len(os.sched_getaffinity(0)))
    with db.Sources(db.SOURCES, events, 0) as sources:
        sources.pin(cores[1])
        with db.Embedded(1, sources.ports, free_port()) as target:
            r = db.measure(target, cores, sources, seconds, events)
    return {"code": label, "seconds": seconds, "events": events, **{k: r.get(k) for k in KEYS}}


def report(result: dict[str, Any]) -> str:
    lines = [f"# sustained_load {result['stamp']}", "", f"Machine: {result['machine']}", "",
             "| code | seconds | events per answer | req/s | p50 ms | p99 ms | failed |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['code']} | {r['seconds']:g} | {r['events']} | {r['rps']} | {r['p50_ms']} | {r['p99_ms']} | "
                     f"{r['failed']} |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], plt: Any) -> Any:
    rows = result["rows"]
    names = [f"{r['code']}\n{r['seconds']:g} s" for r in rows]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax.bar(names, [r["rps"] for r in rows], color="tab:blue")
    ax.set_ylabel("answers/s (one worker)")
    ax2.bar(names, [r["p99_ms"] for r in rows], color="tab:red", label="p99")
    ax2.bar(names, [r["p50_ms"] for r in rows], color="tab:gray", label="p50")
    ax2.set_ylabel("wrk latency, ms")
    ax2.legend()
    fig.suptitle(f"sustained_load {result['stamp']}: {result['machine']}")
    return fig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=70.0)
    ap.add_argument("--events", type=int, default=1, help="events per answer (1: tiny answers)")
    ap.add_argument("--label", default="embedded")
    ap.add_argument("--merge", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = ap.parse_args(argv)
    if args.merge:
        rows = merged_rows(args.merge)
    else:
        if missing_tools("sustained_load", ("wrk", "sse_source")):
            return 2
        rows = [measure(args.seconds, args.events, args.label)]
    write_rows("sustained_load", rows, args.out, report, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
