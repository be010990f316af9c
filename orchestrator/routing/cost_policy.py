"""`cost-model`: each request goes where it costs least, in seconds. Pure logic.

For every candidate instance the policy estimates the request's time to first token there
(cost_model.ttft_estimate): the wait for a batch slot (the requests there, ours from every
worker plus what its engine holds that we did not send, beyond what runs at once, each
freeing its slot after `out_tokens` iterations), plus the prefill of this prompt's tokens not
likely cached there and of the prompt tokens routed there before it and not prefilled yet,
plus one iteration. To that it adds what the choice costs the others: the prompt tokens it
computes there beyond what the best-cached instance would compute are engine time spent for
nothing (counted once), and every request there still waiting for a batch slot gets its first
token that much later (counted for each). The requests running there lose an iteration's
worth of time too, but their first token is out: counting them (as a first cut did) made a
spill cost a whole batch's delay, so on 64-slot engines a hot tenant stayed on its holder
until the queue there outweighed that. routing_sim, 80 cells x 2 seeds x 60 s: s64/room1.5/
zipf/r2 TTFT p90 1807 -> 207 ms (least-outstanding 242), s64/room1.5/uniform/r2 1820 -> 332
(310), s64/room4/uniform/closed 745 -> 356; the 8-slot shared-prefix cells 10-100% slower but
still 0.02-0.5x least_conn; cells worse than the best of least-outstanding and nginx by > 3%:
14 -> 12 (bench/results/routing_sim-20261125T071201Z.json and bench/README.md). The lowest
total wins.

- Cached tokens: the prefix index's matched chunks, in tokens (tokens.py), less what the
  instance's cache has likely evicted since: the blocks routed there after the prefix
  (journal.py's WriteLog) push it out once the free pool's older blocks are gone, unless the
  request that carried it still runs (cost_model.cached_blocks). Since when: the index's own
  times (the in-process PrefixIndex, and the data-plane workers' shared one, which keeps the
  last routing by any worker), else the journal's. An index without times made every prefix
  it ever named count as cached, and on caches that hold few prefixes the model kept sending
  tenants to copies long evicted (routing_sim s8/room4/uniform/r1 with the shared index before
  it kept times: TTFT p90 12.6 s and 1.0 s, KV hit 0.68 and 0.83 over two seeds, against 0.52
  and 0.33 s, 0.92 with the journal's times; the real twin's run 20261125T045811Z, before
  this, 1266 ms and 0.88).
- Rates come from the engines' own scrapes (cost_model.RateBook), so the trade between a
  cached prefix and a queue is made in the engine's units whatever its shape: a multi-turn chat
  stays where its history is cached while the prefill it saves there outweighs the queue in
  front of it, and moves when it does not.
- Near-equal totals (within one decode iteration, or where a cached prefix is at stake within
  the estimates' own mean absolute error of late, journal.ErrorMeter, where that is larger:
  below what the estimate tells apart) go to the instance holding the most of the prompt, then
  the fewest requests, then by rendezvous hashing of the prompt's head with the instance id:
  every data-plane worker picks alike, and a new prefix lands on one instance. Before,
  near-equals went to the fewest requests, and a queue's noise split tenants: routing_sim with
  iterations +-30% (--jitter 0.3; the real twin's are noisier than its model),
  s8/room4/uniform/r1 TTFT p90 1740 -> 801 ms, s8/room4/zipf/r1 633 -> 355; without noise, 24
  shared-prefix cells x 2 seeds: geometric mean 0.90 x (s8/room4/uniform/r1 663 -> 360,
  s64/room4/zipf/r2 827 -> 555; s8/room1.5/zipf/r2 5085 -> 7416 the worst). All 80 cells, the
  tolerance only with a cache at stake: 0.98 x
  (bench/results/routing_sim-20261125T074003Z.json).
- A copy pays for itself over many requests, and no one request pays for it: priced per request,
  a busy holder of a popular prefix kept it for ever where nothing queues (64 slots below
  saturation: the holder's longer iterations are the whole cost; routing_sim 8 seeds,
  s64/room1.5/uniform/r1 TTFT p90 1.24 x the best baseline's). So each request that stays on the
  holder while another instance would cost less with a copy pays the difference as rent (what
  it gains by staying counts against it: noise nets out), and once a prefix's rent covers the
  copy's cost there, that request makes the copy (ski rental). Only where the holder has more
  requests in flight than the other and a free slot (a queue is priced per request, as above),
  and not where the copy would push out prefixes found cached there (journal.Holdings against
  the blocks no running request holds). routing_sim, 80 cells x 8 seeds, cost-model@4:
  s64/room1.5 uniform and zipf r1 1.24 and 1.10 -> 1.00 and 0.98 x the best baseline, r0 1.11
  -> 1.06 x; within 3% 71 -> 74 cells, misses beyond the noise 4 -> 2; TTFT p90 over the 80
  cells' geometric mean 1.001 x before, the worst s8/room4/uniform/r0 65 -> 157 ms (NGINX's
  1051) (bench/results/routing_sim-20261127T232412Z.json against -232418Z, bench/README.md).
  With the rent kept while the holder is not ahead and equal holders taken in turn (`_rent_or_buy`,
  `_evaluate`'s ties): within 3% in 75, none beyond the noise (routing_sim-20261128T015514Z.json).
- Until every candidate has rates (an instance borrows those of a busy one of its shape; the
  prefill rate needs a significant fit, cost_model.SIGNIFICANCE) and the token ratio is
  calibrated (the first seconds), the cost is the batches queued
  there less one where the prompt's prefix is cached: a holder keeps its prefix until its
  queue is a batch longer than the shortest (a cold start's misses pile requests up, and a
  prefix split there stays split). With a stale
  snapshot (or no TRT-LLM metrics) the requests there are ours alone.

The data-plane workers share the snapshots, the global in-flight counts, the prefix index, the
prompt tokens pending prefill at each instance (journal.Pending over dataplane/shared_pending.py)
and the blocks and requests routed to each instance (journal.WriteLog over two more such files:
the eviction estimate counts every worker's routings since a prefix; with each worker's own, a
prefix looked cached long after the others' blocks had pushed it out). The rest of the journal
is each worker's own: the token ratio's prompt lengths and the estimates' error. Workers decide
alike only as far as those agree.

Each choice leaves `last_reason` (the routing-decision counters: `hit` where the chosen
instance holds the most of the prompt, `spill` where another holds more, `miss` where none
holds any, `load` without a prompt) and `last_decision`, whose `first_token(seconds)` the proxy
calls with the observed TTFT (the estimate's error; the end of its prefill).
"""

