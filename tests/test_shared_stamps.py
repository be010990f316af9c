"""The workers' turns file (dataplane/shared_stamps.py): one stamp per instance, any worker."""

from __future__ import annotations

import stat

import pytest

from orchestrator.dataplane.shared_pending import SharedPending
from orchestrator.dataplane.shared_stamps import SharedStamps
from orchestrator.dataplane.shared_table import TableError

pytestmark = pytest.mark.unit


def test_a_stamp_put_by_one_worker_is_read_by_another(tmp_path):
    a = SharedStamps.create(tmp_path / "turns")
    b = SharedStamps.open(tmp_path / "turns")
    assert stat.S_IMODE((tmp_path / "turns").stat().st_mode) == 0o600
    assert b.of(["3", "0", "7"]) == [0.0, 0.0, 0.0]  # never chosen
    a.put("7", 12.5)
    b.put("0", 11.0)
    b.put("7", 13.0)  # the last writer's stamp stands
    assert a.of(["3", "0", "7"]) == [0.0, 11.0, 13.0]
    assert a.of(["255"]) == [0.0]  # the last column is in the file
    # the counts row, apart from the stamps
    assert a.count("7") == 0
    b.note_count("7", 5)
    a.note_count("255", 2)
    assert (a.count("7"), b.count("255"), a.of(["7"])) == (5, 2, [13.0])
    for f in (a, b):
        f.close()


def test_a_file_of_another_layout_is_refused_by_name(tmp_path):
    SharedPending.create(tmp_path / "pending").close()
    with pytest.raises(TableError, match="turns file"):
        SharedStamps.open(tmp_path / "pending")
    with pytest.raises(TableError, match="cannot open the turns file"):
        SharedStamps.open(tmp_path / "missing")
    with pytest.raises(TableError, match="'256'"):
        SharedStamps.create(tmp_path / "turns").put("256", 1.0)
