"""Whether a prompt prefix routed to an instance is surely gone from its KV cache by now, from
what its engine reported since. Pure logic.

The prefix index (prefix_index.py, dataplane/shared_prefix.py) remembers where each prefix was
routed for ten minutes; an engine keeps it far shorter when its cache is busy. While a request
that uses the prefix runs, its blocks are held. After that they sit in the free pool as
reusable blocks, and each block the engine computes later takes a free one: plain free blocks
first, then the cached one used least recently (TRT-LLM's block reuse; demo/twin/kvcache.py).
So the prefix is surely gone once, since it was last routed there, the engine

  - finished at least as many requests as it runs at once (so the request that carried the
    prefix is no longer holding it), and
  - computed at least as many blocks as its free pool holds now: everything that was free,
    the prefix included, has been handed out since.

"Surely gone", not an estimate of how much is left (cost_model.cached_blocks does that): a
holder judged gone that still has the prefix loses it a request, and for a shared prefix it
splits the tenant between two caches for good (llm_policies' DEFAULT_SLACK). A gone prefix
judged present costs what it cost before this test existed: the request is sent to wait for a
cache it will not find. That is the multi-turn chat cell of bench/routing_cells.py on 8 slots
(its caches hold two or three conversations, every turn's history is evicted before the next
turn): prefix-affinity kept each conversation where its history had been, its instances queued,
TTFT p90 1.34-1.50 x NGINX least_conn's on the GPU machine (bench/README.md).

What the engine computed comes from its cumulative counters. The daemon judges from every
snapshot since the instance joined and sends its verdict with each one (controlplane/workers.py,
EngineSnapshot.gone_before), so every data-plane worker judges alike, one started after the
routing too (from the snapshots since its own start it judged "still there"). Each verdict is
sure, so a policy keeps the later of the daemon's and its own cutoff (a daemon restarted under
live restore knows less than the workers it adopted); one without the daemon's (the simulator, a
worker under an older daemon) judges from what it saw. The counters: the prompt and output
tokens of the requests it finished (nv_llm_input/output_token_len's sums) over the block size,
and the prompt blocks it took from the cache (`reused`). Those move at different instants: a
reuse when a request starts, its tokens when it ends, seconds apart when requests queue.
Subtracting the reuses of a span from the tokens of the same span was wrong by whole prompts: on
the GPU machine (routing_matrix_device.sh, 8 tenants of 2048-token prefixes, 32 blocks of 33.5 reused)
a span in which queued requests finished counted their 33.5 blocks each as computed, and
prefixes still cached were judged gone (TTFT p90 617-743 ms -> 1442-3950, KV hit 0.86 -> 0.76).
So the prompt blocks of a span count at the hit rate of the whole kept window (KEEP_S), where
starts and ends balance: computed = prompt blocks x (1 - hit rate) + output blocks.
Where an engine exports no such counters (older TRT-LLM versions), they stay 0 and nothing is
judged gone: prefix-affinity routes as it did before.

Tried and dropped: counting also what the requests queued ahead at the holder would compute
before a request sent now gets a slot (the window's mean per request times the queue). A
tenant's own queued requests reuse its prefix and keep it the most recently used, which that
ignored: in bench/routing_sim.py's 8-slot tenant cells a third to two thirds of the choices
became `prefix-evicted`, KV hit rate 0.81-0.94 -> 0.57-0.80, TTFT p90 up to 9x (s8/room4/uniform/r1
3.3 -> 30.7 s), for 1.41 -> 1.07 x the best baseline on s8/room1.5/chat/r1.
"""

from __future__ import annotations

import math
from collections import deque

from orchestrator.health.engine_state import EngineSnapshot

# Samples kept: a prefix last routed before the oldest is judged on what was computed since the
# oldest (a lower bound). At one scrape per 100 ms, 600 samples per instance.
KEEP_S = 60.0


class KvWrites:
    """One instance's engine at each scrape: (time, prompt blocks, output blocks, reused blocks,
    requests finished), the counts cumulative; and, worked out at each scrape, the verdict for
    every routing time at once (`gone_before`)."""

    __slots__ = ("_samples", "free", "running", "hit", "gone_before")

    def __init__(self) -> None:
        self._samples: deque[tuple[float, float, float, int, int]] = deque()
        self.free = 0  # free blocks (plain and cached) at the last scrape
        self.running = 0  # requests the engine runs at once
        self.hit = 0.0  # the kept window's prompt blocks taken from the cache, as a fraction
        # A prefix last routed here before this monotonic time is surely gone (-inf: none is).
        self.gone_before = -math.inf

    def observe(self, snap: EngineSnapshot) -> None:
        """A snapshot of this instance's engine (the same one again changes nothing)."""
        samples = self._samples
        if samples and snap.at <= samples[-1][0]:
            return
        tpb = snap.tokens_per_block
        if not tpb:
            return
        if samples and (snap.finished < samples[-1][4] or snap.kv_reused < samples[-1][3]):
            samples.clear()  # the engine restarted: its counters began again
        samples.append((snap.at, snap.input_tokens / tpb, snap.output_tokens / tpb, snap.kv_reused, snap.finished))
        while len(samples) > 2 and samples[1][0] < snap.at - KEEP_S:
            samples.popleft()
        self.free = snap.kv_free
        # Requests waiting for KV blocks: the batch is what the cache lets run, not the slots.
        self.running = snap.scheduled if snap.waiting > 0 and snap.scheduled > 0 else snap.max_active
        first, last = samples[0], samples[-1]
        window = last[1] - first[1]
        self.hit = min(1.0, (last[3] - first[3]) / window) if window > 0 else 0.0
        self.gone_before = self._cutoff()

    def gone(self, routed_at: float) -> bool:
        """Whether a prefix last routed here at monotonic `routed_at` is surely evicted by now."""
        return routed_at < self.gone_before

    def _cutoff(self) -> float:
        """The time of the latest scrape from which on the engine surely overwrote what it held
        (`gone_before`), or -inf. Judged from the first scrape after the routing: what finished
        between the routing and that scrape is not counted (the verdict errs towards "still
        there"); routed before the oldest kept scrape, what was computed since the oldest (a lower
        bound). The counters only grow, so the earlier that scrape the surer the verdict: the
        latest one it holds for is found by bisection, once per scrape rather than per holder of
        every decision's prompt."""
        samples = self._samples
        if not self._surely_gone(samples[0]):
            return -math.inf
        lo, hi = 0, len(samples) - 1  # it holds from samples[lo], never from the last (nothing since)
        while hi - lo > 1:
            mid = (lo + hi) >> 1
            if self._surely_gone(samples[mid]):
                lo = mid
            else:
                hi = mid
        return samples[lo][0]

    def _surely_gone(self, since: tuple[float, float, float, int, int]) -> bool:
        """Whether what was cached before scrape `since` is surely gone by the last scrape."""
        last = self._samples[-1]
        if last[4] - since[4] < max(1, self.running):
            return False
        computed = (last[1] - since[1]) * (1.0 - self.hit) + last[2] - since[2]
        return computed >= max(1, self.free)