from __future__ import annotations

import math
import random
import time
import zlib
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from orchestrator import native
from orchestrator.health.engine_state import EngineSnapshot, EngineView
from orchestrator.routing.backends import Backend
from orchestrator.routing.cost_model import RateBook, Rates, cached_blocks
from orchestrator.routing.journal import ErrorMeter, Journal, Pending
from orchestrator.routing.llm_policies import RouteHints, SharedTurns, Turns
from orchestrator.routing.prefix_index import DEFAULT_CHUNK_CHARS, PrefixIndex
from orchestrator.routing.tokens import TokenRatio
from orchestrator.routing.view_listeners import subscribe

HIT, SPILL, MISS, LOAD = "hit", "spill", "miss", "load"
# _price compiled (_cost_pass.c), or None (not built, or TRTLLM_ORCH_PURE_PYTHON=1): read at each
# call, so tests run both.
NATIVE = native.load("orchestrator.routing._cost_pass")


class _Inst:
    """One instance as the choice reads it, refreshed by each of its snapshots."""

    __slots__ = ("iid", "key", "view", "stale_after_s", "at", "foreign", "slots", "rates", "prefill_s",
                 "decode_s", "wait_unit", "kv_free", "block", "kv_blocks", "log", "pending")

    def __init__(self, iid: str, journal: Journal) -> None:
        self.iid = iid
        self.key = iid.encode()
        self.view: EngineView | None = None
        self.stale_after_s = 0.0
        self.at = -math.inf  # the snapshot's time: none yet
        self.foreign = 0  # requests the engine holds that we did not send
        self.slots = 0  # what runs at once
        self.rates: Rates | None = None
        self.prefill_s = self.decode_s = 0.0  # the rates' own, at hand for the choice
        self.wait_unit = 0.0  # seconds a queued request waits per request ahead of it
        self.kv_free = 0  # KV blocks not held by running requests
        self.block = 0
        self.kv_blocks = 0
        self.log = journal.log(iid)
        self.pending = journal.pending(iid)


