"""Every benchmark draws its committed results: a PNG next to the JSON (bench/plot.py).

`process`, not `unit`: matplotlib may run fc-list the first time it builds its font cache.
"""

from __future__ import annotations

import shutil

import pytest

from tests.harness import REPO

pytestmark = pytest.mark.process

pytest.importorskip("matplotlib", reason="the `bench` extra (scripts/bootstrap installs it)")

RESULTS = REPO / "bench" / "results"
BENCHES = ("proxy_bench", "failover_bench", "rolling_bench", "startup_bench", "routing_bench", "openai_bench",
           "dataplane_bench", "live_restore_bench", "routing_sim", "accept_spread", "sustained_load", "decision_cost",
           "decision_cost_ab", "summary_stall", "chaos_soak")


@pytest.mark.parametrize("bench", BENCHES)
def test_latest_committed_result_plots(bench, tmp_path):
    from bench.plot import plot_file

    runs = sorted(RESULTS.glob(f"{bench}-*.json"))
    assert runs, f"no committed {bench} result"
    copy = tmp_path / runs[-1].name
    shutil.copy(runs[-1], copy)
    png = plot_file(copy)
    assert png == copy.with_suffix(".png")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000
    from PIL import Image
    with Image.open(png) as image:  # 256 colours: a third of the bytes (bench/common.py)
        assert image.mode == "P"


def test_dataplane_report_reads_runs_before_and_after_the_split_target():
    """Older runs have no `split` rows; the report still renders them, and a run with them shows
    the split design's ratio beside the embedded one."""
    import json

    from bench.dataplane_bench import report

    runs = sorted(RESULTS.glob("dataplane_bench-*.json"))
    with_split = [r for r in runs if "split" in json.loads(r.read_text())["stream"]]
    assert with_split and len(with_split) < len(runs)
    for run in runs:
        text = report(json.loads(run.read_text()))
        assert "## Goals" in text and "| 1 |" in text
    newest = json.loads(with_split[-1].read_text())
    row = next(line for line in report(newest).splitlines() if line.startswith("| 1 |"))
    assert f"{newest['stream_split_ratio']['1']}" in row and f"{newest['stream_ratio']['1']}" in row
