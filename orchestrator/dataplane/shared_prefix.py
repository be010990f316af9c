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

Racing writers can lose a record or pair a key with a holder a moment stale: the
index is approximate by nature (an engine may have evicted what we recorded), and a
lost record costs one cache miss, never a wrong answer. Every worker writes; the
daemon creates the file zeroed at `up`.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path

from orchestrator.dataplane.shared_table import MAX_INSTANCES, TableError, instance_index
from orchestrator.routing.prefix_index import DEFAULT_TTL_S

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


def file_size(slots: int) -> int:
    return _SLOTS_OFF + slots * SLOT_SIZE


class SharedPrefixIndex:
    def __init__(self, path: Path, mm: mmap.mmap, slots: int, ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._mm = mm
        self._slots = slots
        self._mask = slots - 1
        self.ttl_s = ttl_s
        self._clock = clock
        self._forgotten = memoryview(mm)[_FORGOTTEN_OFF:_SLOTS_OFF].cast("d")

    @classmethod
    def create(cls, path: Path, slots: int = SLOTS, **kw) -> "SharedPrefixIndex":
        if slots & (slots - 1):
            raise ValueError(f"slots={slots}: must be a power of two")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)  # prompts' fingerprints: owner only
        try:
            os.ftruncate(fd, file_size(slots))
            mm = mmap.mmap(fd, file_size(slots))
        finally:
            os.close(fd)
        _HEADER.pack_into(mm, 0, MAGIC, LAYOUT_VERSION, slots)
        return cls(path, mm, slots, **kw)

    @classmethod
    def open(cls, path: Path, **kw) -> "SharedPrefixIndex":
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise TableError(f"{path}: cannot open the shared prefix index: {exc.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if size < _SLOTS_OFF:
                raise TableError(f"{path}: size {size}: not a shared prefix index")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        magic, version, slots = _HEADER.unpack_from(mm, 0)
        if magic != MAGIC or version != LAYOUT_VERSION or size != file_size(slots):
            mm.close()
            raise TableError(f"{path}: not a shared prefix index of this layout (version {version})")
        return cls(path, mm, slots, **kw)

    def close(self) -> None:
        self._forgotten.release()
        self._mm.close()

    # --- the PrefixIndex interface ------------------------------------------------------
    def match(self, keys: list[bytes]) -> tuple[int, dict[str, int]]:
        """For each instance, how many leading chunks of `keys` it holds (0 entries omitted)."""
        n, found = self.match_recency(keys)
        return n, {iid: depth for iid, (depth, _) in found.items()}

    def match_recency(self, keys: list[bytes]) -> tuple[int, dict[str, tuple[int, float]]]:
        """As `match`, with when each instance was last routed its deepest matched chunk (by any
        worker): how long its engine has had to evict it since (routing/eviction.py)."""
        now = self._clock()
        found: dict[str, tuple[int, float]] = {}
        alive: dict[int, float] = {}
        n = 0
        for key in keys:
            slot = self._find(_key16(key))
            if slot is None:
                break
            current = self._live_holders(slot[1], now)
            if n:  # the chain must be unbroken: only who held every chunk before
                current = {idx: t for idx, t in current.items() if idx in alive}
                for idx, t in alive.items():
                    if idx not in current:
                        found[str(idx)] = (n, t)
            alive = current
            if not alive:
                break
            n += 1
        for idx, t in alive.items():
            found[str(idx)] = (n, t)
        return len(keys), found

    def record(self, keys: list[bytes], instance_id: str) -> None:
        idx = instance_index(instance_id)
        now = self._clock()
        for key in keys:
            self._record_one(_key16(key), idx, now)

    def forget_instance(self, instance_id: str) -> None:
        """The instance restarted or left: what it held is void from now (for every worker)."""
        self._forgotten[instance_index(instance_id)] = self._clock()

    def __len__(self) -> int:
        """Keys stored (a scan: for tests and status, not the request path)."""
        mm = self._mm
        return sum(1 for s in range(self._slots)
                   if mm[_SLOTS_OFF + s * SLOT_SIZE:_SLOTS_OFF + s * SLOT_SIZE + KEY_BYTES] != _EMPTY_KEY)

    # --- slots ----------------------------------------------------------------------------
    def _offset(self, slot: int) -> int:
        return _SLOTS_OFF + slot * SLOT_SIZE

    def _find(self, key: bytes) -> tuple[int, tuple] | None:
        """(offset, unpacked slot) of `key`, or None."""
        mm = self._mm
        start = int.from_bytes(key[:8], "little")
        for probe in range(PROBE):
            off = self._offset((start + probe) & self._mask)
            if mm[off:off + KEY_BYTES] == key:
                return off, _SLOT.unpack_from(mm, off)
        return None

    def _live_holders(self, slot: tuple, now: float) -> dict[int, float]:
        """Holder index -> when it was last routed this key, for the holders still valid."""
        times, ids = slot[1:1 + HOLDERS], slot[1 + HOLDERS:]
        forgotten = self._forgotten
        ttl = self.ttl_s
        out = {}
        for t, ident in zip(times, ids):
            if ident > 0:
                idx = ident - 1
                if idx < MAX_INSTANCES and now - t <= ttl and t > forgotten[idx]:
                    out[idx] = t
        return out

    def _record_one(self, key: bytes, idx: int, now: float) -> None:
        mm = self._mm
        start = int.from_bytes(key[:8], "little")
        victim, victim_age = -1, None
        for probe in range(PROBE):
            off = self._offset((start + probe) & self._mask)
            stored = mm[off:off + KEY_BYTES]
            if stored == key:
                self._add_holder(off, idx, now)
                return
            if stored == _EMPTY_KEY:
                victim, victim_age = off, float("-inf")
                break
            last_use = max(_SLOT.unpack_from(mm, off)[1:1 + HOLDERS])
            if victim_age is None or last_use < victim_age:
                victim, victim_age = off, last_use
        # A new key: holders first (zeroed), then the key, so a reader never pairs the
        # new key with the evicted key's holders.
        _TIMES.pack_into(mm, victim + KEY_BYTES, now, 0.0, 0.0, 0.0, idx + 1, 0, 0, 0)
        mm[victim:victim + KEY_BYTES] = key

    def _add_holder(self, off: int, idx: int, now: float) -> None:
        slot = _SLOT.unpack_from(self._mm, off)
        times, ids = list(slot[1:1 + HOLDERS]), list(slot[1 + HOLDERS:])
        if idx + 1 in ids:
            pos = ids.index(idx + 1)
        else:  # a free place, or the holder used least recently
            pos = min(range(HOLDERS), key=lambda i: (ids[i] != 0, times[i]))
            ids[pos] = idx + 1
        times[pos] = now
        _TIMES.pack_into(self._mm, off + KEY_BYTES, *times, *ids)


def _key16(key: bytes) -> bytes:
    """Chunk keys are 16-byte digests; a longer key is cut, a shorter one padded (never all zero)."""
    if len(key) == KEY_BYTES and key != _EMPTY_KEY:
        return key
    return (key[:KEY_BYTES] + b"\x01" * KEY_BYTES)[:KEY_BYTES] if key.strip(b"\0") else b"\x01" * KEY_BYTES