PricedPass = tuple[list[float], list[int], float, float, float, int, float]


def _price(cands: Sequence[_Inst], inflight: Mapping[str, int], tokens: int, cached: Mapping[str, int], least: int,
           others: Mapping[str, float] | None, now: float, calibrated: bool) -> tuple[bool, PricedPass | None]:
    """The choice's pass over its candidates (compiled where built: NATIVE.price, the same pass;
    tests/test_cost_policy.py holds them to the same numbers on random states). Returns
    (fresh: every candidate's snapshot is, priced), priced None where the estimate has no seconds
    yet (the ratio not `calibrated`, or a candidate without rates), else each candidate's cost
    in seconds and its requests (ours from every worker, plus what its engine holds that we did
    not send where every snapshot is fresh), the lowest cost, the least decode iteration (the
    tolerance before the estimates' error is known), and where a copy of the best-cached prefix
    would cost least were it made (its cost then, its index or -1, the copy's price there).

    A candidate's cost is cost_model.ttft_estimate inline, with the prompt tokens pending
    prefill there (its own worker's ledger, `others`: the other workers'), plus what the choice
    costs the others where it computes tokens the best-cached instance (`least` tokens to
    compute) would not: engine time for nothing, and what waits for a slot there waits for it."""
    fresh = True
    rated = calibrated
    for inst in cands:
        if now - inst.at > inst.stale_after_s:
            fresh = False
        if inst.rates is None:
            rated = False
    if not rated:
        return fresh, None
    get = inflight.get
    costs: list[float] = []
    ns: list[int] = []
    copy_low, copy_at, copy_buy = math.inf, -1, 0.0
    low = tol = math.inf
    for inst in cands:
        iid = inst.iid
        n = get(iid, 0) + inst.foreign if fresh else get(iid, 0)
        p = inst.prefill_s
        uncached = tokens - cached[iid] if iid in cached else tokens
        pending = inst.pending
        heap = pending.heap  # Pending.at only where an entry is due: a call per candidate was 1/8 of a pick
        queued = (pending.total if heap[0][0] > now else pending.at(now)) if heap else 0.0
        if others:
            queued += others.get(iid, 0.0)
        cost = p * (queued + uncached) + inst.decode_s
        slots = inst.slots
        if n >= slots:
            cost += (n - slots + 1) * inst.wait_unit
        if uncached > least:
            over = p * (uncached - least) * (n - slots + 1 if n >= slots else 1)
            cost += over
            buy = over + p * (uncached - least)  # and the copy's own prefill
            if cost - buy < copy_low:
                copy_low, copy_at, copy_buy = cost - buy, len(costs), buy
        costs.append(cost)
        ns.append(n)
        if cost < low:
            low = cost
        if inst.decode_s < tol:
            tol = inst.decode_s
    return fresh, (costs, ns, low, tol, copy_low, copy_at, copy_buy)


