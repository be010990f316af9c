"""What the routing side knows that the engines do not report yet, per instance: the prompt
blocks routed there to be computed, in the order the engine will compute them, and when each
prompt chunk was last routed there (`WriteLog`: what pushes an earlier prefix out of its cache,
and since when), and the prompt tokens routed there whose prefill has not happened yet
(`Pending`); the lengths of the prompts routed (for the token ratio, tokens.py), how far the
estimates missed (`ErrorMeter`: near-equal costs are ties), what each prefix's requests lost
by staying on a busy holder (`Rents`: when a copy elsewhere has paid for itself) and the prefixes
choices found cached at each instance (`Holdings`: what a copy there would push out). Pure logic.

When each chunk was last routed somewhere is also what the prefix indexes keep (`match_recency`:
an in-process PrefixIndex, and the data plane's shared one, dataplane/shared_prefix.py, where it
is the last routing by any worker); the times here serve an index without it.

The cost-model policy reads and writes one `Journal`. In one process that is everything
routed; with several data-plane workers each worker's journal holds its own routings, but for
the prompt tokens pending prefill: a worker's ledgers add to its cell of a shared file
(dataplane/shared_pending.py) and read the other workers' cells, so every worker prices the
prefill queued at an instance by all of them.
"""

from __future__ import annotations

import heapq
import math
from array import array
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol

from orchestrator.routing.cost_model import FORGET, on_grid
from orchestrator.routing.prefix_index import DEFAULT_MAX_CHUNKS, recorded
from orchestrator.routing.tokens import PromptStats


class RoutedShare(Protocol):
    """Where a data-plane worker's write logs meet the others' (dataplane/shared_pending.py's
    lanes, one of blocks and one of requests): `add` to this worker's cell, `total` of every
    worker's cells of an instance, cumulative."""

    def add(self, instance_id: str, amount: float) -> None: ...

    def total(self, instance_id: str) -> float: ...

    # `other`: a lane of the same kind and file layout (shared_pending.PendingLane with PendingLane)
    def total_with(self, other: Any, instance_id: str) -> tuple[float, float]:
        """(this lane's `total`, `other`'s): the blocks and requests lanes read together."""

    def since_with(self, other: Any, instance_id: str, at: "array[float]", blocks: "array[float]",
                   requests: "array[int]", start: int, trimmed: bool, t: float) -> tuple[float, int] | None:
        """WriteLog.since over these totals and notes, compiled; None: the Python's to work out."""

    def add_with(self, other: Any, instance_id: str, amount: float, other_amount: float
                 ) -> tuple[float, float]:
        """`add` to both lanes, then `total_with`."""


# A write log's dropped notes are cut from its arrays once there are this many and they are half of
# them: a cut moves what is left, so each note is moved about once (memory only: not a tuning).
_CUT_AFTER = 256


