"""Routing on what the engines report: `kv-aware` and `prefix-affinity`. Pure logic.

Both measure an instance's load in requests:
    ours     requests this proxy has in flight there (exact, instant);
    foreign  requests the engine holds that we did not send (another proxy, a
             direct client): active + Triton's pending from its last snapshot, minus
             what we had in flight there when that snapshot was taken
             (`InflightHistory`). Not + waiting: TRT-LLM's `waiting` is active minus
             scheduled, requests already counted in `active` (added twice, a request
             blocked for KV blocks counted as a foreign one: 28 phantom requests per
             instance on average in bench/routing_sim.py's s64/room4/mixed/closed);
    kv       KV-cache pressure: a nearly full cache makes new prompts wait for
             blocks whatever the free batch slots, so used/max counts as up to
             half a batch of extra load.
Engine numbers lag (a scrape every 100 ms), which is why our own count is the
base and the engine only adds what we cannot see. Subtracting today's count from
a snapshot up to 100 ms old would count our own requests that finished since as
foreign, and so steer away from the instance that just freed its slots (on
routing_bench's workload B that took TTFT p90 from 198 to 244 ms in
bench/routing_sim.py). When any candidate's snapshot
is stale (or the server exports no TRT-LLM metrics) every candidate is measured
by `ours` alone, so loads stay comparable.

`prefix-affinity` sends a prompt to an instance that already served its leading
chunks (their KV blocks are likely cached there: the prefill is skipped), but
only while that instance's load is within `slack` requests of the least loaded
one: a hot shared prefix must not pin all traffic to one instance. A holder whose
engine has surely evicted the prefix since it was last routed there (eviction.py:
it computed a free pool's worth of blocks since) is no holder: where every holder
is such, the prompt routes as a miss (reason `prefix-evicted`), and a prefix split
between two caches goes back to the copy that is left.

Where no holder is taken (no prompt, a prompt nobody served, every holder past the
slack) no cache is at stake, and it picks by `requests` alone: least-outstanding,
plus foreign work. KV blocks that running requests hold do not delay a new prompt
until the cache is full, and counting them as load sent the next prompt away from
an instance running a long one onto an instance with no free slot: in
bench/routing_sim.py's s8/room4/mixed/closed (unique prompts, 20% of 1-3k tokens,
16 users on 2 x 8 slots, 6 seeds x 60 s) 20% of choices went to the instance with
more requests in flight than least-outstanding's pick, TTFT p50 74 ms and p90 350
against its 63 and 320. By `requests` it makes least-outstanding's choices there.
Tried and dropped: requests or the KV fraction times the slots, whichever is more
(the engine as full as its fuller resource): on 64 slots one 3000-token prompt is 9
"requests" by it, and open-loop mixed cells lost (s64/room4/mixed/r1 TTFT p90 683 ms
against least-outstanding's 368).
The weighing of a holder against the slack keeps `loads` (with the KV term): by
requests alone there, the 64-slot tenant cells lost (s64/room1.5/uniform/r1 TTFT p90
92 -> 156 ms, s64/room4/zipf/r1 126 -> 1551; least-outstanding 88 and 2772).
A holder whose engine holds requests back for KV blocks (TRT-LLM's `waiting` in its last fresh
snapshot) is passed over while another instance stands idle (no request in flight, none
waiting), reason `prefix-kv-wait`: under guaranteed_no_evict the prompt would wait there for a
running request to finish and free its blocks (hundreds of ms of decode), where the idle one
prefills it at once. In bench/routing_sim.py's s8/room1.5/chat/r0 (conversations whose
histories fill an 8-slot engine's cache) that was TTFT p90 426 ms against NGINX's 287; with
the rule 246 (routing_sim-20261126T072349Z, bench/README.md; on the GPU twin that cell was
already 0.77 x the best without it, and the rule fired 0-2 times a cell). It needs an idle
instance, not merely a less busy one: passing over every waiting holder split the tenants of
the loaded tenant cells (80 cells: 67 within 3% of the best baseline instead of 69, geo-mean
TTFT p90 0.604 -> 0.721).
A holder with every batch slot taken (ours + foreign at its `max_active`) that holds less than
half of the prompt's chunks (FULL_HOLDER_MIN_SHARE) is passed over for an instance with a free
slot, reason `prefix-full`: a chat's next turn (its history + the answer + a new message) waited
there for a running request to end to skip the prefill of a part of it. In bench/routing_sim.py's
s8/room4/chat/closed that was 1.076 x the best baseline's TTFT p90, with the rule 1.007 (80 cells x
6 seeds: the chat cells alone moved, the others are the same to the last digit). A tenant's prompt
is held whole, so the rule never splits a tenant; passing over every full holder did
(bench/README.md: the tenant closed-loop cells lost their gains).
Among the holders within the slack the deepest wins, and among equally deep ones the
fewest `requests`: the cache is equally at stake on each, so the choice is one with no
cache at stake. By the KV-weighted load there, the 64-slot cells where every instance
holds every tenant ran 1.08 x NGINX's TTFT p90 in the simulator (s64/room1.5/uniform/r1
91.6 ms, by requests 87.3; 1.45 x on the GPU machine). Ties are taken in turn (`Turns`).
With both, the simulator's 80 cells (bench/README.md, routing_sim-20261126T053400Z) are
within 3% of the best baseline in 69 (54 before; either change alone: 58, 60).
"""

