"""The prefix index every data-plane worker shares: one memory-mapped hash table.

routing/prefix_index.PrefixIndex records which instance was sent which chained
prompt-chunk key, in one process's memory. With several workers a prefix first
routed by worker A must land on the same instance when it comes back through worker
B, so the index lives in a file of the state dir that every worker maps, with the
same three methods (match, record, forget_instance): the policies do not know.

Layout (native byte order, no locks):
    header     magic, layout version, slot count
    forgotten  [instance] float64  monotonic time the instance last lost its cache
    slots      [slot] key (16 bytes), holder times 4 x float64, holder ids 4 x int32 (id + 1)

A key lives in one of PROBE slots from its hash (open addressing); a full
neighbourhood evicts the slot used least recently. Each key keeps up to HOLDERS
instances (the oldest is replaced). `forget_instance` writes one number (records
older than it are void) instead of scanning the table.

The slots are read and written by `_prefix_slots.c` where the package's setup built it (a
decision with long prompts ~1.8 x cheaper, bench/README.md, decision_cost), else by the Python
below, which the C follows operation for operation (tests/test_prefix_slots.py compares the
files they write byte for byte); this module owns the layout and hands its numbers over.

Racing writers can lose a record or pair a key with a holder a moment stale: the
index is approximate by nature (an engine may have evicted what we recorded), and a
lost record costs one cache miss, never a wrong answer. Every worker writes; the
daemon creates the file zeroed at `up`.
"""

from __future__ import annotations

import logging
import mmap
import struct
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from orchestrator import native
from orchestrator.dataplane.shared_table import MAX_INSTANCES, TableError, create_mapped, instance_index, open_mapped
from orchestrator.routing.prefix_index import DEFAULT_TTL_S, recorded

MAGIC = 0x7472746C6C707831  # "trtllpx1"
LAYOUT_VERSION = 1
SLOTS = 1 << 16  # 64k chunk keys, as routing.prefix_index.DEFAULT_MAX_CHUNKS
PROBE = 8
HOLDERS = 4
KEY_BYTES = 16

_HEADER = struct.Struct("=QII")
_HEADER_SIZE = 64
_FORGOTTEN_OFF = _HEADER_SIZE
_SLOTS_OFF = _FORGOTTEN_OFF + 8 * MAX_INSTANCES
_SLOT = struct.Struct(f"={KEY_BYTES}s{HOLDERS}d{HOLDERS}i")
SLOT_SIZE = _SLOT.size  # 64
_TIMES = struct.Struct(f"={HOLDERS}d{HOLDERS}i")
_EMPTY_KEY = bytes(KEY_BYTES)
_TIME = struct.Struct("=d")
_ID = struct.Struct("=i")
_HOLDER_IDS = struct.Struct(f"={HOLDERS}i")
_HOLDER_TIMES = struct.Struct(f"={HOLDERS}d")
_START = struct.Struct("<Q")  # a key's first 8 bytes: where its probe starts
_IDS_OFF = KEY_BYTES + 8 * HOLDERS
# record(): a key this worker wrote for the same instance this recently is not written again,
# and how many such writes it remembers (then it forgets them all and writes again).
REWRITE_S = 0.02
WRITTEN_KEYS = 8192
_INSTANCE_NAMES = tuple(str(i) for i in range(MAX_INSTANCES))  # match's keys: instance ids are indexes


def file_size(slots: int) -> int:
    return _SLOTS_OFF + slots * SLOT_SIZE


