"""What each data-plane worker's choices leave for the others (routing/llm_policies.py's
SharedTurns), one memory-mapped file in the state dir: when any worker last chose each instance
(the default's turns among equally loaded instances), and the count each instance had in flight
as the latest choice read it (what the daemon sends with each engine snapshot, `routed`).

Layout (native byte order, fixed offsets, no locks):
    header      magic, layout version, max workers, max instances
    stamps      [instance] float64  the clock of the latest choice of it
    counts      [instance] float64  every worker's requests in flight there, as the latest
                choice over it read them (its own added where it chose the instance)
Any worker writes either, last writer wins, as the shared table's ejection deadlines: two
workers that choose at once both write about now, and either is right.

One row, not a row per worker as the pending file keeps (shared_pending.py): a tie reads the
stamps of every tied instance within the decision, and one unpack of one row took 0.3 us on
the 2-core box with 16 instances tied, the highest cell of 4 workers' rows 6-14 us.

The daemon creates it with the shared table (and, adopting a data plane without it, for the
workers it starts); workers open it by path. It is never zeroed while the data plane lives.
"""

from __future__ import annotations

import functools
import mmap
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path

from orchestrator.dataplane import shared_cells
from orchestrator.dataplane.shared_table import MAX_INSTANCES, TableError, create_sized, instance_index, open_sized

MAGIC = 0x7472746C6C747331  # "trtllts1"
LAYOUT_VERSION = 1
_HEADER_SIZE = 64  # as the shared table's (shared_table.create_sized)
SIZE = _HEADER_SIZE + 16 * MAX_INSTANCES
_ZEROS = memoryview(bytes(8 * MAX_INSTANCES)).cast("d")


@functools.lru_cache(maxsize=None)
def _doubles(width: int) -> struct.Struct:
    return struct.Struct(f"={width}d")


class SharedStamps:
    def __init__(self, path: Path, mm: mmap.mmap) -> None:
        self.path = path
        self._mm = mm
        self._f64 = memoryview(mm).cast("d")
        self._cols: dict[str, int] = {}  # instance id -> its cell

    @classmethod
    def create(cls, path: Path) -> "SharedStamps":
        """A zeroed file (the daemon). Owner-only, as the table."""
        return cls(path, create_sized(path, SIZE, MAGIC, LAYOUT_VERSION))

    @classmethod
    def open(cls, path: Path) -> "SharedStamps":
        return cls(path, open_sized(path, "turns file", SIZE, MAGIC, LAYOUT_VERSION))

    def close(self) -> None:
        self._f64.release()
        self._mm.close()

    def _col(self, instance_id: str) -> int:
        col = self._cols.get(instance_id)
        if col is None:
            col = self._cols[instance_id] = (_HEADER_SIZE >> 3) + instance_index(instance_id)
        return col

    # (each asked per request: the column looked up here, worked out by _col the first time)
    def put(self, instance_id: str, stamp: float) -> None:
        col = self._cols.get(instance_id)
        self._f64[self._col(instance_id) if col is None else col] = stamp

    def note_count(self, instance_id: str, n: int) -> None:
        col = self._cols.get(instance_id)
        self._f64[(self._col(instance_id) if col is None else col) + MAX_INSTANCES] = n

    def note_counts(self, counts: Mapping[str, int]) -> None:
        """`note_count` for each instance of a decision's counts (one call: 16 instances ~1.4 us, 0.6
        in C)."""
        native = shared_cells.NATIVE
        if native is not None and type(counts) is dict:
            for iid in native.put_cells(self._mm, MAX_INSTANCES, self._cols, counts):  # cells not worked out yet
                self.note_count(iid, counts[iid])
            return
        f64 = self._f64
        cols = self._cols
        for iid, n in counts.items():
            col = cols.get(iid)
            f64[(self._col(iid) if col is None else col) + MAX_INSTANCES] = n

    def clear_counts(self) -> None:
        """Every instance's count back to 0 (none noted), the stamps kept (the daemon, as the
        routing policy changes)."""
        start = (_HEADER_SIZE >> 3) + MAX_INSTANCES
        self._f64[start:start + MAX_INSTANCES] = _ZEROS

    def count(self, instance_id: str) -> int:
        """The instance's count as the latest choice over it read it (0: none yet)."""
        return int(self._f64[self._col(instance_id) + MAX_INSTANCES])

    def routed(self, instance_id: str, now: int) -> int:
        """What the daemon sends with a snapshot of the instance (EngineSnapshot.routed), given
        every worker's count there `now`: the higher of it and the count the latest choice read,
        which is what one worker's own notes say where it makes every choice (a note holds until
        the next choice, and a count rises only by a choice)."""
        return max(now, self.count(instance_id))

    @property
    def buffer(self) -> mmap.mmap:
        """The file's bytes, for a compiled reader of the stamps and writer of the counts
        (routing/_least_requests.c)."""
        return self._mm

    # where an instance's count lies past its stamp, in float64 cells (a compiled writer's offset)
    counts_at = MAX_INSTANCES

    def cells(self, instance_ids: Sequence[str]) -> list[int] | None:
        """The float64 cell of each instance's stamp in `buffer`; None where an id has none (not a
        plan position, or beyond the file: `of` says why)."""
        try:
            return [self._col(iid) for iid in instance_ids]
        except (ValueError, TableError):
            return None

    def of(self, instance_ids: Sequence[str]) -> list[float]:
        """The stamps of these instances (0.0: never chosen), read together (a tie of 16: 3.0 us,
        ~1 in C)."""
        native = shared_cells.NATIVE
        if native is not None and type(instance_ids) is list:
            stamps = native.read_cells(self._mm, self._cols, instance_ids)
            if None in stamps:  # cells not worked out yet
                stamps = [self._f64[self._col(iid)] if v is None else v for iid, v in zip(instance_ids, stamps)]
            return stamps
        cols = [self._col(iid) for iid in instance_ids]
        first = min(cols)
        cells = _doubles(max(cols) - first + 1).unpack_from(self._mm, 8 * first)
        return [cells[c - first] for c in cols]
