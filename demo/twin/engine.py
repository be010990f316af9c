"""In-flight batching engine model: what a TRT-LLM executor does, minus the GPU.

One `step()` is one executor iteration:
1. cancelled requests (queued or active) finish, freeing their slot and KV blocks;
2. queued requests move into the active set while it has fewer than max_batch_size;
3. the scheduler picks this iteration's requests: a request in context phase needs
   its KV blocks first. Blocks are allocated as a sequence grows (its prompt, then one
   more whenever a token starts a new block) under both policies; guaranteed_no_evict
   admits a request only if the free blocks, less what every running sequence still
   needs to reach its max_new_tokens, cover all it will need (TRT-LLM's
   NoEvictScheduledBlocksManager), so nothing ever waits for a block once started;
   max_utilization admits on the prompt alone and pauses a sequence when no block is
   left. A request that cannot get blocks stays active but unscheduled ("waiting");
4. every scheduled request gets one token; the iteration costs decode_ms plus
   prefill_ms_per_token for each prompt token not served from the KV cache.

Nothing here sleeps or reads a clock except through the injected `clock_ns`; the
loop in twin.loop turns `Iteration.duration_s` into time. Thread-safe: enqueue and
cancel may be called from any thread while one loop calls step().
"""
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from .kvcache import KvCache
from .tokens import prompt_seed, token_at

POLICIES = ("guaranteed_no_evict", "max_utilization")


def queue_full_message(max_queue_size):
    # The text TRT-LLM's executor throws from enqueueRequests (see trtllm-facts.md §2).
    return f"Maximum queue size of {max_queue_size} has been reached, please try again later"


class EngineError(Exception):
    """A request the engine refuses; str() is the client-visible message."""


class QueueFullError(EngineError):
    pass


@dataclass
class EngineConfig:
    max_batch_size: int = 64                  # in-flight slots (triton_max_batch_size)
    max_queue_size: int = 0                   # queued, not yet active; 0 = unlimited
    max_tokens_in_paged_kv_cache: int = 65536
    tokens_per_block: int = 64
    enable_kv_cache_reuse: bool = True
    batch_scheduler_policy: str = "guaranteed_no_evict"
    decode_ms: float = 20.0                   # one generation step of the whole batch
    prefill_ms_per_token: float = 0.05        # per uncached prompt token in context phase

    def __post_init__(self):
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if self.batch_scheduler_policy not in POLICIES:
            raise ValueError(f"batch_scheduler_policy must be one of {POLICIES}")


@dataclass(eq=False)
class Sequence:
    """One request inside the engine. `on_event` (if set) is called by the loop."""
    req_id: object
    prompt: list
    max_new_tokens: int
    end_id: object = None
    stop_words: list = field(default_factory=list)   # token-id sequences that end generation
    bad_words: list = field(default_factory=list)    # single-token ones are never generated
    on_event: object = None
    # engine state
    generated: list = field(default_factory=list)
    alloc: object = None
    reused_blocks: int = 0
    finish_reason: object = None
    arrival_ns: int = 0
    first_scheduled_ns: int = 0

    def __post_init__(self):
        self.prompt = [int(t) for t in self.prompt]
        self._seed = prompt_seed(self.prompt)
        self._banned = frozenset(int(w[0]) for w in self.bad_words if len(w) == 1)

    def next_token(self):
        return token_at(self._seed, len(self.generated), self._banned)


@dataclass
class Event:
    seq: Sequence
    tokens: list          # new tokens this iteration (empty for a cancel)
    finished: bool
    reason: object        # None, "length", "end_id", "stop_words", "cancelled"


@dataclass
class Stats:
    """One iteration's numbers, named after TRT-LLM's metric labels."""
    iteration: int
    timestamp_us: int
    active: int
    max: int
    scheduled: int
    context: int
    waiting: int                 # active - scheduled, as the TRT-LLM backend computes it
    queued: int                  # executor queue: NOT exported by TRT-LLM
    total_context_tokens: int
    generation_requests: int
    paused_requests: int
    kv_max: int
    kv_free: int
    kv_used: int
    kv_tokens_per: int
    kv_reused: int
    kv_fraction: float


@dataclass
class Iteration:
    events: list
    duration_s: float
    stats: Stats


