"""The data plane's compiled column sums and cell writes (dataplane/_shared_cells.c) against the
Python they stand in for: the in-flight counts a routing decision reads (shared_table.py), the
other workers' pending prefill (shared_pending.py) and the counts a choice notes in the turns
file (shared_stamps.py). Each is run both ways on the same file, with random contents, rows in
use and ready sets; the answers must be equal, and the written files the same bytes."""

from __future__ import annotations

import mmap
import random

import pytest

from orchestrator.dataplane import shared_cells
from orchestrator.dataplane.shared_pending import SharedPending
from orchestrator.dataplane.shared_stamps import SharedStamps
from orchestrator.dataplane.shared_table import MAX_INSTANCES, GlobalInflight, SharedTable
from orchestrator.routing.backends import Backend
from orchestrator.routing.journal import WriteLog

pytestmark = pytest.mark.unit


@pytest.fixture
def native():
    module = shared_cells.NATIVE
    assert module is not None, "orchestrator/dataplane/_shared_cells.c is not built (scripts/bootstrap builds it)"
    return module


def both(monkeypatch, native, call):
    """`call()` with the compiled cells, then with the Python ones."""
    compiled = call()
    monkeypatch.setattr(shared_cells, "NATIVE", None)
    python = call()
    monkeypatch.setattr(shared_cells, "NATIVE", native)
    return compiled, python


def ready_set(rng: random.Random) -> list[Backend]:
    """Instances in order (the usual ready set), or a few out of order with gaps and an id
    the files have no column for."""
    if rng.random() < 0.5:
        first = rng.randrange(0, 8)
        ids = [str(i) for i in range(first, first + rng.randrange(1, 17))]
    else:
        ids = [str(i) for i in rng.sample(range(40), rng.randrange(1, 9))] + ["not-an-index"]
    return [Backend(iid, "h", 1, 2, 3) for iid in ids]


@pytest.mark.parametrize("seed", range(4))
def test_in_flight_counts_read_alike(tmp_path, monkeypatch, native, seed):
    rng = random.Random(seed)
    table = SharedTable.create(tmp_path / "table")
    checked = 0
    for _ in range(60):
        table.use_rows(rng.randrange(1, 9))
        for _ in range(30):
            table.add_inflight(rng.randrange(0, 8), rng.randrange(0, 40), rng.randrange(-3, 9))
        first = rng.randrange(0, 20)
        end = first + rng.randrange(0, 17)
        keys = [f"k{i}" for i in range(first, end)]
        spans = both(monkeypatch, native, lambda: (table.inflight_span(first, end),
                                                   table.inflight_span(first, end, keys)))
        assert spans[0] == spans[1]
        backends = ready_set(rng)
        counts = both(monkeypatch, native, lambda: GlobalInflight(table).of(backends))
        assert counts[0] == counts[1]
        checked += sum(1 for n in counts[0].values() if n)
    assert checked > 100  # not a table of zeros


@pytest.mark.parametrize("seed", range(4))
def test_the_other_workers_pending_prefill_reads_alike(tmp_path, monkeypatch, native, seed):
    rng = random.Random(seed)
    rows = [1]
    pending = SharedPending.create(tmp_path / "pending")
    lanes = [pending.lane(w, lambda: rows[0]) for w in range(8)]
    nonzero = 0
    for _ in range(80):
        rows[0] = rng.randrange(1, 9)
        for _ in range(10):  # fractions and cancelling changes: the sums' order shows in their bits
            lanes[rng.randrange(0, 8)].add(str(rng.randrange(0, 40)), rng.choice([0.1, 1e9, -0.0, -7.3, 512.0, 1e-9]))
        backends = ready_set(rng)
        reader = rng.choice(lanes)
        found = both(monkeypatch, native, lambda: reader.of(backends))
        assert found[0] == found[1]
        assert [repr(v) for v in found[0].values()] == [repr(v) for v in found[1].values()]
        nonzero += bool(found[0])
    assert nonzero > 20