class SharedPrefixIndex:
    def __init__(self, path: Path, mm: mmap.mmap, slots: int, ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.monotonic, native: bool = True) -> None:
        self.path = path
        self._mm = mm
        self._slots = slots
        self._mask = slots - 1
        self.ttl_s = ttl_s
        self._clock = clock
        self._forgotten = memoryview(mm)[_FORGOTTEN_OFF:_SLOTS_OFF].cast("d")
        # chunk key -> (instance index, when this worker last wrote it there): record()'s skip
        self._written: dict[bytes, tuple[int, float]] = {}
        # The slots read and written in C where the module was built (_prefix_slots.c), else here.
        self._native = _compiled_slots(mm, slots) if native else None

    @classmethod
    def create(cls, path: Path, slots: int = SLOTS, **kw) -> "SharedPrefixIndex":
        if slots & (slots - 1):
            raise ValueError(f"slots={slots}: must be a power of two")
        mm = create_mapped(path, file_size(slots))  # prompts' fingerprints: owner only
        _HEADER.pack_into(mm, 0, MAGIC, LAYOUT_VERSION, slots)
        return cls(path, mm, slots, **kw)

    @classmethod
    def open(cls, path: Path, **kw) -> "SharedPrefixIndex":
        mm = open_mapped(path, "shared prefix index", _SLOTS_OFF.__le__)
        magic, version, slots = _HEADER.unpack_from(mm, 0)
        if magic != MAGIC or version != LAYOUT_VERSION or len(mm) != file_size(slots):
            mm.close()
            raise TableError(f"{path}: not a shared prefix index of this layout (version {version})")
        return cls(path, mm, slots, **kw)

    def close(self) -> None:
        if self._native is not None:
            self._native.release()
        self._forgotten.release()
        self._mm.close()

    @property
    def compiled(self) -> bool:
        """Whether the slots are read and written by the compiled module (bench reports say)."""
        return self._native is not None

    # --- the PrefixIndex interface ------------------------------------------------------
    def match(self, keys: Sequence[bytes | None]) -> tuple[int, dict[str, int]]:
        """For each instance, how many leading chunks of `keys` it holds (0 entries omitted)."""
        n, found = self.match_recency(keys)
        return n, {iid: depth for iid, (depth, _) in found.items()}

    def match_recency(self, keys: Sequence[bytes | None]) -> tuple[int, dict[str, tuple[int, float]]]:
        """As `match`, with when each instance was last routed its deepest matched chunk (by any
        worker): how long its engine has had to evict it since (routing/eviction.py).

        Only the chunk positions `recorded` are stored and read. A holder of one was routed every
        one before it at the same time (keys are a chain, and `record` writes them all), so each
        instance's depth is found by bisection over them, not by reading each: the first and the
        last chunk, then ~log2 in between (a 2150-character prompt: 2-3 slots read of its 4
        recorded; 64 chunks: ~5 of 11). A key this table lost in between (evicted from a full
        neighbourhood) does not cut the chain as a linear walk would: the engine was routed it
        all the same."""
        n = len(keys)
        if self._native is not None:
            return self._native.match_recency(keys, recorded(n), self._clock() - self.ttl_s)
        if not n:
            return 0, {}
        oldest = self._clock() - self.ttl_s
        holders = self._holders
        first = holders(keys[0], oldest)  # type: ignore[arg-type]  # recorded positions hold keys (chunk_keys)
        if not first:
            return n, {}
        if n == 1:
            return 1, {str(idx): (1, t) for idx, t in first.items()}
        last = holders(keys[-1], oldest)  # type: ignore[arg-type]
        found: dict[str, tuple[int, float]] = {}
        seen: dict[int, dict[int, float]] | None = None
        positions: tuple[int, ...] = ()
        for idx in first:
            if idx in last:
                found[str(idx)] = (n, last[idx])
                continue
            if seen is None:  # slots read once for every instance's bisection
                positions = recorded(n)
                seen = {0: first, len(positions) - 1: last}
            lo, hi = 0, len(positions) - 1  # it holds position lo, not position hi (indices)
            while hi - lo > 1:
                mid = (lo + hi) >> 1
                at = seen.get(mid)
                if at is None:
                    at = seen[mid] = holders(keys[positions[mid]], oldest)  # type: ignore[arg-type]
                if idx in at:
                    lo = mid
                else:
                    hi = mid
            found[str(idx)] = (positions[lo] + 1, seen[lo][idx])
        return n, found

    def record(self, keys: Sequence[bytes | None], instance_id: str) -> None:
        """`keys` were routed to the instance now (those at the positions `recorded` are written).
        The compiled slots write every time (nanoseconds a write; the times stay exact). The
        Python ones do not write again a key this worker wrote for the same instance less than
        REWRITE_S ago: a hot prefix is routed hundreds of times a second, each write costs them
        about a microsecond, and the times it would refresh serve the TTL (minutes) and the
        eviction verdict (scrapes 100 ms apart)."""
        idx = instance_index(instance_id)
        if self._native is not None:
            self._native.record(keys, recorded(len(keys)), idx, self._clock())
            return
        ident = idx + 1
        now = self._clock()
        written = self._written
        if len(written) > WRITTEN_KEYS:
            written.clear()
        since = now - REWRITE_S
        void = self._forgotten[idx]  # a write before the instance's restart is none
        mm = self._mm
        mask = self._mask
        start_of = _START.unpack_from
        ids_of = _HOLDER_IDS.unpack_from
        for p in recorded(len(keys)):
            key: bytes = keys[p]  # type: ignore[assignment]  # a recorded position holds its key (chunk_keys)
            mine = written.get(key)
            if mine is not None and mine[0] == idx and mine[1] > since and mine[1] > void:
                continue
            written[key] = (idx, now)
            if len(key) != KEY_BYTES or key == _EMPTY_KEY:
                key = _key16(key)
            # The common case inline (a 64-chunk prompt's 11 keys): the key in its first slot,
            # the instance among its holders: one time to write (the holder ids and the key
            # read, not the whole slot).
            off = _SLOTS_OFF + (start_of(key)[0] & mask) * SLOT_SIZE
            ids = ids_of(mm, off + _IDS_OFF)
            if mm[off:off + KEY_BYTES] != key:
                self._record_one(key, idx, now)
            elif ident in ids:
                _TIME.pack_into(mm, off + KEY_BYTES + 8 * ids.index(ident), now)
            else:  # a new holder of a key in its first slot (a prefix moved, or spread)
                self._add_holder(off, ids, idx, now)

    def forget_instance(self, instance_id: str) -> None:
        """The instance restarted or left: what it held is void from now (for every worker)."""
        self._forgotten[instance_index(instance_id)] = self._clock()

    def __len__(self) -> int:
        """Keys stored (a scan: for tests and status, not the request path)."""
        mm = self._mm
        return sum(1 for s in range(self._slots)
                   if mm[_SLOTS_OFF + s * SLOT_SIZE:_SLOTS_OFF + s * SLOT_SIZE + KEY_BYTES] != _EMPTY_KEY)

    # --- slots ----------------------------------------------------------------------------
    def _holders(self, key: bytes, oldest: float) -> dict[int, float]:
        """Holder index -> when it was last routed `key`, for the holders still valid ({}: none,
        or the key is not stored)."""
        if len(key) != KEY_BYTES or key == _EMPTY_KEY:  # as record() stores it
            key = _key16(key)
        mm = self._mm
        mask = self._mask
        start = _START.unpack_from(key)[0]
        for probe in range(PROBE):
            slot = _SLOT.unpack_from(mm, _SLOTS_OFF + ((start + probe) & mask) * SLOT_SIZE)
            stored = slot[0]
            if stored == key:
                break
            if stored == _EMPTY_KEY:  # slots are never emptied: a key is never stored past one
                return {}
        else:
            return {}
        forgotten = self._forgotten
        out = {}
        for k in range(1, 1 + HOLDERS):
            ident = slot[k + HOLDERS]
            if ident > 0:
                t = slot[k]
                idx = ident - 1
                if t >= oldest and idx < MAX_INSTANCES and t > forgotten[idx]:
                    out[idx] = t
        return out

    def _record_one(self, key: bytes, idx: int, now: float) -> None:
        mm = self._mm
        start = _START.unpack_from(key)[0]
        victim, victim_age = -1, None
        for probe in range(PROBE):
            off = _SLOTS_OFF + ((start + probe) & self._mask) * SLOT_SIZE
            slot = _SLOT.unpack_from(mm, off)
            stored = slot[0]
            if stored == key:
                self._add_holder(off, slot[1 + HOLDERS:], idx, now)
                return
            if stored == _EMPTY_KEY:
                victim, victim_age = off, float("-inf")
                break
            last_use = max(slot[1:1 + HOLDERS])
            if victim_age is None or last_use < victim_age:
                victim, victim_age = off, last_use
        # A new key: holders first (zeroed), then the key, so a reader never pairs the
        # new key with the evicted key's holders.
        _TIMES.pack_into(mm, victim + KEY_BYTES, now, 0.0, 0.0, 0.0, idx + 1, 0, 0, 0)
        mm[victim:victim + KEY_BYTES] = key

    def _add_holder(self, off: int, ids: tuple[int, ...], idx: int, now: float) -> None:
        """Instance `idx` routed the key of the slot at `off` (whose holder ids are `ids`) now."""
        mm = self._mm
        if idx + 1 in ids:
            pos = ids.index(idx + 1)
        else:  # a free place (the first), or the holder used least recently
            if 0 in ids:
                pos = ids.index(0)
            else:
                times = _HOLDER_TIMES.unpack_from(mm, off + KEY_BYTES)
                pos = times.index(min(times))
            _ID.pack_into(mm, off + _IDS_OFF + 4 * pos, idx + 1)
        _TIME.pack_into(mm, off + KEY_BYTES + 8 * pos, now)


def _compiled_slots(mm: mmap.mmap, slots: int) -> Any:
    """The compiled slots over `mm` (_prefix_slots.c), or None where the module was not built
    (setup.py builds it where a C compiler is; TRTLLM_ORCH_PURE_PYTHON=1 leaves it out)."""
    compiled = native.load("orchestrator.dataplane._prefix_slots")
    if compiled is None:
        return None
    try:
        return compiled.Slots(mm, _SLOTS_OFF, slots, _FORGOTTEN_OFF, PROBE, _INSTANCE_NAMES, KEY_BYTES, HOLDERS,
                              SLOT_SIZE)
    except ValueError as exc:  # a module built from another version's layout: the Python slots are right
        logging.getLogger("trtllm_orch.proxy").warning("prefix index: %s; its slots run in Python", exc)
        return None


def _key16(key: bytes) -> bytes:
    """Chunk keys are 16-byte digests; a longer key is cut, a shorter one padded (never all zero)."""
    if len(key) == KEY_BYTES and key != _EMPTY_KEY:
        return key
    return (key[:KEY_BYTES] + b"\x01" * KEY_BYTES)[:KEY_BYTES] if key.strip(b"\0") else b"\x01" * KEY_BYTES
