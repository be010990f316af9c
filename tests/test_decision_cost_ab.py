"""bench/decision_cost_ab.py: its summary of the rounds, and its answers to bad arguments."""

from __future__ import annotations

import pytest

from bench import decision_cost_ab as ab

pytestmark = pytest.mark.unit


def row(tree, us, policy="prefix-affinity", prompts="tenant", rate="quiet", hints_us=5.0):
    return {"tree": tree, "us": us, "policy": policy, "prompts": prompts, "rate": rate, "hints_us": hints_us}


def test_summary_is_each_trees_median_and_minimum_over_the_rounds():
    rows = [row("before", u, hints_us=h) for u, h in ((30.0, 8.0), (20.0, 7.0), (25.0, 9.0))] + \
        [row("after", u, hints_us=h) for u, h in ((18.0, 3.0), (22.0, 2.0), (40.0, 4.0))]
    rows.append(row("before", 9.0, policy="least-outstanding", rate="busy"))
    rows.append(row("after", 12.0, policy="least-outstanding", rate="busy"))
    summary = {(s["policy"], s["rate"]): s for s in ab.summarise(rows)}
    pa = summary[("prefix-affinity", "quiet")]
    assert (pa["before_median_us"], pa["after_median_us"], pa["before_min_us"], pa["after_min_us"]) == \
        (25.0, 22.0, 20.0, 18.0)
    assert pa["after_over_before"] == round(22.0 / 25.0, 3)
    assert (pa["before_hints_us"], pa["after_hints_us"]) == (8.0, 3.0)  # the hashing's medians beside
    assert summary[("least-outstanding", "busy")]["after_over_before"] == round(12.0 / 9.0, 3)
    assert len(summary) == 2  # configurations not measured are left out


@pytest.mark.parametrize("args, field", [(["--rounds", "0"], "--rounds=0"), (["--cores", "1,x"], "--cores='1,x'")])
def test_bad_arguments_name_the_field_and_value(args, field, capsys, tmp_path):
    (tmp_path / "orchestrator").mkdir()
    with pytest.raises(SystemExit) as exc:
        ab.main(["--baseline-tree", str(tmp_path), *args])
    assert exc.value.code == 2
    assert field in capsys.readouterr().err


def test_a_baseline_that_is_not_a_checkout_is_refused(capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        ab.main(["--baseline-tree", str(tmp_path / "nowhere")])
    assert exc.value.code == 2
    assert "--baseline-tree=" in capsys.readouterr().err
