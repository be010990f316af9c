"""The prompt tokens each data-plane worker routed to each instance whose prefill has not
happened yet (the cost-model's pending prefill, routing/journal.py's `Pending`), shared by the
workers: one memory-mapped file in the state dir, beside the shared table.

Layout (native byte order, fixed offsets, no locks):
    header      magic, layout version, max workers, max instances
    pending     [worker][instance] float64 prompt tokens not prefilled yet, written by that
                worker only (every change of its ledgers' totals added there)

One writer per cell, as in the shared table (shared_table.py): a worker adds to its own cell
from its event loop, readers add the column, so every worker prices the prefill queued at an
instance by all of them. Before, each worker's ledger held its own routings only: with N
workers each saw about 1/N of the prefill queued there, and the workers' estimates (and picks)
for the same request differed by the others' share. A ledger drops an entry at its estimated
first token when it next looks (its worker's next choice over that instance), so a prefill
running late stays in the cell until then or until its first token comes: the other workers
may count it a little longer than its own worker does.

A separate file and not a lane of the shared table, so a table of an older data plane (adopted
by live restore) keeps its layout: a worker that finds no such file keeps its ledger to itself,
as before. The daemon creates it with the table and zeroes a worker's row where it zeroes the
table's (a worker that died took its requests, and their pending prefill, with it). The rows
summed are the table's rows in use.
"""

from __future__ import annotations

import contextlib
import mmap
import struct
from collections.abc import Callable, Sequence
from operator import add
from pathlib import Path
from typing import Any

from orchestrator.dataplane import shared_cells
from orchestrator.dataplane.shared_table import (MAX_INSTANCES, MAX_WORKERS, TableError, create_sized, instance_index,
                                                open_sized)

MAGIC = 0x7472746C6C706E31  # "trtllpn1"
LAYOUT_VERSION = 1
_HEADER_SIZE = 64  # as the shared table's (shared_table.create_sized)
SIZE = _HEADER_SIZE + 8 * MAX_WORKERS * MAX_INSTANCES
_ROW_BYTES = 8 * MAX_INSTANCES  # one worker's row


class SharedPending:
    def __init__(self, path: Path, mm: mmap.mmap) -> None:
        self.path = path
        self._mm = mm
        self._f64 = memoryview(mm).cast("d")

    @classmethod
    def create(cls, path: Path) -> "SharedPending":
        """A zeroed file (the daemon, with the shared table). Owner-only, as the table."""
        return cls(path, create_sized(path, SIZE, MAGIC, LAYOUT_VERSION))

    @classmethod
    def open(cls, path: Path) -> "SharedPending":
        return cls(path, open_sized(path, "pending-prefill file", SIZE, MAGIC, LAYOUT_VERSION))

    def close(self) -> None:
        self._f64.release()
        self._mm.close()

    @staticmethod
    def _cell(worker: int, instance: int) -> int:
        return (_HEADER_SIZE >> 3) + worker * MAX_INSTANCES + instance

    def clear_worker(self, worker: int) -> None:
        start = self._cell(worker, 0)
        self._f64[start:start + MAX_INSTANCES] = memoryview(bytes(8 * MAX_INSTANCES)).cast("d")

    def cells(self, instance_id: str, rows: int) -> list[float]:
        """Each worker row's pending prompt tokens at the instance, rows 0..rows-1."""
        col = self._cell(0, instance_index(instance_id))
        return list(self._f64[col:col + rows * MAX_INSTANCES:MAX_INSTANCES])

    def lane(self, worker: int, rows: Callable[[], int]) -> "PendingLane":
        """What worker `worker`'s journal writes and reads; `rows()`: the worker rows in use (the
        shared table's `rows`)."""
        return PendingLane(self, worker, rows)