class WriteLog:
    """What was routed to one instance, cumulative with when: requests, and prompt blocks they
    need computed there. The engine serves in arrival order, so what was routed after a prefix
    is what runs between that prefix's request and the next one (module doc: cached_blocks).

    With `shared` (a data-plane worker's lanes of blocks and requests) the counts are every
    worker's: the worker adds its own routings there and notes the cumulative totals of all
    workers at each of its routings and each engine snapshot (`sample`); what was routed since a
    time is the totals now less the totals then, interpolated between the notes around it.
    Alone, a worker counted its own routings only, about 1/N of the blocks pushing a prefix out,
    and kept sending tenants to caches that had lost them: routing_sim, s8/room4/uniform/r1 with
    4 workers TTFT p90 4963 ms with logs of their own, 694 ms sharing them (one worker: 631)."""

    __slots__ = ("blocks", "requests", "_at", "_blocks", "_requests", "_start", "_seen", "_trimmed", "_shared",
                 "_iid")

    def __init__(self, shared: "tuple[RoutedShare, RoutedShare] | None" = None, instance_id: str = "") -> None:
        self.blocks = 0.0  # cumulative: this worker's, or every worker's with `shared` (as last noted)
        self.requests = 0
        self._trimmed = False  # entries dropped beyond the horizon: before them, unknown
        # The notes: when, and the totals then; entries before `_start` are dropped (moved past,
        # the arrays cut when that is half of them). Arrays, not deques: `since` bisects them, and
        # a deque's item away from its ends is a walk; the compiled `since_with` reads them whole.
        self._at = array("d")
        self._blocks = array("d")
        self._requests = array("q")
        self._start = 0
        # chunk key -> when it was last routed here; as many keys as a PrefixIndex holds
        self._seen: OrderedDict[bytes, float] = OrderedDict()
        self._shared = shared
        self._iid = instance_id

    def touch(self, keys: Sequence[bytes | None], at: float) -> None:
        """A prompt of these chunk keys was routed here at `at` (those at the positions the
        indexes read: prefix_index.recorded)."""
        seen = self._seen
        for p in recorded(len(keys)):
            key: bytes = keys[p]  # type: ignore[assignment]  # a recorded position holds its key (chunk_keys)
            if key in seen:
                seen.move_to_end(key)
            seen[key] = at
        while len(seen) > DEFAULT_MAX_CHUNKS:
            seen.popitem(last=False)

    def last(self, key: bytes) -> float | None:
        """When the chunk `key` was last routed here (None: not by us, or too long ago)."""
        return self._seen.get(key)

    def _totals(self) -> tuple[float, int]:
        shared = self._shared
        if shared is None:
            return self.blocks, self.requests
        blocks, requests = shared[0].total_with(shared[1], self._iid)
        return blocks, int(requests)

    def add(self, at: float, blocks: float, horizon: float) -> None:
        shared = self._shared
        if shared is not None:
            total_blocks, total_requests = shared[0].add_with(shared[1], self._iid, blocks, 1.0)
            self._note(at, total_blocks, int(total_requests), horizon)
        else:
            self._note(at, self.blocks + blocks, self.requests + 1, horizon)

    def sample(self, at: float, horizon: float) -> None:
        """Note every worker's totals now (an engine snapshot: off the request path), so that a
        time between this worker's own routings finds the totals near it."""
        if self._shared is not None:
            blocks, requests = self._totals()
            if blocks != self.blocks or requests != self.requests:
                self._note(at, blocks, requests, horizon)

    def _note(self, at: float, blocks: float, requests: int, horizon: float) -> None:
        self.blocks = blocks
        self.requests = requests
        self._at.append(at)
        self._blocks.append(blocks)
        self._requests.append(requests)
        # Entries a whole `horizon` of blocks back (two caches) are not needed: what was routed
        # before them is evicted whatever else happened.
        start = self._start
        end = len(self._at)
        while end - start > 2 and blocks - self._blocks[start + 1] > horizon:
            start += 1
            self._trimmed = True
        if start >= _CUT_AFTER and 2 * start >= end:
            del self._at[:start], self._blocks[:start], self._requests[:start]
            start = 0
        self._start = start

    def since(self, t: float) -> tuple[float, int]:
        """(blocks, requests) routed after monotonic time `t`; (inf, ...) beyond the log.

        A time before the log's first entry is beyond it only once entries were dropped. Before
        that the log holds every routing of its own, all of them after `t`: with several
        data-plane workers `t` is often another worker's routing of the prefix from before this
        worker's first one here (a worker just started or reloaded), and counting it as beyond
        the log judged every such prefix evicted, so that worker sent its tenants elsewhere
        (cost-model's `miss` picks on the real twin, tests/test_cost_model.py)."""
        at = self._at
        start = self._start
        shared = self._shared
        if shared is not None:
            if len(at) == start:
                return 0.0, 0
            # compiled where built: the same rule in one call, as it runs for each instance
            # holding a prompt's prefix at each cost-model choice (bench/decision_cost.py's
            # cost-model at 16 instances, tenant prompts, the 2-core box: 4.8 us a call here, 2.4
            # with it; tests/test_shared_cells.py holds the two to the same answers)
            found = shared[0].since_with(shared[1], self._iid, at, self._blocks, self._requests, start,
                                         self._trimmed, t)
            if found is not None:
                return found
            # every worker's totals now less those at `t`, interpolated between the notes around
            # it (before the first note, and nothing dropped: the first note's)
            blocks, total_requests = shared[0].total_with(shared[1], self._iid)
            requests = int(total_requests)
            i = bisect_right(at, t, start)
            then_r: float  # a note's count, or one interpolated between two
            if i == start:
                if self._trimmed:
                    return math.inf, requests
                then_b, then_r = self._blocks[start], self._requests[start]
            elif i == len(at):
                then_b, then_r = self._blocks[-1], self._requests[-1]
            else:
                t0, t1 = at[i - 1], at[i]
                f = (t - t0) / (t1 - t0) if t1 > t0 else 1.0
                then_b = self._blocks[i - 1] + f * (self._blocks[i] - self._blocks[i - 1])
                then_r = self._requests[i - 1] + f * (self._requests[i] - self._requests[i - 1])
            return max(0.0, blocks - then_b), max(0, int(requests - then_r))
        if len(at) == start or t >= at[-1]:
            return 0.0, 0
        i = bisect_right(at, t, start)
        if i == start:
            return (math.inf if self._trimmed else self.blocks), self.requests
        return self.blocks - self._blocks[i - 1], self.requests - self._requests[i - 1]