from __future__ import annotations

import math
import random
import time
import zlib
from bisect import bisect_right
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NamedTuple

from orchestrator import native
from orchestrator.health.engine_state import EngineSnapshot, EngineView
from orchestrator.routing.backends import Backend
from orchestrator.routing.eviction import KvWrites
from orchestrator.routing.prefix_index import DEFAULT_CHUNK_CHARS, PrefixIndex, chunk_keys
from orchestrator.routing.view_listeners import subscribe

# llm_policies._least_requests compiled (_least_requests.c), or None (not built, or
# TRTLLM_ORCH_PURE_PYTHON=1): read at each call, so tests run both.
NATIVE = native.load("orchestrator.routing._least_requests")

KV_WEIGHT = 0.5  # a full KV cache counts as half a batch of extra requests
# prefix-affinity follows a holder while its load is within this many requests of the least
# loaded instance. A spill is not a one-off: the spill target becomes a holder too and the
# prefix is split between both from then on, so where the caches cannot hold every prefix
# twice, each spill lowers the hit rate for good. bench/routing_sim.py (routing_bench's
# workload A, 12 tenants x 2048-token prefixes on 2 x 8 slots, 120 s): slack 4 spilled in
# the first seconds and ended near least-outstanding's hit rate (0.62-0.66, TTFT p90 44 s
# at 22 req/s); 10 spilled 6 times (hit 0.88 at 22 req/s, 0.82 at 26); 12 and 16 spilled
# 0-2 times (hit 0.95, p90 0.2-0.3 s at 22-26 req/s). The price is paid by one
# hot prefix at moderate load, which stays on one instance until the slack is reached:
# at 12 req/s TTFT p90 71 ms with 12 (shares 0.67/0.33), 183 ms with 16 (1.00/0.00),
# 53 ms with 4 or least-outstanding.
DEFAULT_SLACK = 12.0
# A holder with every batch slot taken is passed over for an instance with a free one when it
# holds less than this share of the prompt's chunks (reason `prefix-full`): a turn of a chat
# waits there for a running request to end to save the prefill of a part of its prompt. A
# tenant's prompt (its prefix + a question shorter than a chunk) is held whole and is never
# passed over for it. bench/routing_sim.py, the 8-slot chat cells x 6 seeds: s8/room4/chat/closed
# 1.076 -> 1.007 x the best baseline's TTFT p90 with 0.5 (on the real twin 1.07 -> 0.99 x); 0.34
# and 1.0 did the same within 1%: what matters is that a share of the prompt is new, not how much
# (bench/README.md).
FULL_HOLDER_MIN_SHARE = 0.5


# Every prompt-aware policy's reasons as what they did to a cached prefix: `top`'s ROUTE h/m/s
# column (the share of the last minute's picks of an instance). cost-model's own words, and
# prefix-affinity's: a holder taken (hit), none or none left (miss), every holder past the slack
# (spill). Reasons without a prompt at stake (no-prompt, load) are none of them.
ROUTE_KINDS = {"hit": "hit", "miss": "miss", "spill": "spill",
               "prefix": "hit", "prefix-miss": "miss", "prefix-evicted": "miss", "prefix-overloaded": "spill",
               "prefix-kv-wait": "spill", "prefix-full": "spill"}


