"""What the data-plane workers share: one small memory-mapped file in the state dir.

Layout (native byte order, fixed offsets, no locks):
    header      magic, layout version, max workers, max instances, rows in use (the
                highest worker slot the daemon has started + 1; 0: unknown, read all)
    inflight    [worker][instance] int32  requests in flight, written by that worker only
    worker      [worker] pid, connections, held, accepting, heartbeat  written by that worker only
    requests    [worker] int64 requests answered             written by that worker only
    ejected     [instance] float64 monotonic time an ejection ends (0: none); any worker
                writes it, last writer wins: an ejection is a fact every worker may learn

One writer per cell is what makes this safe without locks or atomics: a worker
adds to its own row and readers sum the column, so the global in-flight count of an
instance is exact up to the reads in progress (no exchange, no staleness). The
only cell with several writers is an ejection deadline, where any recent value is
right. `time.monotonic()` is CLOCK_MONOTONIC, one clock for every process of the host.

The daemon creates the file (and zeroes a dead worker's row before its slot is
reused); workers open it by path. It lives as long as the run: live restore keeps
it, so a restarted daemon and the workers that survived it read the same numbers.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from operator import add
from pathlib import Path
from typing import Any

from orchestrator.dataplane import shared_cells

MAGIC = 0x7472746C6C6D6F31  # "trtllmo1"
LAYOUT_VERSION = 1
MAX_WORKERS = 64
MAX_INSTANCES = 256

_HEADER = struct.Struct("=QIII")
_HEADER_SIZE = 64
# In the header's spare bytes, so a table of an older daemon (0 there) stays readable: every row
# counts. Only the daemon writes it, before it starts a worker in a slot, and never lowers it.
_ROWS_CELL = _HEADER.size >> 2
_WORKER_FIELDS = 4  # pid, connections, held, accepting (0 in a table of an older worker: not counted)
_INFLIGHT_OFF = _HEADER_SIZE
_WORKER_OFF = _INFLIGHT_OFF + 4 * MAX_WORKERS * MAX_INSTANCES
_HEARTBEAT_OFF = _WORKER_OFF + 4 * MAX_WORKERS * _WORKER_FIELDS
_REQUESTS_OFF = _HEARTBEAT_OFF + 8 * MAX_WORKERS
_EJECTED_OFF = _REQUESTS_OFF + 8 * MAX_WORKERS
SIZE = _EJECTED_OFF + 8 * MAX_INSTANCES
_ROW_BYTES = 4 * MAX_INSTANCES  # one worker's in-flight row
# A worker whose heartbeat is older than this is not serving (stopped, stuck or dead): the one
# definition used by /metrics' live count and by the accept share (accept_share.py).
ALIVE_S = 2.0


@functools.lru_cache(maxsize=None)
def _span(width: int) -> struct.Struct:
    """A span of `width` in-flight cells of one worker row (int32, native order)."""
    return struct.Struct(f"={width}i")


class TableError(Exception):
    pass


def create_mapped(path: Path, size: int) -> mmap.mmap:
    """A zeroed, owner-only file of `size` bytes, mapped: how the daemon makes each of the data
    plane's shared files (they say who serves what, and hold fingerprints of prompts)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def open_mapped(path: Path, what: str, size: Callable[[int], bool]) -> mmap.mmap:
    """An existing shared file mapped whole (a worker, or a daemon adopting a data plane); a
    TableError naming `what` where it cannot be opened or `size(its size)` says it is not one."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        raise TableError(f"{path}: cannot open the {what}: {exc.strerror}") from None
    try:
        actual = os.fstat(fd).st_size
        if not size(actual):
            raise TableError(f"{path}: size {actual}: not a {what} of this layout (another version?)")
        return mmap.mmap(fd, actual)
    finally:
        os.close(fd)


def create_sized(path: Path, size: int, magic: int, version: int) -> mmap.mmap:
    """`create_mapped`, headed (magic, version, MAX_WORKERS, MAX_INSTANCES): a file whose cells
    are [worker][instance] (this table, dataplane/shared_pending.py)."""
    mm = create_mapped(path, size)
    _HEADER.pack_into(mm, 0, magic, version, MAX_WORKERS, MAX_INSTANCES)
    return mm


def open_sized(path: Path, what: str, size: int, magic: int, version: int) -> mmap.mmap:
    """A file `create_sized` made with these `size`, `magic` and `version`, mapped; a TableError
    naming `what` for any other."""
    mm = open_mapped(path, what, size.__eq__)
    found, found_version, workers, instances = _HEADER.unpack_from(mm, 0)
    if (found, found_version, workers, instances) != (magic, version, MAX_WORKERS, MAX_INSTANCES):
        mm.close()
        raise TableError(f"{path}: not a {what} of this layout (version {found_version})")
    return mm


def instance_index(instance_id: str) -> int:
    """Instance ids are their plan position ("0", "1", ...): the column in every row."""
    i = int(instance_id)
    if not 0 <= i < MAX_INSTANCES:
        raise TableError(f"instance id {instance_id!r}: the shared table holds ids 0..{MAX_INSTANCES - 1}")
    return i


class SharedTable:
    def __init__(self, path: Path, mm: mmap.mmap) -> None:
        self.path = path
        self._mm = mm
        self._i32 = memoryview(mm).cast("i")
        self._f64 = memoryview(mm).cast("d")
        self._i64 = memoryview(mm).cast("q")

    # --- open / create ------------------------------------------------------------
    @classmethod
    def create(cls, path: Path) -> "SharedTable":
        """A zeroed table (the daemon, at `up`). Owner-only: it says who serves what."""
        return cls(path, create_sized(path, SIZE, MAGIC, LAYOUT_VERSION))

    @classmethod
    def open(cls, path: Path) -> "SharedTable":
        """The table of a running data plane (a worker, or a daemon adopting one)."""
        return cls(path, open_sized(path, "data-plane table", SIZE, MAGIC, LAYOUT_VERSION))

    def close(self) -> None:
        for view in (self._i32, self._f64, self._i64):
            view.release()
        self._mm.close()

    # --- in flight ------------------------------------------------------------------
    @staticmethod
    def _cell(worker: int, instance: int) -> int:
        return (_INFLIGHT_OFF >> 2) + worker * MAX_INSTANCES + instance

    def add_inflight(self, worker: int, instance: int, delta: int) -> None:
        cell = self._cell(worker, instance)
        self._i32[cell] += delta

    def inflight_row(self, worker: int) -> tuple[memoryview, int]:
        """Where `add_inflight` adds for this worker: the table's ints and the index of its row's
        first cell, column 0 (the view itself, not a slice: a slice would keep the map from closing)."""
        return self._i32, self._cell(worker, 0)

    def use_rows(self, rows: int) -> None:
        """Worker slots 0..rows-1 may write their rows from now on (the daemon, before a start)."""
        i32 = self._i32
        i32[_ROWS_CELL] = max(i32[_ROWS_CELL], min(rows, MAX_WORKERS))

    def rows(self) -> int:
        """The worker rows in use (every row where an older daemon left it unknown)."""
        return self._i32[_ROWS_CELL] or MAX_WORKERS

    def inflight(self, instance: int) -> int:
        """Requests in flight at `instance` from every worker. Every routing decision reads it
        for each candidate: only the rows in use are summed (4 of 64 rows: 0.85 -> 0.3 us)."""
        i32 = self._i32
        start = (_INFLIGHT_OFF >> 2) + instance
        return sum(i32[start:start + self.rows() * MAX_INSTANCES:MAX_INSTANCES])

    def inflight_span(self, first: int, end: int, keys: list[str] | None = None) -> Any:
        """`inflight` of instances first..end-1 at once, as a list; with `keys` (one per instance),
        as a dict of key -> count. Compiled (shared_cells.py): one pass over the rows in use, the
        dict built there too (16 instances, 4 workers, the 2-core box: 0.4 us, with the dict 0.8).
        Else each worker row in use unpacked as one struct, the rows added lane by lane (2.0 us,
        with the dict 2.8; more with the rows zipped into a tuple per instance and summed, 7 a
        column at a time)."""
        native = shared_cells.NATIVE
        if native is not None:
            return native.column_sums(self._mm, _INFLIGHT_OFF + 4 * first, _ROW_BYTES, self.rows(), end - first,
                                      "i", -1, keys)
        unpack = _span(end - first).unpack_from
        mm = self._mm
        off = _INFLIGHT_OFF + 4 * first
        counts: Any = unpack(mm, off)
        for row in range(1, self.rows()):
            counts = map(add, counts, unpack(mm, off + row * _ROW_BYTES))
        return list(counts) if keys is None else dict(zip(keys, counts))

    def worker_inflight(self, worker: int) -> int:
        start = self._cell(worker, 0)
        return sum(self._i32[start:start + MAX_INSTANCES])

    def clear_worker(self, worker: int) -> None:
        """A worker died: what it had in flight died with its connections."""
        start = self._cell(worker, 0)
        self._i32[start:start + MAX_INSTANCES] = memoryview(bytes(4 * MAX_INSTANCES)).cast("i")
        base = (_WORKER_OFF >> 2) + worker * _WORKER_FIELDS
        for k in range(_WORKER_FIELDS):
            self._i32[base + k] = 0
        self._f64[(_HEARTBEAT_OFF >> 3) + worker] = 0.0

    # --- per worker ------------------------------------------------------------------
    def _wcell(self, worker: int, field: int) -> int:
        return (_WORKER_OFF >> 2) + worker * _WORKER_FIELDS + field

    def set_pid(self, worker: int, pid: int) -> None:
        self._i32[self._wcell(worker, 0)] = pid

    def pid(self, worker: int) -> int:
        return self._i32[self._wcell(worker, 0)]

    def set_connections(self, worker: int, n: int) -> None:
        """Client connections the worker holds open, as it last published them (accept_share.py)."""
        self._i32[self._wcell(worker, 1)] = n

    def connections(self, worker: int) -> int:
        return self._i32[self._wcell(worker, 1)]

    def set_held(self, worker: int, held: int) -> None:
        self._i32[self._wcell(worker, 2)] = held

    def held(self, worker: int) -> int:
        return self._i32[self._wcell(worker, 2)]

    def set_accepting(self, worker: int, on: bool) -> None:
        self._i32[self._wcell(worker, 3)] = int(on)

    def accepting(self, worker: int) -> bool:
        return self._i32[self._wcell(worker, 3)] != 0

    def beat(self, worker: int, now: float) -> None:
        self._f64[(_HEARTBEAT_OFF >> 3) + worker] = now

    def heartbeat(self, worker: int) -> float:
        return self._f64[(_HEARTBEAT_OFF >> 3) + worker]

    def add_requests(self, worker: int, n: int = 1) -> None:
        self._i64[(_REQUESTS_OFF >> 3) + worker] += n

    def requests(self, worker: int) -> int:
        return self._i64[(_REQUESTS_OFF >> 3) + worker]

    # --- ejections ---------------------------------------------------------------------
    def eject(self, instance: int, until: float) -> None:
        self._f64[(_EJECTED_OFF >> 3) + instance] = until

    def ejected_until(self, instance: int) -> float:
        return self._f64[(_EJECTED_OFF >> 3) + instance]


def alive(table: SharedTable, worker: int, now: float) -> bool:
    beat = table.heartbeat(worker)
    return beat != 0.0 and now - beat <= ALIVE_S


class GlobalInflight(Mapping[str, int]):
    """instance_id -> requests in flight there from every worker: what routing reads.

    A Mapping over the table, so the policies (routing/) take it as they take a dict.
    Iterates `ids` (empty unless set): the policies only look instances up by id.
    """

    def __init__(self, table: SharedTable, ids: tuple[str, ...] = ()) -> None:
        self._table = table
        self.ids = ids
        self._columns_of: Sequence[Any] | None = None  # the ready set `of` last read, and its columns
        self._columns: tuple[int, int, list[Any], list[str], bool] = (0, 0, [], [], False)

    def __getitem__(self, instance_id: str) -> int:
        return self._table.inflight(instance_index(instance_id))

    def get(self, instance_id: str, default: int = 0) -> int:  # type: ignore[override]
        try:
            return self._table.inflight(instance_index(instance_id))
        except (ValueError, TableError):
            return default

    def of(self, backends: Sequence[Any]) -> dict[str, int]:
        """The counts of these instances (anything with an `instance_id`), read together: what a
        routing decision reads. The ready set is one list until it changes: its columns are
        worked out once per list, not per decision."""
        if backends is not self._columns_of:
            index: dict[str, int] = {}
            beyond: list[str] = []  # ids the table has no column for: 0, as `get` answers them
            for b in backends:
                try:
                    index[b.instance_id] = instance_index(b.instance_id)
                except (ValueError, TableError):
                    beyond.append(b.instance_id)
            first = min(index.values(), default=0)
            end = max(index.values(), default=-1) + 1
            # The usual ready set is instances first..end-1 in order: its counts are the span as read.
            in_order = not beyond and list(index.values()) == list(range(first, end))
            self._columns = (first, end, list(index) if in_order else [(iid, i - first) for iid, i in index.items()],
                             beyond, in_order)
            self._columns_of = backends
        first, end, columns, beyond, in_order = self._columns
        if in_order:
            return self._table.inflight_span(first, end, columns)
        out = dict.fromkeys(beyond, 0)
        if end > first:
            counts = self._table.inflight_span(first, end)
            out.update((iid, counts[i]) for iid, i in columns)
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(self.ids)

    def __len__(self) -> int:
        return len(self.ids)


class WorkerCounts:
    """One worker's own in-flight row: what `Balancer.acquire/release` write."""

    def __init__(self, table: SharedTable, worker: int) -> None:
        self._i32, self._row = table.inflight_row(worker)
        self._cells: dict[str, int] = {}  # instance id -> its cell in this worker's row, as met

    def _cell(self, instance_id: str) -> int:
        """The instance's cell, worked out the first time it is met (a TableError for an id beyond
        the table, each time)."""
        cell = self._row + instance_index(instance_id)
        if len(self._cells) >= MAX_INSTANCES:
            self._cells.clear()  # ids that came and went cannot grow it
        self._cells[instance_id] = cell
        return cell

    # one index into the table's ints per request, where add_inflight took three calls
    def acquire(self, instance_id: str) -> None:
        cell = self._cells.get(instance_id)
        if cell is None:
            cell = self._cell(instance_id)
        self._i32[cell] += 1

    def release(self, instance_id: str) -> None:
        cell = self._cells.get(instance_id)
        if cell is None:
            cell = self._cell(instance_id)
        self._i32[cell] -= 1