class Decision:
    """One choice, for the metrics and for what the proxy observes of it later."""

    __slots__ = ("instance", "at", "reason", "estimate_s", "prompt_tokens", "cached_tokens", "_entry", "_meter")

    def __init__(self, instance: str, at: float, reason: str, estimate_s: float | None, prompt_tokens: int,
                 cached_tokens: int, entry: list | None, meter: "ErrorMeter | None" = None) -> None:
        self.instance = instance
        self.at = at  # the policy's clock (monotonic)
        self.reason = reason
        self.estimate_s = estimate_s  # None: no rates yet
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = cached_tokens
        self._entry = entry
        self._meter = meter

    def first_token(self, seconds: float) -> float | None:
        """The first token came `seconds` after the pick: its prefill is done. Returns the
        estimate's error (observed - estimated), None where there was no estimate."""
        entry, self._entry = self._entry, None
        if entry is not None:
            Pending.done(entry)
        if self.estimate_s is None:
            return None
        error = seconds - self.estimate_s
        meter, self._meter = self._meter, None
        if meter is not None:
            meter.add(error)
        return error

    def abandoned(self) -> None:
        """The attempt failed before a first token (the request was retried elsewhere or ended):
        its prefill is pending there no more, and there is no error to learn from."""
        entry, self._entry = self._entry, None
        if entry is not None:
            Pending.done(entry)
        self._meter = None