class RouteHints(NamedTuple):
    """What a policy may know about the request; built by the proxy, only when the policy wants it.
    A named tuple, not a frozen dataclass: one is built per request on the path of the bytes, and a
    frozen dataclass's fields are set one `object.__setattr__` at a time (0.85 against 0.53 us)."""

    prompt_keys: tuple[bytes | None, ...] = ()  # prefix_index.chunk_keys: None where no index reads
    prompt_chars: int = 0  # the prompt's length as read (prompt.MAX_PROMPT_CHARS at most)
    # A checksum of the prompt's head (its first chunk): where estimates tie, every worker
    # breaks the tie alike, and a prompt's tenants land together (cost_policy.py).
    route_key: int = 0
    # The prompt itself, for a policy that samples it with the model's tokenizer (cost-model).
    text: str = ""

    def __repr__(self) -> str:  # not the prompt: up to 16k characters in a log line
        return f"RouteHints(prompt_keys=<{len(self.prompt_keys)}>, prompt_chars={self.prompt_chars}, " \
               f"route_key={self.route_key})"

    @classmethod
    def from_prompt(cls, prompt: str | None) -> "RouteHints | None":
        if not prompt:
            return None
        if len(prompt) < DEFAULT_CHUNK_CHARS:  # no full chunk: no key to hash
            return cls((), len(prompt), zlib.crc32(prompt.encode("utf-8", "surrogatepass")), prompt)
        keys = tuple(chunk_keys(prompt))
        return cls(keys, len(prompt), zlib.crc32(keys[0]), prompt)  # type: ignore[arg-type]  # position 0 is recorded


class InflightHistory:
    """Our in-flight count per instance over the last `keep_s`, noted after every choice.

    The count rises only by a choice (the proxy acquires what the policy chose), and the
    chosen instance is noted with its new request counted, so between two notes the count
    can only have fallen: a note is an upper bound until the next one, and `foreign`
    computed from it errs low (towards least-outstanding), never high.

    A busy worker notes a change per instance at every choice it makes there (thousands in
    `keep_s`), and every choice looks one up per instance at its snapshot's time: the notes
    are a sorted series searched by bisection, not scanned.
    """

    def __init__(self, keep_s: float = 2.0) -> None:
        self.keep_s = keep_s
        self._series: dict[str, _Series] = {}
        # With several data-plane workers, every note is also written where the daemon reads it
        # as it publishes a snapshot (dataplane/shared_stamps.py's counts; SharedTurns sets it).
        self.shared: Any = None
        # instance_id -> (snapshot, our count at its time, its active + pending, its KV term, its time):
        # `_counted`'s (the time for the compiled pass, _least_requests.c, which reads no snapshot)
        self._terms: dict[str, tuple[EngineSnapshot, int | None, int, float, float]] = {}
        # Whether choices note counts in `_series`: only while snapshots come without the daemon's
        # count (EngineSnapshot.routed), which the notes stand in for. A data-plane worker's
        # snapshots carry it, and noting 16 candidates' counts was 1.5-2 us of a 15-20 us decision.
        # A worker's policy starts without notes (`_LoadAware`): its daemon sends the count with
        # every snapshot, and until one comes (a cold start, or instances without TRT-LLM
        # metrics: none ever) the notes were kept for nothing, half of its decision at 16.
        self.noting = True
        # The instances whose latest snapshot came without it: noting while there is any. Each
        # snapshot turned noting on or off for all alike, and where some instances' snapshots carry
        # the count and others' do not (ids beyond the shared table's columns: the daemon has no
        # count for them) it flipped at every snapshot, each flip on clearing every note.
        self._unrouted: set[str] = set()

    def prime(self, instance_id: str, snap: EngineSnapshot, now: float) -> None:
        """Work out `_counted`'s terms of a snapshot as it arrives (a policy listening to the views
        calls this), so no decision does: a quiet worker decides a few times per snapshot, and
        would otherwise pay for every candidate's new terms within its decisions. Only once the
        clock is past the snapshot's time (notes are made at `now`: none can join those at or
        before it after that); one delivered at its own instant is worked out by the next decision."""
        if snap.iteration is not None:
            _snapshot_terms(self, instance_id, snap, now)

    def heard(self, instance_id: str, snap: EngineSnapshot) -> None:
        """A snapshot's terms are being worked out: note counts from now on while some instance's
        latest snapshot came without the daemon's count, not while every one came with it. Notes
        resumed after a pause start afresh (a note holds until the next, and there was none in the
        pause)."""
        unrouted = self._unrouted
        if snap.routed is not None:
            if unrouted:
                unrouted.discard(instance_id)
            if not unrouted:
                self.noting = False
            return
        unrouted.add(instance_id)
        if not self.noting:
            self._series.clear()
            self.noting = True

    def forget(self, instance_id: str) -> None:
        """The instance left the ready set: its snapshots without the daemon's count keep no one
        noting (the next snapshot with the count, from any instance, stops the notes if none is left)."""
        self._unrouted.discard(instance_id)

    def note_counts(self, candidates: Sequence[Backend], inflight: Mapping[str, int], now: float) -> None:
        """Each candidate's count as a choice read it, noted at `now` where it changed."""
        series = self._series
        horizon = now - self.keep_s
        for b in candidates:
            iid = b.instance_id
            ours = inflight.get(iid, 0)
            s = series.get(iid)
            if s is None:
                s = series[iid] = _Series()
            if s.last != ours:
                s.add(now, ours, horizon)

    def note_choice(self, now: float, chosen: str, count: int) -> None:
        """The chosen instance's count with its new request; the candidates' counts as read were
        noted by `_counted(..., note=True)`. Instances skipped by the choice are not noted: their
        counts can only fall until they are chosen, and a note is an upper bound until the next."""
        if self.noting:
            s = self._series.get(chosen)
            if s is None:
                s = self._series[chosen] = _Series()
            if s.last != count:
                s.add(now, count, now - self.keep_s)
        if self.shared is not None:
            self.shared.note_count(chosen, count)

    def at(self, instance_id: str, when: float) -> int | None:
        """Our count there at `when` (an upper bound), or None when nothing was noted before it."""
        s = self._series.get(instance_id)
        return s.at(when) if s is not None else None


