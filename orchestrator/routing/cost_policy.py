"""`cost-model`: each request goes where its estimated time to first token is lowest. Pure logic.

For every candidate instance the policy estimates, in seconds (cost_model.ttft_estimate):
the wait for a batch slot (the requests there, ours from every worker plus what its engine
holds that we did not send, beyond its slots, each freeing its slot after `out_tokens`
iterations), plus the prefill of this prompt's tokens not likely cached there (the prefix
index, in tokens: tokens.py) and of the prompt tokens routed there before it and not yet
prefilled (`PrefillLedger`), plus the iteration running now. The rates come from the engine's
own scrapes (cost_model.EngineRates), so the trade between a cached prefix and a queue is made
in the engine's units whatever its shape: a multi-turn chat stays where its history is cached
while the prefill it saves there outweighs the queue in front of it, and moves when it does not.

Near-equal estimates (within one iteration of the best: below what the estimate can tell apart)
are broken by rendezvous hashing of the prompt's head with the instance id, so every
data-plane worker picks alike and a new prefix lands on one instance rather than on all.

Until an instance has learnt its rates (its engine has not been busy yet) it borrows those of
an instance of the same shape (slots, KV blocks, block size); while some candidate has neither,
every candidate is measured in batch fractions (requests there over slots), so costs stay
comparable. With a stale snapshot (or no TRT-LLM metrics) the requests there are ours alone.

Each choice leaves `last_reason` (for the routing-decision counters: `hit` where the chosen
instance holds the most of the prompt, `spill` where another holds more, `miss` where no
instance holds any, `load` without a prompt) and `last_decision`, whose `first_token(seconds)`
the proxy calls with the observed TTFT (the estimate's error, and the end of its prefill).
"""

from __future__ import annotations

import heapq
import math
import random
import time
import weakref
import zlib
from collections.abc import Callable, Collection, Mapping, Sequence

from orchestrator.routing.backends import Backend
from orchestrator.routing.cost_model import RateBook, WriteLog, cached_blocks, ttft_estimate
from orchestrator.routing.llm_policies import InflightHistory, RouteHints
from orchestrator.routing.prefix_index import DEFAULT_CHUNK_CHARS, PrefixIndex
from orchestrator.routing.tokens import TokenRatio

HIT, SPILL, MISS, LOAD = "hit", "spill", "miss", "load"


class PrefillLedger:
    """Prompt tokens routed to each instance whose prefill has not happened yet, as far as this
    process knows: each entry ends at its first token or at its estimated first token."""

    __slots__ = ("_heaps", "_sums")

    def __init__(self) -> None:
        self._heaps: dict[str, list[list]] = {}
        self._sums: dict[str, float] = {}

    def add(self, iid: str, tokens: float, until: float) -> list:
        entry = [until, tokens, iid]
        heapq.heappush(self._heaps.setdefault(iid, []), entry)
        self._sums[iid] = self._sums.get(iid, 0.0) + tokens
        return entry

    def pending(self, iid: str, now: float) -> float:
        heap = self._heaps.get(iid)
        if not heap:
            return 0.0
        total = self._sums[iid]
        while heap and heap[0][0] <= now:
            entry = heapq.heappop(heap)
            total -= entry[1]
            entry[1] = 0.0  # a first token reported after this changes nothing
        if not heap:
            total = 0.0  # no float drift left behind
        self._sums[iid] = total
        return total

    def done(self, entry: list) -> None:
        tokens, entry[1] = entry[1], 0.0
        iid = entry[2]
        if tokens and iid in self._sums:
            self._sums[iid] = max(0.0, self._sums[iid] - tokens)

    def forget(self, iid: str) -> None:
        self._heaps.pop(iid, None)
        self._sums.pop(iid, None)


