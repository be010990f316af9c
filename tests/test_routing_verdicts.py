"""The routing matrix's verdicts (bench/routing_cells.verdicts): the default against the best of
least-outstanding and NGINX, and how far the seeds' spread alone moves that ratio."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from bench import routing_cells as rc

pytestmark = pytest.mark.unit


def _row(target: str, seeds: list[list[float]], tok_s: float = 100.0) -> dict:
    pooled = sorted(x for s in seeds for x in s)
    return {"cell": "c", "target": target, "ttft_p90_ms": rc.pct(pooled, 90), "out_tok_s": tok_s,
            rc.SEED_TTFTS: seeds}


def _seeds(rng: random.Random, scale: float, k: int = 6, n: int = 300) -> list[list[float]]:
    # each seed its own load level (another arrival sequence), as the simulator's seeds are
    return [[rng.expovariate(1.0) * 100 * scale * (1 + 0.4 * (i % 3)) for _ in range(n)] for i in range(k)]


def test_a_default_alike_the_baselines_is_no_worse_and_its_interval_holds_one():
    same = _seeds(random.Random(1), 1.0)
    rows = [_row("prefix-affinity", same), _row("least-outstanding", same), _row("nginx", same)]
    (v,) = rc.verdicts(rows, "prefix-affinity")
    assert v["no_worse"] and v["ttft_p90_vs_best"] == 1.0
    lo, hi = v["ttft_p90_vs_best_ci90"]
    assert lo <= 1.0 <= hi and not v["beyond_noise"]


def test_a_default_slower_on_every_seed_is_a_miss_beyond_the_noise():
    base = _seeds(random.Random(2), 1.0)
    slow = [[x * 1.5 for x in s] for s in base]
    rows = [_row("prefix-affinity", slow), _row("least-outstanding", base),
            _row("nginx", _seeds(random.Random(3), 1.1))]
    (v,) = rc.verdicts(rows, "prefix-affinity")
    assert not v["no_worse"] and v["ttft_p90_vs_best_ci90"][0] > 1.03 and v["beyond_noise"]


def test_a_miss_carried_by_one_seed_is_within_the_noise():
    base = _seeds(random.Random(4), 1.0)
    # one seed's run went badly (its tail three times longer), the other five as the baselines'
    lucky = [s if i else [x * 3 for x in s] for i, s in enumerate(base)]
    rows = [_row("prefix-affinity", lucky), _row("least-outstanding", base), _row("nginx", base)]
    (v,) = rc.verdicts(rows, "prefix-affinity")
    assert not v["no_worse"] and v["ttft_p90_vs_best_ci90"][0] <= 1.03 and not v["beyond_noise"]


def test_rows_without_seeds_get_the_verdict_alone():
    rows = [{"cell": "c", "target": t, "ttft_p90_ms": 100.0, "out_tok_s": 10.0}
            for t in ("prefix-affinity", "least-outstanding", "nginx")]
    (v,) = rc.verdicts(rows, "prefix-affinity")
    assert v["no_worse"] and "ttft_p90_vs_best_ci90" not in v and "beyond_noise" not in v


def _written(target: str, seeds: list[list[float]]) -> dict:
    """A row as a written run keeps it: each seed's p90, not its TTFTs."""
    row = _row(target, seeds)
    row[rc.SEED_P90S] = [rc.pct(sorted(s), 90) for s in row.pop(rc.SEED_TTFTS)]
    return row


def test_written_rows_get_an_interval_from_their_seeds_p90s():
    base = _seeds(random.Random(5), 1.0)
    slow = [[x * 1.5 for x in s] for s in base]
    (alike,) = rc.verdicts([_written(t, base) for t in ("prefix-affinity", "least-outstanding", "nginx")],
                           "prefix-affinity")
    lo, hi = alike["ttft_p90_vs_best_ci90"]
    assert lo <= 1.0 <= hi and alike["no_worse"]
    (slower,) = rc.verdicts([_written("prefix-affinity", slow), _written("least-outstanding", base),
                             _written("nginx", base)], "prefix-affinity")
    assert slower["ttft_p90_vs_best_ci90"][0] > 1.03 and slower["beyond_noise"]
    lucky = [s if i else [x * 3 for x in s] for i, s in enumerate(base)]
    (one_bad_seed,) = rc.verdicts([_written("prefix-affinity", lucky), _written("least-outstanding", base),
                                   _written("nginx", base)], "prefix-affinity")
    assert not one_bad_seed["no_worse"] and not one_bad_seed["beyond_noise"]


