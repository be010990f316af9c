"""bench/summary_stall.py: its children measure the tree they are pointed at, and a baseline is named."""

from __future__ import annotations

import pytest

from bench import summary_stall
from bench.common import tree_name


@pytest.mark.process  # each code's child process
def test_each_code_is_measured_in_its_own_child(capsys):
    """Compiled and pure Python both run (a child each) and report a positive time per summary."""
    assert summary_stall.main(["--no-write", "--instances", "2", "--rates", "50", "--summaries", "2"]) == 0
    out = capsys.readouterr().out
    row = next(line.split() for line in out.splitlines() if line.startswith("2 "))
    assert row[:2] == ["2", "50"] and all(float(x) > 0 for x in row[2:6])


@pytest.mark.unit
def test_an_exported_baseline_is_named_by_its_folder(tmp_path):
    """A tree exported without .git (git archive, as carried to the GPU machine) is its folder's
    name, not the enclosing repository's commit."""
    exported = tmp_path / "3b08e2d"
    exported.mkdir()
    assert tree_name(exported) == "3b08e2d"