class Pending:
    """Prompt tokens routed to one instance and not prefilled yet: each entry [until, tokens,
    self] ends at its request's first token (`done`) or at its estimated first token.

    With `shared` (a data-plane worker's lane of dataplane/shared_pending.py) every change of the
    total is added to the worker's cell there (`Journal.others`: what the other workers routed
    there). Changes, not totals: a worker's cell is the sum of what it holds pending there (one
    journal per worker, but a cell that stays right whatever else adds to it), and prompt
    tokens are whole numbers, so the sums stay exact."""

    __slots__ = ("heap", "total", "shared", "_iid")

    def __init__(self, shared: "PendingShare | None" = None, instance_id: str = "") -> None:
        self.heap: list[list] = []
        self.total = 0.0
        self.shared = shared
        self._iid = instance_id

    def at(self, now: float) -> float:
        heap = self.heap
        if not heap:
            return 0.0
        before = total = self.total
        while heap and heap[0][0] <= now:
            entry = heapq.heappop(heap)
            total -= entry[1]
            entry[1] = 0.0  # a first token reported after this changes nothing
        self.total = total if heap else 0.0  # no float drift left behind
        if self.shared is not None and self.total != before:
            self.shared.add(self._iid, self.total - before)
        return self.total

    def add(self, tokens: float, until: float) -> list:
        entry = [until, tokens, self]
        heapq.heappush(self.heap, entry)
        self.total += tokens
        if self.shared is not None:
            self.shared.add(self._iid, tokens)
        return entry

    @staticmethod
    def done(entry: list) -> None:
        tokens, entry[1] = entry[1], 0.0
        if tokens:
            ledger = entry[2]
            before = ledger.total
            ledger.total = max(0.0, before - tokens)
            if ledger.shared is not None:
                ledger.shared.add(ledger._iid, ledger.total - before)

    def clear(self) -> None:
        """Nothing pending any more (the instance restarted: `Journal.forget`): the requests
        routed before may still end, changing nothing. In place, so every policy holding the
        ledger (a worker's HTTP and gRPC proxies share its journal) sees it cleared."""
        for entry in self.heap:
            entry[1] = 0.0
        self.heap.clear()
        if self.shared is not None and self.total:
            self.shared.add(self._iid, -self.total)
        self.total = 0.0


class ErrorMeter:
    """How far the cost model's TTFT estimates miss, in seconds: the mean absolute error of the
    last ~100 first tokens (forgotten sums), on the rates' grid. Costs closer than that are not
    told apart (cost_policy)."""

    __slots__ = ("_sum", "_n", "value")

    def __init__(self) -> None:
        self._sum = 0.0
        self._n = 0.0
        self.value = 0.0

    def add(self, error: float) -> None:
        self._sum = self._sum * FORGET + abs(error)
        self._n = self._n * FORGET + 1.0
        self.value = on_grid(self._sum / self._n)


class PendingShare(Protocol):
    """Where a data-plane worker's pending ledgers meet the others' (dataplane/shared_pending.py)."""

    def add(self, instance_id: str, tokens: float) -> None: ...

    def of(self, backends: Sequence[Any]) -> dict[str, float]: ...