def _run(tmp_path, name: str, rows: list[dict], seeds: list[int]) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps({"bench": "routing_sim", "seeds": seeds, "rows": rows}))
    return path


def test_runs_written_apart_are_judged_together_the_later_row_winning(tmp_path, capsys):
    from bench import routing_verdict
    base = _seeds(random.Random(6), 1.0)
    slow = [[x * 1.5 for x in s] for s in base]
    first = _run(tmp_path, "a.json", [_written(t, slow if t == "prefix-affinity@4" else base)
                                      for t in ("prefix-affinity@4", "least-outstanding", "nginx")], [1, 2])
    again = _run(tmp_path, "b.json", [_written("prefix-affinity@4", base)], [1, 2])
    rows, seeds, _ = routing_verdict.merged_rows([first, again])
    j = routing_verdict.judge(rows, "prefix-affinity@4")
    assert seeds == [1, 2] and j["no_worse"] == 1 and not j["beyond_noise"]
    assert routing_verdict.judge(routing_verdict.merged_rows([first])[0], "prefix-affinity@4")["beyond_noise"] == ["c"]
    assert routing_verdict.main([str(first), "--target", "cost-model", "--no-write"]) == 2
    assert "--target='cost-model'" in capsys.readouterr().err
    assert routing_verdict.main([str(again), "--no-write"]) == 2  # the target without its baselines
    assert "beside nginx" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="seeds"):
        routing_verdict.merged_rows([first, _run(tmp_path, "c.json", [], [3])])


def test_a_cell_whose_target_and_baselines_one_run_judged_gets_that_runs_pooled_interval(tmp_path):
    # One seed's queue carries the pooled p90 (seed 0's TTFTs 3 x). An interval around the seeds'
    # geometric mean (each seed alike) can lie wholly below the pooled ratio the goal reads
    # (s64/room1.5/mixed/r2 with 16 seeds: 1.047 pooled, [0.969, 1.042]); the run that had the
    # TTFTs judged the pooled requests.
    from bench import routing_verdict
    base = _seeds(random.Random(7), 1.0)
    lucky = [s if i else [x * 3 for x in s] for i, s in enumerate(base)]
    with_ttfts = [_row("prefix-affinity@4", lucky), _row("least-outstanding", base), _row("nginx", base)]
    (run_verdict,) = rc.verdicts(with_ttfts, "prefix-affinity@4")
    written = [_written("prefix-affinity@4", lucky), _written("least-outstanding", base), _written("nginx", base)]
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"bench": "routing_sim", "seeds": list(range(6)), "targets": [
        "prefix-affinity@4", "least-outstanding", "nginx"], "rows": written,
        rc.verdicts_field("prefix-affinity@4"): [run_verdict]}))
    rows, _, pooled = routing_verdict.merged_rows([path])
    (cell,) = routing_verdict.judge(rows, "prefix-affinity@4", pooled)["cells"]
    assert cell["interval"] == "pooled" and cell["ttft_p90_vs_best_ci90"] == run_verdict["ttft_p90_vs_best_ci90"]
    lo, hi = cell["ttft_p90_vs_best_ci90"]
    assert lo <= cell["ttft_p90_vs_best"] <= hi
    (seeds_only,) = routing_verdict.judge(rows, "prefix-affinity@4")["cells"]  # no run's verdict to reuse
    assert seeds_only["interval"] == "seeds" and \
        seeds_only["ttft_p90_vs_best_ci90"] != run_verdict["ttft_p90_vs_best_ci90"]
    # the target rerun in a later file: its baselines are another run's, so the seeds' interval again
    rerun = _run(tmp_path, "rerun.json", [_written("prefix-affinity@4", lucky)], list(range(6)))
    rows, _, pooled = routing_verdict.merged_rows([path, rerun])
    assert pooled == {} and routing_verdict.judge(rows, "prefix-affinity@4", pooled)["cells"][0]["interval"] == "seeds"