@pytest.mark.parametrize("seed", range(4))
def test_the_counts_a_choice_read_are_written_alike(tmp_path, monkeypatch, native, seed):
    rng = random.Random(seed)
    compiled, python = SharedStamps.create(tmp_path / "compiled"), SharedStamps.create(tmp_path / "python")
    for _ in range(50):
        counts = {str(i): rng.randrange(0, 300) for i in rng.sample(range(MAX_INSTANCES), rng.randrange(1, 17))}
        compiled.note_counts(counts)  # ids new to the file's cells among them, every so often
        monkeypatch.setattr(shared_cells, "NATIVE", None)
        python.note_counts(counts)
        monkeypatch.setattr(shared_cells, "NATIVE", native)
        assert bytes(compiled._mm) == bytes(python._mm)
        assert all(compiled.count(iid) == n for iid, n in counts.items())


@pytest.mark.parametrize("seed", range(4))
def test_the_stamps_of_tied_instances_read_alike(tmp_path, monkeypatch, native, seed):
    rng = random.Random(seed)
    stamps = SharedStamps.create(tmp_path / "turns")
    for step in range(60):
        stamps.put(str(rng.randrange(0, 40)), 1000.0 + step + rng.random())
        tied = [str(i) for i in rng.sample(range(48), rng.randrange(1, 17))]  # some never stamped or seen
        read = both(monkeypatch, native, lambda: stamps.of(tied))
        assert read[0] == read[1] and len(read[0]) == len(tied)
    assert any(read[0])


@pytest.mark.parametrize("seed", range(4))
def test_the_workers_routed_blocks_and_requests_add_and_read_alike(tmp_path, monkeypatch, native, seed):
    """A write log's every-worker totals (journal.WriteLog: `PendingLane.total_with`, the two
    files read together, and `add_with`, a routing added to the worker's own cells first), compiled
    and as the lanes' `add` and `total` each, on two copies of the files: the same floats to the bit
    and the same bytes written, with rows in use that do and do not include the writer's row."""
    rng = random.Random(seed)
    rows = [1]
    copies = []
    for way in ("compiled", "python"):
        files = [SharedPending.create(tmp_path / f"{name}-{way}") for name in ("blocks", "requests")]
        copies.append((files, [(files[0].lane(w, lambda: rows[0]), files[1].lane(w, lambda: rows[0]))
                               for w in range(8)]))
    for _ in range(120):
        rows[0] = rng.randrange(1, 9)
        worker, iid = rng.randrange(0, 8), str(rng.randrange(0, 40))
        amount = rng.choice([0.1, 1e9, -0.0, -7.3, 512.0, 1e-9, 1.5])
        adding = rng.random() < 0.6
        found = []
        for (files, pairs), way in zip(copies, ("compiled", "python")):
            monkeypatch.setattr(shared_cells, "NATIVE", native if way == "compiled" else None)
            blocks, requests = pairs[worker]
            found.append(blocks.add_with(requests, iid, amount, 1.0) if adding else blocks.total_with(requests, iid))
        monkeypatch.setattr(shared_cells, "NATIVE", native)
        assert repr(found[0]) == repr(found[1])
    for k in range(2):
        assert copies[0][0][k]._mm[:] == copies[1][0][k]._mm[:]