class Rents:
    """prefix key -> what requests of that prefix lost, net, by staying on its holder while
    another instance would have been cheaper with a copy (cost_policy's rent-or-buy). Each
    worker's own, as the token ratio and the error meter: a worker sees its share of a prefix's
    requests."""

    KEPT = 4096  # prefixes paying towards a copy, at most (memory only: a bound, not a tuning)

    def __init__(self) -> None:
        self._paid: dict[bytes | None, float] = {}

    def get(self, key: bytes | None) -> float:
        return self._paid.get(key, 0.0)

    def pay(self, key: bytes | None, paid: float) -> None:
        """Keep what the prefix has paid now; 0: nothing (a copy was just bought, or staying
        has paid off as much as it cost)."""
        book = self._paid
        if not paid:
            book.pop(key, None)
            return
        if len(book) >= self.KEPT and key not in book:
            book.clear()  # the prefixes still hot start paying again: a copy comes later, no harm
        book[key] = paid


class Holdings:
    """Per instance, the prefixes that choices found cached there: the deepest matched chunk's key
    -> (its blocks, when last found). What a copy of another prefix would push out of that
    instance's cache (cost_policy's rent-or-buy). Each worker's own, as the rents."""

    KEPT = 1024  # prefixes per instance, the least recently found dropped first (memory only)
    REFRESH_S = 1.0  # a prefix found again sooner keeps its time (a choice's cost, not a tuning)

    def __init__(self) -> None:
        self._held: dict[str, OrderedDict[bytes | None, tuple[int, float]]] = {}
        self._total: dict[str, int] = {}  # iid -> the sum of its entries' blocks (read per choice)

    def found(self, iid: str, key: bytes | None, blocks: int, now: float) -> None:
        held = self._held.get(iid)
        if held is None:
            held = self._held[iid] = OrderedDict()
            self._total[iid] = 0
        before = held.get(key)
        if before is not None and before[0] == blocks and now - before[1] < self.REFRESH_S:
            return  # found moments ago: its time is fresh enough against a horizon of minutes
        held[key] = (blocks, now)
        if before is not None:
            held.move_to_end(key)
            self._total[iid] += blocks - before[0]
            return
        self._total[iid] += blocks
        if len(held) > self.KEPT:
            self._total[iid] -= held.popitem(last=False)[1][0]

    def blocks(self, iid: str, since: float) -> int:
        """The blocks of the prefixes found there since `since` (older ones are dropped now)."""
        held = self._held.get(iid)
        if not held:
            return 0
        while held and next(iter(held.values()))[1] < since:
            self._total[iid] -= held.popitem(last=False)[1][0]
        return self._total[iid]

    def forget(self, iid: str) -> None:
        self._held.pop(iid, None)
        self._total.pop(iid, None)


class Journal:
    def __init__(self, pending: PendingShare | None = None,
                 routed: "tuple[RoutedShare, RoutedShare] | None" = None) -> None:
        self.prompts = PromptStats()
        self.errors = ErrorMeter()
        self.rents = Rents()
        self.holdings = Holdings()
        self._logs: dict[str, WriteLog] = {}
        self._pending: dict[str, Pending] = {}
        self._share = pending
        self._routed = routed  # the workers' routed blocks and requests (WriteLog), None: our own

    def log(self, iid: str) -> WriteLog:
        log = self._logs.get(iid)
        if log is None:
            log = self._logs[iid] = WriteLog(self._routed, iid)
        return log

    def pending(self, iid: str) -> Pending:
        ledger = self._pending.get(iid)
        if ledger is None:
            ledger = self._pending[iid] = Pending(self._share, iid)
        return ledger

    def others(self, backends: Sequence[Any]) -> dict[str, float] | None:
        """instance id -> the prompt tokens the other data-plane workers routed there and did not
        see prefilled yet; None without a shared file (one process: its ledgers are everything)."""
        return self._share.of(backends) if self._share is not None else None

    def forget(self, iid: str) -> None:
        """The instance restarted: nothing routed there before counts."""
        self._logs.pop(iid, None)
        self.holdings.forget(iid)
        ledger = self._pending.get(iid)
        if ledger is not None:
            ledger.clear()