class PendingLane:
    """One worker's view: `add` to its own cell of an instance; `of` the other workers' cells."""

    def __init__(self, shared: SharedPending, worker: int, rows: Callable[[], int]) -> None:
        self._mm = shared._mm
        self._f64 = shared._f64
        self._worker = worker
        self._rows = rows
        self._cells: dict[str, int] = {}  # instance id -> its cell in this worker's row
        self._offsets: dict[str, int] = {}  # instance id -> the byte offset of its column's first cell
        self._of: Sequence[Any] | None = None  # the ready set `of` last read, and its span
        self._span: tuple[int, int, list[str | None], struct.Struct] = (0, 0, [], struct.Struct("="))

    def _own(self, instance_id: str) -> int:
        """This worker's cell of the instance."""
        cell = self._cells.get(instance_id)
        if cell is None:
            cell = self._cells[instance_id] = SharedPending._cell(self._worker, instance_index(instance_id))
        return cell

    def add(self, instance_id: str, tokens: float) -> None:
        self._f64[self._own(instance_id)] += tokens

    def total(self, instance_id: str) -> float:
        """What every worker in use added to the instance's cells, this one's included."""
        col = self._column(instance_id)
        return sum(self._f64[col:col + self._rows() * MAX_INSTANCES:MAX_INSTANCES])

    def total_with(self, other: "PendingLane", instance_id: str) -> tuple[float, float]:
        """(`total`, other.total) of the instance, where `other` is a lane of a file of the same
        layout and rows (a worker's routed blocks and requests, journal.WriteLog): one compiled
        pass where built (4 rows, the 2-core box: 2.8 -> 1.3 us with the call; adding first, 3.4 -> 1.4)."""
        native = shared_cells.NATIVE
        if native is None:
            return self.total(instance_id), other.total(instance_id)
        offset = self._offsets.get(instance_id) or self._offset(instance_id)
        return native.pair_sums(self._mm, other._mm, offset, _ROW_BYTES, self._rows())

    def since_with(self, other: "PendingLane", instance_id: str, at: Any, blocks: Any, requests: Any, start: int,
                   trimmed: bool, t: float) -> tuple[float, int] | None:
        """journal.WriteLog.since over `total_with` of the instance and a write log's notes (its
        arrays of times, block totals and request totals from `start` on), in one compiled call;
        None where not built (the log works it out from `total_with`). A cost-model choice runs it
        for each instance holding the prompt's prefix."""
        native = shared_cells.NATIVE
        if native is None:
            return None
        offset = self._offsets.get(instance_id) or self._offset(instance_id)
        return native.routed_since(self._mm, other._mm, offset, _ROW_BYTES, self._rows(), at, blocks, requests, start,
                                   trimmed, t)

    def add_with(self, other: "PendingLane", instance_id: str, amount: float, other_amount: float
                 ) -> tuple[float, float]:
        """`add` amount here and other_amount to `other` (a lane of the same worker, as in
        `total_with`), then `total_with`: a worker's routing noted in its write log, in one pass."""
        native = shared_cells.NATIVE
        if native is None or other._worker != self._worker:
            self.add(instance_id, amount)
            other.add(instance_id, other_amount)
            return self.total_with(other, instance_id)
        offset = self._offsets.get(instance_id) or self._offset(instance_id)
        return native.pair_sums(self._mm, other._mm, offset, _ROW_BYTES, self._rows(), self._worker, amount,
                                other_amount)

    def _offset(self, instance_id: str) -> int:
        """The byte offset of the instance's column (never 0: the header comes first), kept: the
        compiled passes are asked for it a few times a choice."""
        offset = self._offsets[instance_id] = self._column(instance_id) << 3
        return offset

    def _column(self, instance_id: str) -> int:
        """The instance's cell in row 0 (its column's first)."""
        return self._own(instance_id) - self._worker * MAX_INSTANCES

    def of(self, backends: Sequence[Any]) -> dict[str, float]:
        """instance id -> the prompt tokens the other workers routed there and did not see
        prefilled yet, for these instances (anything with an `instance_id`; ids the file has no
        column for are left out; empty while no other worker has anything pending at them).
        Read together, as the in-flight counts are (shared_table's `inflight_span`): one struct
        unpack per other worker's row over the instances' span, added lane by lane."""
        if backends is not self._of:
            index = {}
            for b in backends:
                with contextlib.suppress(ValueError, TableError):
                    index[b.instance_id] = instance_index(b.instance_id)
            first = min(index.values(), default=0)
            end = max(index.values(), default=-1) + 1
            ids_at: list[str | None] = [None] * max(0, end - first)  # None: a gap in the span
            for iid, i in index.items():
                ids_at[i - first] = iid
            self._span = (first, end, ids_at, struct.Struct(f"={len(ids_at)}d"))
            self._of = backends
        first, end, ids_at, span = self._span
        mm = self._mm
        off = _HEADER_SIZE + 8 * first
        worker = self._worker
        native = shared_cells.NATIVE
        if native is not None and end > first:
            # one pass in C, the dict built there (16 instances, 4 workers: 3.6 -> 1.4 us the pass)
            out = native.column_sums(mm, off, _ROW_BYTES, self._rows(), end - first, "d", worker, ids_at)
        else:
            unpack = span.unpack_from
            values: Any = None
            for row in range(self._rows() if end > first else 0):
                if row != worker:
                    cells = unpack(mm, off + row * _ROW_BYTES)
                    values = cells if values is None else map(add, values, cells)
            out = dict(zip(ids_at, values)) if values is not None else {}
        out.pop(None, None)  # type: ignore[call-overload]  # the span's gaps
        # nothing pending elsewhere at these instances: nothing for the choice to add per instance
        return out if any(out.values()) else {}
