"""Redraw the PNG of committed benchmark results: `python -m bench.plot bench/results/X.json ...`.

Each benchmark module has `plot(result, pyplot) -> figure`; the result's file name
(`<bench>-<stamp>.json`) says which. The PNG lands next to the JSON, as a fresh run
writes it.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

from bench.common import write_plot

BENCHES = ("proxy_bench", "failover_bench", "rolling_bench", "startup_bench", "routing_bench",
           "openai_bench", "dataplane_bench", "routing_sim", "live_restore_bench", "accept_spread",
           "sustained_load", "decision_cost", "decision_cost_ab", "routing_verdict", "summary_stall", "chaos_soak")


def plot_file(path: Path) -> Path | None:
    name = path.name.split("-", 1)[0]
    if name not in BENCHES:
        raise SystemExit(f"{path}: not a result of {', '.join(BENCHES)}")
    module = importlib.import_module(f"bench.{name}")
    return write_plot(path, json.loads(path.read_text()), module.plot)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        return 2
    for arg in argv:
        png = plot_file(Path(arg))
        print(png or f"{arg}: no plot (matplotlib missing)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