class _Series:
    """One instance's notes, oldest first; `start` skips those no longer kept (deleted in bulk)."""

    __slots__ = ("times", "counts", "start", "last")

    def __init__(self) -> None:
        self.times: list[float] = []
        self.counts: list[int] = []
        self.start = 0
        self.last: int | None = None

    def add(self, now: float, n: int, horizon: float) -> None:
        times = self.times
        times.append(now)
        self.counts.append(n)
        self.last = n
        # keep the last note at or before the horizon: it covers until the next one
        cut = bisect_right(times, horizon, self.start) - 1
        if cut > self.start:
            self.start = cut
            if cut > 256 and 2 * cut > len(times):
                del times[:cut]
                del self.counts[:cut]
                self.start = 0

    def at(self, when: float) -> int | None:
        # asked once per snapshot and instance (`_counted` keeps the answer with the snapshot's terms)
        i = bisect_right(self.times, when, self.start) - 1
        return self.counts[i] if i >= self.start else None


def _snapshot_terms(history: InflightHistory, instance_id: str, snap: EngineSnapshot, now: float
                    ) -> tuple[EngineSnapshot, int | None, int, float, float]:
    """What `_counted` needs of a snapshot alone: (it, our count when it was taken by the history's
    notes, the requests its engine holds, its KV term, its time); kept in the history's terms only once the
    clock is past the snapshot's time (notes are made at `now`: none can join those at or before
    it after that)."""
    history.heard(instance_id, snap)
    notes = history._series.get(instance_id)
    kv_max = snap.kv_max
    # Our count when the engine took its numbers, as an upper bound (so `foreign` errs low): as
    # the latest choice before the snapshot read it, a count rising only by a choice. Where the
    # daemon sends it with the snapshot (EngineSnapshot.routed) it is every worker's latest
    # choice's; else this policy's own notes, the same where it makes every choice.
    then = snap.routed if snap.routed is not None else None if notes is None else notes.at(snap.at)
    t = (snap, then, snap.active + snap.pending,
         KV_WEIGHT * (snap.max_active or 1) * snap.kv_used / kv_max if kv_max else 0.0, snap.at)
    if snap.at < now:
        history._terms[instance_id] = t
    return t