class Engine:
    def __init__(self, config=None, clock_ns=time.time_ns):
        self.config = config or EngineConfig()
        self.clock_ns = clock_ns
        c = self.config
        self.kv = KvCache(c.max_tokens_in_paged_kv_cache, c.tokens_per_block, c.enable_kv_cache_reuse)
        self.queue = deque()
        self.active = []
        self.iteration = 0
        self._cancelled = set()
        self._lock = threading.Lock()

    # --- any thread -----------------------------------------------------------------
    def enqueue(self, seq):
        c = self.config
        if seq.max_new_tokens < 1:
            raise EngineError("request_output_len must be >= 1")
        if self.kv.blocks_for(len(seq.prompt) + seq.max_new_tokens) > self.kv.max_blocks:
            # It could never be scheduled: fail now instead of blocking the queue forever.
            raise EngineError(
                f"Prompt length ({len(seq.prompt)}) plus output length ({seq.max_new_tokens}) exceeds the "
                f"paged KV cache ({self.kv.max_blocks} blocks of {c.tokens_per_block} tokens)")
        with self._lock:
            # Requests that the next iteration moves into free slots are not "queued":
            # the loop only fetches at iteration start, TRT-LLM's fetches continuously.
            waiting = len(self.queue) - max(0, c.max_batch_size - len(self.active))
            if c.max_queue_size > 0 and waiting >= c.max_queue_size:
                raise QueueFullError(queue_full_message(c.max_queue_size))
            seq.arrival_ns = self.clock_ns()
            self.queue.append(seq)

    def cancel(self, req_id):
        """Takes effect at the start of the next iteration."""
        with self._lock:
            self._cancelled.add(req_id)

    def has_work(self):
        with self._lock:
            return bool(self.queue or self.active or self._cancelled)

    # --- the loop's thread ----------------------------------------------------------
    def step(self):
        with self._lock:
            return self._step()

    def _step(self):
        c, kv = self.config, self.kv
        now = self.clock_ns()
        events = []

        if self._cancelled:
            for seq in [s for s in self.queue if s.req_id in self._cancelled]:
                self.queue.remove(seq)
                events.append(self._finish(seq, "cancelled", []))
            for seq in [s for s in self.active if s.req_id in self._cancelled]:
                self.active.remove(seq)
                events.append(self._finish(seq, "cancelled", []))
            self._cancelled.clear()

        while self.queue and len(self.active) < c.max_batch_size:
            self.active.append(self.queue.popleft())

        scheduled, context, paused = [], 0, 0
        context_tokens = 0
        blocked = False   # FIFO: once a context request waits for blocks, later ones wait too
        no_evict = c.batch_scheduler_policy == POLICIES[0]
        # guaranteed_no_evict: blocks the running sequences still need to finish are spoken for.
        held = sum(self._blocks_to_completion(s) for s in self.active if s.alloc is not None) if no_evict else 0
        for seq in self.active:
            if seq.alloc is None:
                if blocked:
                    continue
                full = len(seq.prompt) + seq.max_new_tokens
                alloc = kv.allocate(seq.prompt, len(seq.prompt) + 1,
                                    must_fit_tokens=full if no_evict else None, held_blocks=held)
                if alloc is None:
                    blocked = True
                    continue
                if no_evict:
                    held += self._blocks_to_completion(seq, alloc)
                seq.alloc, seq.reused_blocks = alloc, alloc.reused
                seq.first_scheduled_ns = seq.first_scheduled_ns or now
                context += 1
                context_tokens += len(seq.prompt) - alloc.reused * c.tokens_per_block
            else:
                before = len(seq.alloc.blocks)
                if not kv.grow(seq.alloc, len(seq.prompt) + len(seq.generated) + 1):
                    paused += 1
                    continue
                if no_evict:
                    held -= len(seq.alloc.blocks) - before
            scheduled.append(seq)

        duration_ms = (c.decode_ms if scheduled else 0.0) + c.prefill_ms_per_token * context_tokens
        stats_active = len(self.active)
        for seq in scheduled:
            tok = seq.next_token()
            seq.generated.append(tok)
            reason = self._finish_reason(seq, tok)
            if reason:
                self.active.remove(seq)
                events.append(self._finish(seq, reason, [tok]))
            else:
                events.append(Event(seq, [tok], False, None))

        self.iteration += 1
        stats = Stats(
            iteration=self.iteration, timestamp_us=now // 1000,
            active=stats_active, max=c.max_batch_size, scheduled=len(scheduled), context=context,
            waiting=stats_active - len(scheduled), queued=len(self.queue),
            total_context_tokens=context_tokens, generation_requests=len(scheduled) - context,
            paused_requests=paused,
            kv_max=kv.max_blocks, kv_free=kv.free_blocks, kv_used=kv.used_blocks,
            kv_tokens_per=c.tokens_per_block, kv_reused=kv.reused_blocks_total,
            kv_fraction=(kv.used_blocks / kv.max_blocks) if kv.max_blocks else 0.0,
        )
        return Iteration(events, duration_ms / 1000.0, stats)

    def _blocks_to_completion(self, seq, alloc=None):
        alloc = alloc or seq.alloc
        return max(0, self.kv.blocks_for(len(seq.prompt) + seq.max_new_tokens) - len(alloc.blocks))

    @staticmethod
    def _finish_reason(seq, tok):
        if seq.end_id is not None and tok == seq.end_id:
            return "end_id"
        for word in seq.stop_words:
            if word and seq.generated[-len(word):] == list(word):
                return "stop_words"
        if len(seq.generated) >= seq.max_new_tokens:
            return "length"
        return None

    def _finish(self, seq, reason, tokens):
        seq.finish_reason = reason
        if seq.alloc is not None:
            self.kv.release(seq.alloc)
        return Event(seq, tokens, True, reason)
