"""How the data-plane workers share their client connections (issue 22: accept_share.py).

    python3 -m bench.accept_spread [--workers 4] [--streams 256,1] [--targets embedded,nginx]
                                   [--label NAME] [--rounds 2] [--out DIR]

dataplane_bench's TTFT client (raw sockets, N keep-alive streams opened at once, 16 events
10 ms apart from sse_source backends), pinned as dataplane_bench pins: each target's workers
on cores 0..W-1. Two seconds in, it counts the established client connections each worker
process holds. Writes <out>/accept_spread-<stamp>.{json,md,png}.

To compare two trees, run it in each with `--label` and `--merge` the JSON files.
Needs nginx and sse_source on PATH (../shared/tools/relay-kit packs them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import psutil  # noqa: E402

from bench import dataplane_bench as db  # noqa: E402
from bench.common import free_port, merged_rows, missing_tools, write_rows  # noqa: E402


def held(pids: list[int], port: int) -> list[int | None]:
    out: list[int | None] = []
    for pid in pids:
        try:
            out.append(sum(1 for c in psutil.Process(pid).net_connections("tcp")
                           if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port))
        except psutil.Error:
            out.append(None)
    return out


def measure(workers: int, streams: list[int], targets: list[str], label: str) -> list[dict[str, Any]]:
    ncpu = len(os.sched_getaffinity(0))
    relay, src_cores, client_cores = db.layout(workers, ncpu)
    rows = []
    with db.Sources(db.SOURCES, 16, 10_000) as sources:
        sources.pin(src_cores)
        for name in targets:
            for n in streams:
                with dict(db.TARGETS)[name](workers, sources.ports, free_port()) as target:
                    for i, pid in enumerate(target.pids()):
                        db.pin(pid, [relay[i % len(relay)]])
                    res: dict[str, Any] = {}

                    def client() -> None:
                        os.sched_setaffinity(0, client_cores)
                        res.update(asyncio.run(db.raw_ttft([target.port], n, 4.0)))

                    th = threading.Thread(target=client)
                    th.start()
                    time.sleep(2.0)
                    spread = held(target.pids(), target.port)
                    th.join()
                    rows.append({"code": label if name == "embedded" else name, "target": name, "workers": workers,
                                 "streams": n, "conns_per_worker": spread, **res})
                    print(json.dumps(rows[-1]), flush=True)
    return rows


def report(result: dict[str, Any]) -> str:
    lines = [f"# accept_spread {result['stamp']}", "", f"Machine: {result['machine']}", "",
             "| code | target | streams | connections per worker | TTFT p50 ms | p90 ms | p99 ms |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['code']} | {r['target']} | {r['streams']} | {r['conns_per_worker']} | {r['p50_ms']} | "
                     f"{r['p90_ms']} | {r['p99_ms']} |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], plt: Any) -> Any:
    """Connections per worker (sorted) at the most streams, one group per row of the run."""
    top = max(r["streams"] for r in result["rows"])
    rows = [r for r in result["rows"] if r["streams"] == top]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, r in enumerate(rows):
        counts = sorted(c or 0 for c in r["conns_per_worker"])
        ax.bar([i + k * 0.2 - 0.3 for k in range(len(counts))], counts, width=0.18)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{r['code']}\n#{i}" for i, r in enumerate(rows)])
    ax.set_ylabel(f"connections per worker (of {top}), sorted")
    ax.set_title("client connections per worker")
    ax2.bar(range(len(rows)), [r["p99_ms"] for r in rows], color="gray")
    ax2.set_xticks(range(len(rows)))
    ax2.set_xticklabels([f"{r['code']}\n#{i}" for i, r in enumerate(rows)])
    ax2.set_ylabel("time to first event p99, ms")
    ax2.set_title(f"{top} streams, 10 ms per event")
    fig.suptitle(f"accept_spread {result['stamp']}: {result['machine']}")
    return fig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--streams", default="256,1")
    ap.add_argument("--targets", default="embedded,nginx")
    ap.add_argument("--label", default="embedded", help="names the embedded rows (the tree measured)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--merge", nargs="+", type=Path, help="JSON files of earlier runs: one result of their rows")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = ap.parse_args(argv)
    if args.merge:
        rows = merged_rows(args.merge)
    else:
        if missing_tools("accept_spread", ("nginx", "sse_source")):
            return 2
        rows = []
        for _ in range(args.rounds):
            rows += measure(args.workers, [int(x) for x in args.streams.split(",")], args.targets.split(","),
                            args.label)
    write_rows("accept_spread", rows, args.out, report, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