def _counted(backends: Sequence[Backend], inflight: Mapping[str, int], now: float,
             history: InflightHistory | None, note: bool = False, ready: "ReadyLists | None" = None
             ) -> tuple[dict[str, float], dict[str, float]]:
    """(instance_id -> requests: ours + foreign, instance_id -> the same with KV pressure added);
    ours alone for every candidate when any candidate's snapshot is stale. One pass over the
    candidates: every choice runs it. With `note`, and while the history keeps notes
    (InflightHistory.noting), each count read is also noted at `now` in a second pass
    (InflightHistory.note_counts): the choice then notes only what it adds (`note_choice`).
    With a policy's `ready` lists, compiled where built (`NATIVE.counted`: the same pass, the plain
    case only, as `_least_requests`)."""
    if history is None:
        history = InflightHistory()  # nothing noted: `foreign` from the snapshots alone
    if note and history.shared is not None:
        # every count read, whatever this worker noted last (another worker may have since)
        history.shared.note_counts(inflight)
    compiled = NATIVE
    if compiled is not None and ready is not None and type(inflight) is dict:
        ids, views, _ = ready.of(backends)
        both = compiled.counted(ids, views, inflight, now, history._terms)
        if both is not None:  # no terms were worked out: `noting` is as it was
            if note and history.noting:
                history.note_counts(backends, inflight, now)
            return both
    terms = history._terms
    requests: dict[str, float] = {}
    weighted: dict[str, float] = {}
    fresh = True
    for b in backends:
        view = b.engine
        snap = view.latest if view is not None else None  # EngineView.fresh, inline
        if snap is None or snap.iteration is None or now - snap.at > view.stale_after_s:  # type: ignore[union-attr]
            fresh = False  # (a snapshot comes from a view: `view` is set past the first test)
            break
        iid = b.instance_id
        ours = inflight.get(iid, 0)
        # What depends on the snapshot alone, worked out once per snapshot (16 candidates a
        # choice, a snapshot per 100 ms): our count when it was taken, its requests, its KV term.
        t = terms.get(iid)
        if t is None or t[0] is not snap:  # not primed as it arrived (InflightHistory.prime)
            t = _snapshot_terms(history, iid, snap, now)
        then = t[1]
        foreign = t[2] - (ours if then is None else then)
        n = float(ours + foreign if foreign > 0 else ours)
        requests[iid] = n
        weighted[iid] = n + t[3]
    # after the look-ups (a note at `now` is never one of them: terms read notes before their
    # snapshot's time), and only while the snapshots need them (InflightHistory.noting)
    if note and history.noting:
        history.note_counts(backends, inflight, now)
    if not fresh:
        ours_only = {b.instance_id: float(inflight.get(b.instance_id, 0)) for b in backends}
        return ours_only, dict(ours_only)
    return requests, weighted


def loads(backends: Sequence[Backend], inflight: Mapping[str, int], now: float,
          history: InflightHistory | None = None) -> dict[str, float]:
    """instance_id -> load in requests, KV pressure added (see the module doc)."""
    return _counted(backends, inflight, now, history)[1]


def requests(backends: Sequence[Backend], inflight: Mapping[str, int], now: float,
             history: InflightHistory | None = None) -> dict[str, float]:
    """instance_id -> requests there, ours + foreign: the load of a choice with no cache at
    stake (see the module doc)."""
    return _counted(backends, inflight, now, history)[0]


def _fresh(b: Backend, now: float) -> EngineSnapshot | None:
    """The instance's engine snapshot if fresh enough to route on (EngineView.fresh), else None."""
    return b.engine.fresh(now) if b.engine is not None else None


def _waiting_for_kv(b: Backend, now: float) -> int | None:
    """Requests the instance's engine holds back for KV blocks (TRT-LLM's `waiting`: active, not
    scheduled) in its last snapshot; None when it has no fresh one."""
    snap = _fresh(b, now)
    return snap.waiting if snap is not None else None


def _stands_idle(candidates: Sequence[Backend], requests_at: Mapping[str, float], now: float) -> bool:
    """Whether a candidate has nothing to do: no request in flight (ours or foreign) and, by a fresh
    snapshot, none waiting. (`requests_at` holds the candidates only: a busy node answers from
    one scan of its values.)"""
    if 0 not in requests_at.values():
        return False
    return any(not requests_at[b.instance_id] and _waiting_for_kv(b, now) == 0 for b in candidates)


def _full(b: Backend, requests_at: Mapping[str, float], now: float) -> bool:
    """Whether every batch slot of the instance's engine is taken (ours + foreign against its
    `max_active`, by a fresh snapshot; not known: not full)."""
    snap = _fresh(b, now)
    return snap is not None and snap.max_active > 0 and requests_at[b.instance_id] >= snap.max_active


def _worth_a_slot(within: list[Backend], candidates: Sequence[Backend], requests_at: Mapping[str, float],
                  now: float) -> list[Backend]:
    """`within` (holders of less than FULL_HOLDER_MIN_SHARE of the prompt: the caller's test) less
    those that are full, where another candidate has a free slot (else `within` as it is)."""
    full = [b for b in within if _full(b, requests_at, now)]
    if not full or not any(b not in full and not _full(b, requests_at, now) for b in candidates):
        return within
    return [b for b in within if b not in full]


