"""How long a /metrics scrape stops a data-plane worker's event loop (issue 22).

    .venv/bin/python -m bench.scrape_stall [--workers 1,4,8] [--scrapes 20] [--out DIR]

A worker's scrape renders every worker's Prometheus files (prometheus_client's multiprocess
merge, then the exposition). Rendered on the loop that relays the worker's streams, it stops
every one of them for as long; `ProxyMetrics.render_off_loop` renders on a thread instead.
Per worker count W: W processes fill their files with a busy minute (8 instances, every
family the proxy writes), then one process whose loop turns as fast as it can (uvloop where it
imports, as a worker runs; gc frozen after start-up, as a worker's) scrapes `--scrapes` times
each way, alternating:

    on-loop    `render()` called on the loop (the handler before this change)
    off-loop   `await render_off_loop()` (the handler now)

Reported per way: the render's wall time and the loop's longest stall during it (the longest
gap between two of its turns), medians over the scrapes and the worst; and the longest stall
in as many quiet periods without a scrape (the floor). Output: a table, and
bench/results/scrape_stall-<stamp>.{json,md,png}.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.common import bench_parser, finish, machine, table, use_uvloop, write_result_md  # noqa: E402
# The loop turns as fast as it can (a saturated worker's does: every turn has callbacks), and
# a stall is the longest gap between two turns. (A 0.5 ms sleep is no tick on uvloop: libuv's
# timers count whole milliseconds.)
TICK_S = 0.0

# One worker's busy minute: what its files hold when a scrape comes.
_FILL = r'''
import sys
sys.path.insert(0, sys.argv[1])
from orchestrator.dataplane.metrics import ProxyMetrics
m = ProxyMetrics()
for i in range(8):
    iid = str(i)
    for k in range(200):
        m.count(iid, 200)
        m.routed("prefix-affinity", "prefix", iid)
        t = m.timer("generate")
        t.events(iid, 1)
        t.events(iid, 31)
        m.observe_latency(iid, 0.01)
'''


def measure(scrapes: int) -> dict[str, Any]:
    """In this process (PROMETHEUS_MULTIPROC_DIR already set and filled)."""
    from orchestrator.dataplane.metrics import ProxyMetrics
    metrics = ProxyMetrics()
    body = metrics.render()  # imports and first-use costs out of the timed scrapes
    gc.freeze()  # as a worker does once it is up (dataplane/worker.py)
    out = _run(metrics, scrapes)
    out["bytes"] = len(body)
    out["event_loop"] = "uvloop" if use_uvloop() else "asyncio"
    return out


def _r(x: float) -> float:
    return round(x, 2)


def _run(metrics: Any, scrapes: int) -> dict[str, Any]:
    if use_uvloop():
        import uvloop
        uvloop.install()

    async def run() -> dict[str, Any]:
        stalls: list[float] = []
        running = [True]

        async def ticker() -> None:
            while running[0]:
                t = time.perf_counter()
                await asyncio.sleep(TICK_S)
                stalls.append(time.perf_counter() - t)

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0.2)
        rows: dict[str, dict[str, list[float]]] = {w: {"render_ms": [], "stall_ms": []}
                                                   for w in ("on-loop", "off-loop", "quiet")}
        for i in range(2 * scrapes):
            way = ("on-loop", "off-loop")[i % 2]
            stalls.clear()
            t = time.perf_counter()
            if way == "on-loop":
                metrics.render()
            else:
                await metrics.render_off_loop()
            rows[way]["render_ms"].append((time.perf_counter() - t) * 1000)
            await asyncio.sleep(0)  # the turn the scrape delayed ends
            rows[way]["stall_ms"].append(max(stalls, default=0.0) * 1000)
            stalls.clear()
            await asyncio.sleep(0.02)
            rows["quiet"]["stall_ms"].append(max(stalls, default=0.0) * 1000)
        running[0] = False
        await tick
        if os.environ.get("SCRAPE_STALL_DEBUG"):
            print({w: [round(x, 1) for x in v["stall_ms"]] for w, v in rows.items()}, file=sys.stderr)
        return {way: {"render_ms_p50": _r(statistics.median(v["render_ms"])) if v["render_ms"] else None,
                      "stall_ms_p50": _r(statistics.median(v["stall_ms"])),
                      "stall_ms_max": _r(max(v["stall_ms"]))} for way, v in rows.items()}

    return asyncio.run(run())


def one_count(workers: int, scrapes: int) -> dict[str, Any]:
    """W workers' files in a fresh directory, measured in a fresh process."""
    with tempfile.TemporaryDirectory(prefix="scrape-stall-") as tmp:
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": tmp}
        for _ in range(workers):
            subprocess.run([sys.executable, "-c", _FILL, str(REPO)], env=env, check=True)
        code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from bench.scrape_stall import measure; "
                "print(json.dumps(measure(int(sys.argv[2]))))")
        out = subprocess.run([sys.executable, "-c", code, str(REPO), str(scrapes)], env=env, check=True,
                             capture_output=True, text=True).stdout
        row = json.loads(out.strip().splitlines()[-1])
        row["workers"] = workers
        row["files"] = len(os.listdir(tmp))
        return row


def plot(result: dict[str, Any], plt: Any) -> Any:
    rows = result["rows"]
    xs = [r["workers"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for way, color in (("on-loop", "tab:red"), ("off-loop", "tab:green"), ("quiet", "tab:gray")):
        ax.plot(xs, [r[way]["stall_ms_p50"] for r in rows], marker="o", color=color, label=f"{way}: stall p50")
        ax.plot(xs, [r[way]["stall_ms_max"] for r in rows], marker="x", ls=":", color=color, label=f"{way}: stall max")
    ax.plot(xs, [r["on-loop"]["render_ms_p50"] for r in rows], ls="--", color="k", lw=0.8, label="render p50 (on-loop)")
    return finish(fig, ax, "data-plane workers' files merged", "ms",
                  "the loop's longest stall during a /metrics scrape")


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--workers", default="1,4,8")
    ap.add_argument("--scrapes", type=int, default=20)
    a = ap.parse_args(argv)
    rows = [one_count(int(w), a.scrapes) for w in a.workers.split(",")]
    flat = [{"workers": r["workers"], "files": r["files"], "render_ms": r["on-loop"]["render_ms_p50"],
             "on_loop_stall_p50": r["on-loop"]["stall_ms_p50"], "on_loop_stall_max": r["on-loop"]["stall_ms_max"],
             "off_loop_render_ms": r["off-loop"]["render_ms_p50"],
             "off_loop_stall_p50": r["off-loop"]["stall_ms_p50"], "off_loop_stall_max": r["off-loop"]["stall_ms_max"],
             "quiet_stall_max": r["quiet"]["stall_ms_max"]} for r in rows]
    note = f"ms; {a.scrapes} scrapes each way, alternating; event loop {rows[0]['event_loop']}"
    write_result_md("scrape_stall", {"bench": "scrape_stall", "rows": rows, "scrapes": a.scrapes, "tick_s": TICK_S,
                                     "machine": machine()}, plot, a.out, note, table(flat, list(flat[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