class CostModel:
    wants_prompt = True

    def __init__(self, rng: random.Random, clock: Callable[[], float] = time.monotonic,
                 index: PrefixIndex | None = None, journal: Journal | None = None,
                 count_tokens: Callable[[str], int] | None = None, chunk_chars: int = DEFAULT_CHUNK_CHARS,
                 turns: SharedTurns | None = None) -> None:
        self._rng = rng
        self._turns: Turns | SharedTurns = turns if turns is not None else Turns()
        self._clock = clock
        self.index = index if index is not None else PrefixIndex(clock=clock)
        self._recency = getattr(self.index, "match_recency", None)
        self.journal = journal if journal is not None else Journal()
        self.chunk_chars = chunk_chars
        self.ratio = TokenRatio(count_tokens, self.journal.prompts)
        self.book = RateBook()
        self._insts: dict[str, _Inst] = {}
        self._seen: Sequence[Backend] | None = None  # the ready set last listened to
        self._seen_insts: list[_Inst] = []  # its instances, in its order
        self._inflight: Mapping[str, int] = {}  # what the last choice was handed (global counts)
        self.learn_errors = 0
        self.last_reason = ""
        self.last_decision: Decision | None = None

    # --- learning ----------------------------------------------------------------------------
    def observe(self, iid: str, snap: EngineSnapshot) -> None:
        """Every snapshot of instance `iid`, in order (its EngineView's listener)."""
        try:
            moved = self.book.observe(iid, snap)
            if moved is not None:
                self.ratio.engine(*moved)
            inst = self._insts.get(iid)
            if inst is not None and snap.has_engine:
                self._refresh(inst, snap)
                # every worker's routings there so far, noted for the write log's "since"
                inst.log.sample(self._clock(), 2.0 * (inst.kv_blocks or 1))
        except Exception:  # noqa: BLE001 - a learning bug must not break the engine monitor
            self.learn_errors += 1

    def _refresh(self, inst: _Inst, snap: EngineSnapshot) -> None:
        er = self.book.engines[inst.iid]
        inst.at = snap.at
        # What the engine holds beyond what we have in flight there now: another proxy's, a
        # direct client's. Our count may have moved since the scrape: a request or two for a
        # scrape interval, and it errs towards fewer. (Not the snapshot's `routed`: that counts
        # as the default's latest choice read them, and this policy's choices write none.)
        inst.foreign = max(0, snap.active + snap.pending - self._inflight.get(inst.iid, 0))
        inst.slots = er.running()
        inst.kv_free = er.kv_blocks - snap.kv_used
        inst.kv_blocks = er.kv_blocks
        inst.block = er.block_tokens
        r = inst.rates = self.book.rates(inst.iid)
        if r is not None:
            inst.prefill_s, inst.decode_s = r.prefill_s, r.decode_s
            if inst.slots:
                inst.wait_unit = r.out_tokens * r.iter_s / inst.slots

    def _sync(self, backends: Sequence[Backend]) -> None:
        """Listen to the views of a new ready set (an instance new to us, or back with a new view)."""
        for b in backends:
            inst = self._insts.get(b.instance_id)
            if inst is None:
                inst = self._insts[b.instance_id] = _Inst(b.instance_id, self.journal)
            view = b.engine
            if inst.view is view:
                continue
            inst.view = view
            if view is None:
                inst.at = -math.inf
                continue
            inst.stale_after_s = view.stale_after_s
            subscribe(self, b.instance_id, view)
        self._seen = backends
        self._seen_insts = [self._insts[b.instance_id] for b in backends]

    # --- choice --------------------------------------------------------------------------------
    def choose(self, backends: Sequence[Backend], skip: Collection[str], inflight: Mapping[str, int],
               hints: RouteHints | None = None) -> Backend | None:
        now = self._clock()
        found = self._evaluate(backends, skip, inflight, hints, now)
        if found is None:
            return None
        inst, chosen, reason, estimate, tokens, cached, rent, held = found
        if rent is not None:
            self.journal.rents.pay(*rent)
        if held is not None and inst.block:
            self.journal.holdings.found(inst.iid, held, cached // inst.block, now)
        iid = inst.iid
        self._turns.chosen(iid, now)
        entry = None
        if estimate is not None and tokens > cached:
            entry = inst.pending.add(tokens - cached, now + estimate)
        if hints is not None:
            if hints.prompt_keys:
                self.index.record(hints.prompt_keys, iid)
                if self._recency is None:  # the index keeps no times: the journal does
                    inst.log.touch(hints.prompt_keys, now)
            self.ratio.prompt(hints.prompt_chars, hints.text)
        if inst.block:
            inst.log.add(now, (tokens - cached) / inst.block, 2.0 * (inst.kv_blocks or 1))
        self.last_reason = reason
        self.last_decision = Decision(iid, now, reason, estimate, tokens, cached, entry, self.journal.errors)
        return chosen

    def _evaluate(self, backends: Sequence[Backend], skip: Collection[str], inflight: Mapping[str, int],
                  hints: RouteHints | None, now: float
                  ) -> tuple[_Inst, Backend, str, float | None, int, int, tuple[bytes | None, float] | None,
                             bytes | None] | None:
        """The pick and why, changing nothing: (instance, its backend, reason, TTFT estimate, tokens,
        cached, the prefix's rent to keep or None, the key of the prefix found cached there or None)."""
        self._inflight = inflight
        if backends is not self._seen:
            self._sync(backends)
        insts = self._insts
        ready = backends  # the whole ready set: what the shared files' spans are cached for
        if skip:
            backends = [b for b in backends if b.instance_id not in skip]
            cands = [insts[b.instance_id] for b in backends]
        else:
            cands = self._seen_insts
        if not cands:
            return None
        # Seconds need rates and prompt lengths in tokens: until the token ratio is calibrated
        # (the first finished requests, or the tokenizer's first sample) a prompt's prefill is
        # a guess off by the tokenizer's characters per token (4x on BPE against the byte twin).
        calibrated = self.ratio.source != "prior"
        ratio = self.ratio.value
        tokens = int(hints.prompt_chars * ratio) if hints is not None else 0
        keys = hints.prompt_keys if hints is not None else ()
        cached: dict[str, int] = {}
        best_cached = 0  # the most tokens cached at one instance
        top = 0  # the most chunks matched where any is counted as cached (keys[top - 1]: the rent's key)
        if keys:
            if self._recency is not None:
                depth = self._recency(keys)[1]
            else:  # an index that keeps no times: the journal's
                depth = {}
                for iid, d in self.index.match(keys)[1].items():
                    inst = insts.get(iid)
                    # None (another worker routed it): what the index holds counts as cached
                    depth[iid] = (d, inst.log.last(keys[d - 1]) if inst is not None else None)  # type: ignore[arg-type]
            chunk_chars, at_most = self.chunk_chars, max(0, tokens - 1)  # one token is always computed
            for iid, (d, last) in depth.items():
                inst = insts.get(iid)
                if inst is None:
                    continue
                matched = min(int(d * chunk_chars * ratio), at_most)
                if inst.block:
                    blocks = matched // inst.block
                    if last is not None and inst.kv_blocks:
                        written, routed = inst.log.since(last)
                        blocks = cached_blocks(blocks, written, routed, inst.slots, inst.kv_free)
                    matched = blocks * inst.block
                # else no engine numbers yet: an engine reports none before its first iteration,
                # so a burst at start-up saw no holder at all and spread every tenant by load
                # (the real twin: the first visit's picks all `miss`, 128 of 697 in
                # s64/room4/uniform/closed). What the index holds counts, unrounded.
                if matched:
                    cached[iid] = matched
                    if d > top:
                        top = d
                    if matched > best_cached:
                        best_cached = matched
        least = tokens - best_cached  # what the best-cached instance would compute
        # the other workers' pending prefill (None: not shared, or none there); seconds are priced with it
        others = (self.journal.others(ready) or None) if calibrated else None
        compiled = NATIVE
        found = compiled.price(cands, inflight, tokens, cached, least, others, now, calibrated) \
            if compiled is not None else None
        fresh, priced = found if found is not None else _price(cands, inflight, tokens, cached, least, others, now,
                                                              calibrated)
        learnt = priced is not None
        tol = 0.0
        if priced is not None:
            costs, ns, low, tol, copy_low, copy_at, copy_buy = priced
        else:  # no seconds yet (the first second or so): batches queued, a cached prefix worth one
            get = inflight.get
            costs, ns = [], []
            copy_at = -1
            low = math.inf
            for inst in cands:
                n = get(inst.iid, 0) + inst.foreign if fresh else get(inst.iid, 0)
                slots = inst.slots or 1
                cost = max(0, n - slots + 1) / slots - (1.0 if inst.iid in cached else 0.0) - \
                    cached.get(inst.iid, 0) * 1e-9
                costs.append(cost)
                ns.append(n)
                if cost < low:
                    low = cost
        if learnt and cached and self.journal.errors.value > tol:
            # What the estimates miss by is not told apart where a cached prefix is at stake: a
            # move on noise splits a tenant for good (the new copy thrashes), while without one
            # a wrong pick costs that request alone and the finest estimate is the best guess
            # (tolerance everywhere: s8/room1.5/unique/r2 TTFT p90 1798 -> 2000 ms, mixed/r2 +4%).
            tol = self.journal.errors.value
        bound = low + tol
        near = [i for i, c in enumerate(costs) if c <= bound]
        most = 0
        if len(near) > 1 and cached:  # among near-equals, the cache stays where it is
            most = max(cached.get(cands[i].iid, 0) for i in near)
            near = [i for i in near if cached.get(cands[i].iid, 0) == most]
        if len(near) > 1:
            fewest = min(ns[i] for i in near)
            near = [i for i in near if ns[i] == fewest]
        if len(near) == 1:
            pick = near[0]
        elif most:
            # Every one of them holds the prompt's prefix: taken in turn, as NGINX's least_conn
            # takes its equals. By the checksum (below) all of a tenant's ties went to one of them,
            # and where a few tenants were most of the load that one ran busier: bench/routing_sim.py,
            # 80 cells x 8 seeds, cost-model@4, s64/room1.5/uniform/r0 1.041 -> 1.033 x the best
            # baseline's TTFT p90, zipf/r0 1.034 -> 1.026, none beyond the seeds' noise (2 before);
            # geometric mean 0.998 x, the worst cell s64/room4/uniform/r1 1.16 x (103 -> 119 ms, 0.08 x
            # the best baseline). Where none holds it the checksum still keeps a tenant together.
            tied = [backends[i] for i in near]
            pick = near[tied.index(self._turns.oldest(tied))]
        elif hints is not None:
            key = hints.route_key
            pick = max(near, key=lambda i: zlib.crc32(cands[i].key, key))
        else:
            pick = self._rng.choice(near)
        rent = None
        if copy_at >= 0 and top and cached.get(cands[pick].iid, 0) == best_cached and ns[pick] < cands[pick].slots:
            pick, rent = self._rent_or_buy(keys[top - 1], pick, costs[pick] - copy_low, copy_at, copy_buy, ns, cands,
                                           best_cached, now)
        inst = cands[pick]
        got = cached.get(inst.iid, 0)
        if hints is None:
            reason = LOAD
        elif best_cached == 0:
            reason = MISS
        elif got >= best_cached:
            reason = HIT
        else:
            reason = SPILL
        estimate = None
        if learnt:  # without the delay the choice imposes on the others
            r: Any = inst.rates  # learnt: every candidate has its rates
            n = ns[pick]
            queued = inst.pending.total + (others.get(inst.iid, 0.0) if others else 0.0)
            estimate = r.prefill_s * (queued + tokens - got) + r.decode_s + \
                ((n - inst.slots + 1) * inst.wait_unit if n >= inst.slots else 0.0)
        # the prefix found there, where the pick holds the most of the prompt (Holdings)
        held = keys[top - 1] if top and got and got >= best_cached else None
        return inst, backends[pick], reason, estimate, tokens, got, rent, held

    def _rent_or_buy(self, key: bytes | None, pick: int, gain: float, alt: int, buy: float, ns: list[int],
                     cands: list[_Inst], prefix_tokens: int, now: float
                     ) -> tuple[int, tuple[bytes | None, float] | None]:
        """The pick holds the prompt's best-cached prefix, and `alt` would cost `gain` less with a
        copy of it (`buy`: what the copy costs there). This request pays that difference (rent)
        for staying; once the rent that requests of this prefix have paid reaches the copy's
        price, the copy is made: this request goes there. Ski rental: no request alone pays for a
        copy, yet every later one would gain from it, so a busy holder of a popular prefix
        otherwise keeps it for ever (64-slot engines, where nothing queues and the holder's
        longer iterations are the whole cost). The rent is returned, not kept: the choice keeps
        it (`_evaluate` changes nothing)."""
        if ns[pick] <= ns[alt]:
            # The holder is not busier now: this request's loss is the pending prefill's noise (a
            # tenant's own requests arriving together), not load, and pays nothing. The rent paid
            # while it was busier is kept: at a light load it is ahead only now and then, and
            # forgetting the rent at each pause kept the copy from ever being bought there
            # (bench/routing_sim.py, 80 cells x 8 seeds, cost-model@4: s64/room1.5 tenant cells at
            # r0 1.056-1.060 x the best baseline's TTFT p90 -> 1.034-1.041 x; 8 cells changed,
            # none for the worse). Accruing while the two are even instead changed 15 cells, the
            # worst 1.19 x (s8/room4/uniform/r0).
            return pick, None
        there = cands[alt]
        if there.block and there.kv_free - self.journal.holdings.blocks(there.iid, now - self.index.ttl_s) < \
                prefix_tokens / there.block:
            # the copy would push out prefixes found cached there: a copy costs a copy there
            return pick, None
        # What this request loses (or gains, below 0) by staying, were the copy made: the net
        # of those is the rent, so noise that falls either way pays nothing over time.
        paid = self.journal.rents.get(key) + gain
        if paid >= buy:
            return alt, (key, 0.0)
        return pick, (key, max(0.0, paid))

    def forget(self, instance_id: str) -> None:
        """The instance restarts: its cache is gone (its shape's rates stay: the same engine)."""
        self.index.forget_instance(instance_id)
        self.book.forget(instance_id)
        self.journal.forget(instance_id)
        inst = self._insts.get(instance_id)
        if inst is not None:
            inst.log = self.journal.log(instance_id)
            inst.pending = self.journal.pending(instance_id)