class Decision:
    """One choice, for the metrics and for what the proxy observes of it later."""

    __slots__ = ("instance", "reason", "estimate_s", "prompt_tokens", "cached_tokens", "_entry", "_ledger")

    def __init__(self, instance: str, reason: str, estimate_s: float | None, prompt_tokens: int,
                 cached_tokens: int, entry: list | None, ledger: PrefillLedger) -> None:
        self.instance = instance
        self.reason = reason
        self.estimate_s = estimate_s  # None: rates not learnt yet (measured in batch fractions)
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = cached_tokens
        self._entry = entry
        self._ledger = ledger

    def first_token(self, seconds: float) -> float | None:
        """The proxy saw the first token after `seconds`: the prefill is done. Returns the
        estimate's error (observed - estimated), None where there was no estimate."""
        if self._entry is not None:
            self._ledger.done(self._entry)
            self._entry = None
        return None if self.estimate_s is None else seconds - self.estimate_s


class _Listener:
    """An EngineView listener that does not keep the policy alive (a reload replaces it)."""

    __slots__ = ("_policy", "_iid", "__weakref__")

    def __init__(self, policy: "CostModel", iid: str) -> None:
        self._policy = weakref.ref(policy)
        self._iid = iid

    def __call__(self, snap) -> None:
        policy = self._policy()
        if policy is not None:
            policy.observe(self._iid, snap)