class ReadyLists:
    """The candidates' instance ids, engine views and (with the workers' turns) stamp cells as lists,
    worked out once per ready set: what the compiled passes of a policy's choices read
    (`_least_requests`, `_counted`). Owned by the policy; kept while the ready set is the same
    object (ReadyBackends publishes a new tuple at each change)."""

    __slots__ = ("_turns", "_of", "_lists")

    def __init__(self, turns: "Turns | SharedTurns") -> None:
        self._turns = turns  # the policy's
        self._of: Sequence[Backend] | None = None
        self._lists: tuple[list[str], list[EngineView | None], list[int] | None] = ([], [], None)

    def of(self, candidates: Sequence[Backend]) -> tuple[list[str], list[EngineView | None], list[int] | None]:
        # (a list grown or cut in place is worked out again: the lists must match it one to one)
        if candidates is not self._of or len(candidates) != len(self._lists[0]):
            turns = self._turns
            ids = [b.instance_id for b in candidates]
            cells = turns.stamps.cells(ids) if isinstance(turns, SharedTurns) else None
            self._lists = (ids, [b.engine for b in candidates], cells)
            self._of = candidates
        return self._lists


def _least_requests(candidates: Sequence[Backend], inflight: Mapping[str, int], now: float,
                    history: InflightHistory, turns: "Turns | SharedTurns", ready: "ReadyLists | None" = None
                    ) -> Backend:
    """`_least(candidates, _counted(candidates, inflight, now, history, note=True)[0], turns)`: the
    choice where no cache is at stake (no prompt, or one no candidate holds), most of the default's
    choices. Compiled where built (`NATIVE.least`: one pass on the candidates' lists, `ready`, no
    dict built, a tie broken and the counts noted on the workers' turns file there), for the plain
    case; every other (a stale snapshot, terms not worked out yet) is that formula here, the one
    definition of the rule (tests/test_llm_policies.py holds the two to the same choices). A
    worker's request on the compiled front's path, in process at 2 / 8 / 16 instances: 39.7 / 51.3
    / 66.2 us through the formula, 31.6 / 38.4 / 47.0 compiled (a Python one-pass copy of the
    formula's loop made 37.0 / 46.9 / 58.3; not kept: a second copy of the counting rule)."""
    compiled = NATIVE
    if compiled is not None and type(inflight) is dict:
        ids, views, cells = (ready if ready is not None else ReadyLists(turns)).of(candidates)
        shared = history.shared
        if cells is None:
            found = compiled.least(ids, views, inflight, now, history._terms)
        else:  # the workers' turns: the counts noted there too, where `shared` is that file
            stamps = turns.stamps  # type: ignore[union-attr]
            found = compiled.least(ids, views, inflight, now, history._terms, stamps.buffer, cells,
                                   stamps.counts_at if shared is stamps else -1)
        if found is not None:  # no terms were worked out: `noting` is as it was
            if shared is not None and (cells is None or shared is not turns.stamps):  # type: ignore[union-attr]
                shared.note_counts(inflight)
            if history.noting:
                history.note_counts(candidates, inflight, now)
            return candidates[found] if type(found) is int else turns.oldest([candidates[i] for i in found])
    return _least(candidates, _counted(candidates, inflight, now, history, note=True, ready=ready)[0], turns)


def _least(candidates: Sequence[Backend], load: Mapping[str, float], turns: "Turns | SharedTurns") -> Backend:
    best: list[Backend] = []
    low = math.inf
    for b in candidates:
        x = load[b.instance_id]
        if x < low:
            low = x
            best = [b]
        elif x == low:
            best.append(b)
    return best[0] if len(best) == 1 else turns.oldest(best)


class Turns:
    """Ties in load are taken in turn: of the instances as lightly loaded as the least, the one
    this policy chose longest ago, as NGINX's least_conn takes its equals in round-robin order.

    Ties are common wherever engines are not saturated (both idle, or one request each), and
    taking them at random sent runs of requests to one instance there: in bench/routing_sim.py
    least-outstanding (random ties) was 4-10% behind NGINX in TTFT p90 on the open-loop cells
    without a shared prefix (s8/room4/unique/r1 159 vs 148 ms, s64/room4/unique/r0 145 vs 132),
    and the default, routing those by requests too, with it."""

    __slots__ = ("_last", "_n")

    def __init__(self) -> None:
        self._last: dict[str, int] = {}  # instance_id -> the number of its last choice
        self._n = 0

    def chosen(self, instance_id: str, now: float) -> None:
        self._n += 1
        self._last[instance_id] = self._n

    def oldest(self, tied: list[Backend]) -> Backend:
        last = self._last
        return min(tied, key=lambda b: last.get(b.instance_id, 0))


