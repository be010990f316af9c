"""How much slower Python code runs after the process did something else for a while.

    .venv/bin/python -m bench.cold_path [--gaps-ms 0.1,1,3,10,30] [--repeats 60] [--out DIR]

Why (issue 22's added TTFT at one stream): a data-plane worker relaying one stream with
10 ms between events runs its request path once per stream, after 10-160 ms of other work
or sleep, and that path measured several times its warm cost (bench/README.md). This
times three small pieces of the path's kind, each on its own:

    sum        sum(range(200)): the interpreter's loop, no allocation
    json       json.loads of the bench's request body
    prompt     routing.prompt.prompt_of_json of the same body (what the proxy runs per request)

warm (back to back), and once after each gap, the gap spent two ways: spinning on the
clock in Python (the core stays busy, this process's code stays in use) or asleep (the core
may idle or run another task). Medians over `--repeats`. The ratio to warm is the machine's
and the interpreter's, not the proxy's: the same code and gaps on another host can differ
by an order of magnitude.

Output: a table, bench/results/cold_path-<stamp>.{json,md,png}.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.common import bench_parser, finish, machine, table, write_result_md  # noqa: E402


def pieces() -> dict[str, Callable[[], Any]]:
    from bench.dataplane_bench import BODY
    from orchestrator.routing.prompt import prompt_of_json
    return {"sum": lambda: sum(range(200)), "json": lambda: json.loads(BODY),
            "prompt": lambda: prompt_of_json(BODY)}


def measure(gaps_s: list[float], repeats: int) -> list[dict[str, Any]]:
    clock = time.perf_counter
    rows = []
    for name, piece in pieces().items():
        def once() -> float:
            t = clock()
            piece()
            return (clock() - t) * 1e6

        for _ in range(3000):  # warm: specialised, cached, allocated
            once()
        row: dict[str, Any] = {"piece": name, "warm_us": round(statistics.median(once() for _ in range(500)), 2)}
        for gap in gaps_s:
            spun, slept = [], []
            for _ in range(repeats):
                end = clock() + gap
                while clock() < end:
                    pass
                spun.append(once())
                time.sleep(gap)
                slept.append(once())
            key = f"{gap * 1000:g}ms"
            row[f"spin_{key}_us"] = round(statistics.median(spun), 2)
            row[f"sleep_{key}_us"] = round(statistics.median(slept), 2)
        rows.append(row)
    return rows


def plot(result: dict[str, Any], plt: Any) -> Any:
    gaps = result["gaps_ms"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row, color in zip(result["rows"], ("tab:blue", "tab:orange", "tab:green")):
        warm = row["warm_us"]
        ax.plot(gaps, [row[f"spin_{g:g}ms_us"] / warm for g in gaps], marker="o", color=color,
                label=f"{row['piece']}: after spinning")
        ax.plot(gaps, [row[f"sleep_{g:g}ms_us"] / warm for g in gaps], marker="x", ls=":", color=color,
                label=f"{row['piece']}: after sleeping")
    ax.set_xscale("log")
    ax.set_yscale("log")
    return finish(fig, ax, "time spent on something else first (ms)", "x its warm time",
                  f"Python code after a gap ({result['machine']['cpus']} cores)")


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--gaps-ms", default="0.1,1,3,10,30")
    ap.add_argument("--repeats", type=int, default=60)
    a = ap.parse_args(argv)
    gaps_ms = [float(g) for g in a.gaps_ms.split(",")]
    rows = measure([g / 1000 for g in gaps_ms], a.repeats)
    write_result_md("cold_path", {"bench": "cold_path", "gaps_ms": gaps_ms, "repeats": a.repeats, "rows": rows,
                                  "machine": machine()}, plot, a.out,
                    f"us, median of {a.repeats}; Python {sys.version.split()[0]}", table(rows, list(rows[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