class CostModel:
    wants_prompt = True

    def __init__(self, rng: random.Random, clock: Callable[[], float] = time.monotonic,
                 index: PrefixIndex | None = None, count_tokens: Callable[[str], int] | None = None,
                 chunk_chars: int = DEFAULT_CHUNK_CHARS, social: bool = True) -> None:
        self._rng = rng
        self._clock = clock
        self.index = index if index is not None else PrefixIndex(clock=clock)
        self._recency = getattr(self.index, "match_recency", None)
        self.chunk_chars = chunk_chars
        self.social = social
        self.ratio = TokenRatio(count_tokens)
        self.book = RateBook()
        self.ledger = PrefillLedger()
        self._writes: dict[str, WriteLog] = {}  # instance id -> blocks routed there to compute
        self.history = InflightHistory()
        self._views: dict[str, object] = {}  # instance id -> the EngineView we listen to
        self._id_bytes: dict[str, bytes] = {}
        self.learn_errors = 0
        self.last_reason = ""
        self.last_decision: Decision | None = None

    # --- learning ----------------------------------------------------------------------------
    def observe(self, iid: str, snap) -> None:
        """Every snapshot of instance `iid`, in order (the EngineView's listener)."""
        try:
            moved = self.book.observe(iid, snap)
            if moved is not None:
                self.ratio.engine(*moved)
        except Exception:  # noqa: BLE001 - a learning bug must not break the engine monitor
            self.learn_errors += 1

    def _listen(self, b: Backend) -> None:
        view = b.engine
        iid = b.instance_id
        self._id_bytes[iid] = iid.encode()
        self._views[iid] = view
        if view is None:
            return
        listener = _Listener(self, iid)
        listeners = view.listeners
        # Listeners of policies a reload replaced have nothing behind them: drop them here.
        listeners[:] = [x for x in listeners if not (isinstance(x, _Listener) and x._policy() is None)]
        listeners.append(listener)
        if view.latest is not None:
            self.observe(iid, view.latest)

    # --- choice --------------------------------------------------------------------------------
    def choose(self, backends: Sequence[Backend], skip: Collection[str], inflight: Mapping[str, int],
               hints: RouteHints | None = None) -> Backend | None:
        now = self._clock()
        book = self.book
        engines = book.engines
        views = self._views
        cands: list[Backend] = []
        fresh = True
        for b in backends:
            iid = b.instance_id
            if views.get(iid, self) is not b.engine:  # new to us, or a new view (it restarted)
                self._listen(b)
            if iid in skip:
                continue
            cands.append(b)
            if fresh:
                er = engines.get(iid)
                snap = er.last if er is not None else None
                if snap is None or now - snap.at > b.engine.stale_after_s:
                    fresh = False
        if not cands:
            return None
        keys = hints.prompt_keys if hints is not None else ()
        ratio = self.ratio.value
        tokens = int(hints.prompt_chars * ratio) if hints is not None else 0
        depth: dict[str, tuple[int, float | None]] = {}
        if keys:
            if self._recency is not None:
                depth = self._recency(list(keys))[1]
            else:  # an index that keeps no times: what it holds counts as cached
                depth = {iid: (d, None) for iid, d in self.index.match(list(keys))[1].items()}
        history = self.history
        logs = self._writes
        learnt = True
        rows = []  # (backend, rates, slots, requests there, cached tokens)
        for b in cands:
            iid = b.instance_id
            er = engines.get(iid)
            n = inflight.get(iid, 0)
            snap = er.last if er is not None else None
            if fresh:
                # What the engine holds that we did not send (another proxy, a direct client).
                then = history.at(iid, snap.at)
                n += max(0, snap.active + snap.pending - (n if then is None else then))
            r = book.rates(iid)
            if r is None:
                learnt = False
            slots = er.running() if er is not None else 0
            cached = 0
            d = depth.get(iid)
            if d and er is not None:
                block = er.block_tokens or 1
                blocks = min(int(d[0] * self.chunk_chars * ratio), max(0, tokens - 1)) // block
                if d[1] is not None and snap is not None and er.kv_blocks:
                    log = logs.get(iid)
                    written, routed = log.since(d[1]) if log is not None else (0.0, 0)
                    blocks = cached_blocks(blocks, written, routed, slots, er.kv_blocks - snap.kv_used)
                cached = blocks * block
            rows.append((b, r, slots, n, cached))
        best_cached = max(row[4] for row in rows)
        ttfts: list[float] = []
        if learnt:
            costs = []
            tol = math.inf
            social = self.social
            ledger = self.ledger
            least = tokens - best_cached
            for b, r, slots, n, cached in rows:
                ttft = ttft_estimate(r, slots, n, ledger.pending(b.instance_id, now) + tokens - cached)
                ttfts.append(ttft)
                # Prompt tokens computed here that the best-cached instance would not compute:
                # engine time spent for nothing, and every request running here waits for it.
                extra = r.prefill_s * (tokens - cached - least)
                costs.append(ttft + extra * (n if social == 2 else min(n, slots)) if social else ttft)
                tol = min(tol, r.decode_s)
        else:  # until every candidate has rates: batches queued; among equals the most cached
            costs = [max(0, n - slots + 1) / (slots or 1) - cached * 1e-9 for _, _, slots, n, cached in rows]
            tol = 0.0
        low = min(costs)
        near = [i for i, c in enumerate(costs) if c <= low + tol]
        if len(near) > 1:  # below what the estimate tells apart: the fewest requests there,
            fewest = min(rows[i][3] for i in near)  # then a hash every worker computes alike
            near = [i for i in near if rows[i][3] == fewest]
        if len(near) == 1:
            pick = near[0]
        elif hints is not None:
            key = hints.route_key
            ids = self._id_bytes
            pick = max(near, key=lambda i: zlib.crc32(ids[rows[i][0].instance_id], key))
        else:
            pick = self._rng.choice(near)
        b, r, slots, n, cached = rows[pick]
        iid = b.instance_id
        if hints is None:
            reason = LOAD
        elif best_cached == 0:
            reason = MISS
        elif cached >= best_cached:
            reason = HIT
        else:
            reason = SPILL
        estimate = ttfts[pick] if learnt else None
        entry = None
        if estimate is not None and tokens > cached:
            entry = self.ledger.add(iid, tokens - cached, now + estimate)
        if keys:
            self.index.record(list(keys), iid)
        er = engines.get(iid)
        if er is not None and er.block_tokens:
            log = self._writes.get(iid)
            if log is None:
                log = self._writes[iid] = WriteLog()
            log.add(now, (tokens - cached) / er.block_tokens, 2.0 * (er.kv_blocks or 1))
        if hints is not None:
            self.ratio.prompt(hints.prompt_chars)
        history.note(now, (b,), inflight, iid)
        self.last_reason = reason
        self.last_decision = Decision(iid, reason, estimate, tokens, cached, entry, self.ledger)
        return b

    def forget(self, instance_id: str) -> None:
        """The instance restarts: its cache is gone (its shape's rates stay: the same engine)."""
        self.index.forget_instance(instance_id)
        self.ledger.forget(instance_id)
        self._writes.pop(instance_id, None)
        self.book.forget(instance_id)