@pytest.mark.parametrize("seed", range(6))
def test_a_write_logs_routed_since_a_time_reads_alike(tmp_path, monkeypatch, native, seed):
    """journal.WriteLog.since over every worker's totals (`PendingLane.since_with`, compiled, and the
    log's own Python over `total_with`): the same floats and ints, compared by repr, at times
    before, on, between and after its notes, with notes at equal times, dropped notes (a trimmed
    log, its arrays cut and not) and other workers routing in between."""
    rng = random.Random(seed)
    files = [SharedPending.create(tmp_path / name) for name in ("blocks", "requests")]
    rows = 4
    lanes = [(files[0].lane(w, lambda: rows), files[1].lane(w, lambda: rows)) for w in range(rows)]
    logs = [WriteLog(lanes[0], str(i)) for i in range(2)]
    clock, horizon = 100.0, 40.0 if seed % 2 else 1e9
    asked = cuts = 0
    for step in range(2000):
        log = logs[rng.randrange(2)]
        if rng.random() < 0.5:
            clock += rng.choice([0.0, 0.001, 0.37, 2.0])  # 0.0: notes at the same time
            before = log._start
            log.add(clock, rng.choice([0.0, 0.5, 3.0, 17.25]), horizon)
            cuts += log._start < before
        else:  # another worker routes there: the totals move between this worker's notes
            lanes[rng.randrange(1, rows)][0].add_with(lanes[0][1], log._iid, rng.choice([1.0, 9.5]), 1.0)
        if log._at and rng.random() < 0.5:
            first, last = log._at[log._start], log._at[-1]
            t = rng.choice([first - 1.0, first, last, last + 1.0, rng.uniform(first, last),
                            log._at[rng.randrange(log._start, len(log._at))]])
            found = both(monkeypatch, native, lambda: log.since(t))
            assert repr(found[0]) == repr(found[1]), (step, t)
            asked += 1
    assert asked > 400
    if horizon < 1e3:  # a short horizon drops notes: before them it cannot tell, compiled as not
        assert all(log._trimmed for log in logs) and cuts >= 2
        early = both(monkeypatch, native, lambda: logs[0].since(0.0))
        assert early[0] == early[1] and early[0][0] == float("inf")


def test_a_write_log_cuts_what_it_dropped():
    """Notes beyond the horizon are dropped: the log keeps the last few (memory stays bounded),
    and what it tells since a time within them is unchanged by the cut."""
    log = WriteLog()
    for k in range(5000):
        log.add(float(k), 1.0, horizon=100)
    assert len(log._at) - log._start <= 103 and len(log._at) <= 2 * 256 + 103
    assert log.since(4949.5) == (50.0, 50)


def test_cells_beyond_the_buffer_or_of_no_kind_are_refused(native):
    mm = mmap.mmap(-1, 4096)
    assert native.column_sums(mm, 0, 1024, 4, 256, "i", -1) == [0] * 256  # the last cell ends at the buffer's end
    with pytest.raises(IndexError):
        native.column_sums(mm, 4, 1024, 4, 256, "i", -1)
    with pytest.raises(IndexError):
        native.column_sums(mm, 0, 1024, 5, 1, "d", -1)
    with pytest.raises(IndexError):
        native.column_sums(mm, -8, 0, 1, 1, "d", -1)
    with pytest.raises(ValueError):
        native.column_sums(mm, 0, 8, 1, 1, "q", -1)
    with pytest.raises(ValueError):
        native.column_sums(mm, 0, 8, 1, 2, "d", -1, ["only one key"])
    with pytest.raises(IndexError):
        native.put_cells(mm, 0, {"a": 512}, {"a": 1})
    with pytest.raises(IndexError):
        native.read_cells(mm, {"a": 512}, ["a"])
    assert native.read_cells(mm, {"a": 511}, ["b", "a"]) == [None, 0.0]
    assert native.pair_sums(mm, mm, 8, 1024, 4) == (0.0, 0.0)  # the last row's cell within the buffer
    with pytest.raises(IndexError):
        native.pair_sums(mm, mmap.mmap(-1, 2048), 8, 1024, 4)
    assert native.put_cells(mm, 1, {"a": 510}, {"a": 3, "b": 4}) == ["b"]  # "b": no cell known, not written
    cells = memoryview(mm).cast("d")
    assert cells[511] == 3.0 and sum(cells) == 3.0
    cells.release()
