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
BENCHES = ("proxy_bench", "failover_bench", "rolling_bench", "startup_bench", "routing_bench", "openai_bench")


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
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