class SharedTurns:
    """`Turns` for several data-plane workers: the instance any of them chose longest ago.

    Where each worker kept turns of its own, each took the ties in its own order, and N workers,
    each handed requests at random, took them about at random: least-outstanding's random ties,
    which `Turns` is there to avoid. bench/routing_sim.py with the default as 4 workers
    (`prefix-affinity@4`), the 12 8-slot chat, mixed and unique cells at r0/r1, seeds 1-2: 5
    within 3% of the best baseline's TTFT p90 as it was (s8/room4/unique/r1 1.085 x, .../r0
    1.043 x, s8/room4/mixed/r0 1.154 x), 7 with the turns shared, and 11 with the turns and the
    in-flight notes shared (one policy: 11). The notes are shared as the counts each choice
    read, written beside the stamps, which the daemon sends with each snapshot
    (`EngineSnapshot.routed`; the whole matrix: 70 of 80 within 3%, one policy 71).
    Each worker stamps the instance it chose with the time (dataplane/shared_stamps.py: one
    cell per instance, last writer wins); two workers that choose at once may take the same
    one, as a run of ties taken at random would."""

    __slots__ = ("stamps", "_last")

    def __init__(self, stamps: Any) -> None:
        self.stamps = stamps  # dataplane.shared_stamps.SharedStamps
        self._last = 0.0

    def chosen(self, instance_id: str, now: float) -> None:
        # strictly increasing per worker, so choices at one instant of a virtual clock stay in order
        self._last = stamp = now if now > self._last else self._last + 1e-9
        self.stamps.put(instance_id, stamp)

    def oldest(self, tied: list[Backend]) -> Backend:
        stamps = self.stamps.of([b.instance_id for b in tied])
        return tied[stamps.index(min(stamps))]


class _LoadAware:
    """What both policies share: the candidates, their loads, and the in-flight history. Ties
    are taken in turn (`Turns`); `rng` is taken for the policies' common signature."""

    # With the workers' shared turns, each choice writes the counts it read to the turns file
    # (`_counted`), which the daemon sends with each snapshot (balancer.notes_counts).
    NOTES_COUNTS = True

    def __init__(self, rng: random.Random, clock: Callable[[], float] = time.monotonic,
                 turns: "SharedTurns | None" = None) -> None:
        self._clock = clock
        self._turns: Turns | SharedTurns = turns if turns is not None else Turns()
        self.history = InflightHistory()
        self._ready = ReadyLists(self._turns)  # the candidates as lists, for the compiled passes
        if turns is not None:  # a data-plane worker's: its notes go where every worker's do
            self.history.shared = turns.stamps
            # and its snapshots come with the daemon's count (WorkerPool._routed): none to note for
            # them; one without (a column the table lacks) starts the notes (InflightHistory.heard)
            self.history.noting = False
        self.last_reason = ""

    def _measure(self, backends: Sequence[Backend], skip: Collection[str], inflight: Mapping[str, int]
                 ) -> tuple[Sequence[Backend], dict[str, float], dict[str, float], float] | None:
        """(candidates, their requests, their KV-weighted loads, now), the counts read noted."""
        candidates = [b for b in backends if b.instance_id not in skip] if skip else backends
        if not candidates:
            return None
        now = self._clock()
        return (candidates, *_counted(candidates, inflight, now, self.history, note=True, ready=self._ready), now)

    def _chosen(self, now: float, inflight: Mapping[str, int], chosen: Backend) -> Backend:
        self.history.note_choice(now, chosen.instance_id, inflight.get(chosen.instance_id, 0) + 1)
        self._turns.chosen(chosen.instance_id, now)
        return chosen

    def forget(self, instance_id: str) -> None:
        """The instance left the ready set (it restarts, or is gone)."""
        self.history.forget(instance_id)


class KvAware(_LoadAware):
    """Least load as the engines report it (see `loads`)."""

    def choose(self, backends: Sequence[Backend], skip: Collection[str], inflight: Mapping[str, int],
               hints: RouteHints | None = None) -> Backend | None:
        measured = self._measure(backends, skip, inflight)
        if measured is None:
            return None
        candidates, _, load, now = measured
        self.last_reason = "load"
        return self._chosen(now, inflight, _least(candidates, load, self._turns))


class PrefixAffinity(_LoadAware):
    def __init__(self, rng: random.Random, clock: Callable[[], float] = time.monotonic,
                 index: PrefixIndex | None = None, slack: float = DEFAULT_SLACK,
                 turns: SharedTurns | None = None) -> None:
        super().__init__(rng, clock, turns)
        self.index = index if index is not None else PrefixIndex(clock=clock)
        self.slack = slack
        # An index that keeps when each prefix was routed where lets a holder whose engine has
        # surely evicted it since count as none (eviction.py); one that does not, never.
        self._recency = getattr(self.index, "match_recency", None)
        self._writes: dict[str, KvWrites] = {}
        self._views: dict[str, EngineView] = {}  # the views listened to (view_listeners.py)
        self._seen: Sequence[Backend] | None = None  # the ready set they were last synced with

    def choose(self, backends: Sequence[Backend], skip: Collection[str], inflight: Mapping[str, int],
               hints: RouteHints | None = None) -> Backend | None:
        candidates = [b for b in backends if b.instance_id not in skip] if skip else backends
        if not candidates:
            return None
        now = self._clock()
        if self._recency is not None and backends is not self._seen:
            self._sync(backends)
        keys = hints.prompt_keys if hints is not None else ()
        chosen = None
        requests_at: dict[str, float] | None = None  # measured only where a holder is weighed
        if keys:
            depth, gone = self._held(keys)
            holders = [b for b in candidates if b.instance_id in depth] if depth else []  # depths are >= 1
            if holders:
                requests_at, load = _counted(candidates, inflight, now, self.history, note=True, ready=self._ready)
                low = min(load.values())
                within = [b for b in holders if load[b.instance_id] - low <= self.slack]
                spill = "prefix-overloaded"  # the starvation guard
                if within and _stands_idle(candidates, requests_at, now):
                    within = [b for b in within if not _waiting_for_kv(b, now)]
                    spill = "prefix-kv-wait"
                deepest = max(depth[b.instance_id] for b in within) if within else 0
                # Only the deepest can be chosen: where they hold half of the prompt (every
                # tenant's prompt), no holder worth passing over can change the choice; where
                # they do not, no holder within does.
                if deepest and deepest < FULL_HOLDER_MIN_SHARE * len(keys):
                    within = _worth_a_slot(within, candidates, requests_at, now)
                    if within:
                        deepest = max(depth[b.instance_id] for b in within)
                    else:
                        spill = "prefix-full"
                if within:
                    chosen = _least([b for b in within if depth[b.instance_id] == deepest], requests_at, self._turns)
                    self.last_reason = "prefix"
                else:
                    self.last_reason = spill
            else:
                self.last_reason = "prefix-evicted" if gone else "prefix-miss"
        else:
            self.last_reason = "no-prompt"
        if chosen is None:  # no cache at stake: how full each engine is, nothing more
            chosen = _least(candidates, requests_at, self._turns) if requests_at is not None \
                else _least_requests(candidates, inflight, now, self.history, self._turns, self._ready)
        if keys:
            self.index.record(keys, chosen.instance_id)
        return self._chosen(now, inflight, chosen)

    def _sync(self, backends: Sequence[Backend]) -> None:
        """Listen to the engine views of a new ready set: every scrape feeds the eviction verdict
        (eviction.py), off the request path."""
        views = self._views
        for b in backends:
            view = b.engine
            if view is not None and views.get(b.instance_id) is not view:
                views[b.instance_id] = view
                subscribe(self, b.instance_id, view)
        self._seen = backends

    def observe(self, iid: str, snap: EngineSnapshot) -> None:
        """Every snapshot of instance `iid`'s engine, in order (its view's listener)."""
        w = self._writes.get(iid)
        if w is None:
            w = self._writes[iid] = KvWrites()
        w.observe(snap)
        if snap.gone_before is not None and snap.gone_before > w.gone_before:
            # The daemon's verdict from every snapshot since the instance joined: a worker that
            # started late, or a policy a reload made, has only the snapshots since, and judged
            # prefixes routed before them "still there" where the others judged them gone. Both
            # verdicts are sure, so the later cutoff holds; a daemon that restarted (live restore)
            # knows less than the workers it adopted, and they keep their own until it catches up.
            w.gone_before = snap.gone_before
        self.history.prime(iid, snap, self._clock())

    def _held(self, keys: Sequence[bytes | None]) -> tuple[dict[str, int], bool]:
        """Instance -> leading chunks of `keys` it likely holds; and whether a holder the index
        names was left out as surely evicted since (eviction.py)."""
        if self._recency is None:
            return self.index.match(keys)[1], False
        found = self._recency(keys)[1]
        writes = self._writes
        depth: dict[str, int] = {}
        gone = False
        for iid, (d, routed_at) in found.items():
            w = writes.get(iid)
            if w is not None and w.gone(routed_at):
                gone = True
            else:
                depth[iid] = d
        return depth, gone

    def forget(self, instance_id: str) -> None:
        super().forget(instance_id)
        self.index.forget_instance(instance_id)
        self._writes.pop(instance_id, None)
