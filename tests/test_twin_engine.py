"""Unit tests of the TRT-LLM twin's engine model (demo/twin), no Triton, no sleeping."""
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "demo"))
from twin import tokens  # noqa: E402
from twin.engine import Engine, EngineConfig, EngineError, QueueFullError, Sequence, queue_full_message  # noqa: E402
from twin.kvcache import KvCache  # noqa: E402
from twin.loop import EngineLoop  # noqa: E402


def make(**kw):
    kw.setdefault("decode_ms", 10.0)
    kw.setdefault("prefill_ms_per_token", 1.0)
    return Engine(EngineConfig(**kw), clock_ns=lambda: 0)


def seq(rid, prompt, n, **kw):
    if isinstance(prompt, str):
        prompt = tokens.encode(prompt)
    return Sequence(rid, prompt, n, **kw)


def run_all(engine, limit=10_000):
    """Step until idle; returns [(iteration, Event)] and the list of Iterations."""
    events, its = [], []
    while engine.has_work() and limit:
        it = engine.step()
        its.append(it)
        events += [(it.stats.iteration, e) for e in it.events]
        limit -= 1
    return events, its


def finish_iter(events):
    return {e.seq.req_id: i for i, e in events if e.finished}


def test_batching_limit_and_fifo_queue():
    e = make(max_batch_size=2)
    for i in range(6):
        e.enqueue(seq(i, f"p{i}", 3))
    it = e.step()
    s = it.stats
    assert (s.active, s.scheduled, s.waiting, s.queued, s.max) == (2, 2, 0, 4, 2)
    assert {ev.seq.req_id for ev in it.events} == {0, 1}
    events, its = run_all(e)
    done = finish_iter(events)
    # Waiting requests run in arrival order, each pair 3 steps after the previous one.
    assert done == {0: 3, 1: 3, 2: 6, 3: 6, 4: 9, 5: 9}
    assert max(i.stats.scheduled for i in its) == 2


def test_tokens_do_not_depend_on_batch():
    alone = make()
    alone.enqueue(seq("a", "same prompt", 5))
    ev_alone, _ = run_all(alone)
    busy = make(max_batch_size=3)
    for i in range(5):
        busy.enqueue(seq(i, f"other {i}", 7))
    busy.enqueue(seq("a", "same prompt", 5))
    ev_busy, _ = run_all(busy)
    got = lambda evs: [t for _, ev in evs if ev.seq.req_id == "a" for t in ev.tokens]  # noqa: E731
    assert got(ev_alone) == got(ev_busy) == tokens.next_tokens(tokens.encode("same prompt"), 5)


def test_queue_limit_rejects_with_trtllm_text():
    e = make(max_batch_size=1, max_queue_size=2)
    for i in range(3):
        e.enqueue(seq(i, "x", 2))
    # The first takes the free slot at the next iteration; the limit counts the other two.
    with pytest.raises(QueueFullError) as exc:
        e.enqueue(seq(9, "x", 2))
    assert str(exc.value) == "Maximum queue size of 2 has been reached, please try again later"
    assert str(exc.value) == queue_full_message(2)
    e.step()
    e.step()                       # request 0 is done: request 1 takes its slot next
    e.enqueue(seq(10, "x", 2))
    with pytest.raises(QueueFullError):
        e.enqueue(seq(11, "x", 2))


def test_unlimited_queue_when_zero():
    e = make(max_batch_size=1, max_queue_size=0)
    for i in range(500):
        e.enqueue(seq(i, "x", 1))


def test_iteration_cost_decode_plus_uncached_prefill():
    e = make(decode_ms=10.0, prefill_ms_per_token=0.5, enable_kv_cache_reuse=False)
    e.enqueue(seq("a", [1] * 100, 3))
    first = e.step()
    assert first.duration_s == pytest.approx((10 + 0.5 * 100) / 1000)
    assert (first.stats.context, first.stats.total_context_tokens) == (1, 100)
    second = e.step()
    assert second.duration_s == pytest.approx(10 / 1000)
    assert (second.stats.context, second.stats.generation_requests) == (0, 1)


def test_kv_accounting_guaranteed_no_evict_and_waiting():
    # 4 blocks of 16 tokens; each request needs prompt + max_new = 20 tokens = 2 blocks to
    # finish. guaranteed_no_evict admits it only while those can be had (the blocks the
    # running ones still need are spoken for), but allocates as the sequence grows, as
    # TRT-LLM's block manager does: `used` counts allocated blocks, not reservations.
    e = make(max_batch_size=4, max_tokens_in_paged_kv_cache=64, tokens_per_block=16, enable_kv_cache_reuse=False)
    for i in range(3):
        e.enqueue(seq(i, [i + 1] * 10, 10))
    it = e.step()
    s = it.stats
    assert (s.kv_max, s.kv_used, s.kv_free, s.kv_tokens_per) == (4, 2, 2, 16)   # one prompt block each
    assert s.kv_fraction == 0.5
    # The third request is active but cannot get blocks: TRT-LLM's "waiting".
    assert (s.active, s.scheduled, s.waiting) == (3, 2, 1)
    for _ in range(5):                       # tokens 2..6: positions 10..15, still one block
        assert e.step().stats.kv_used == 2
    s = e.step().stats                       # token 7 sits at position 16: a second block each
    assert (s.kv_used, s.kv_free, s.scheduled, s.waiting) == (4, 0, 2, 1)
    events, its = run_all(e)
    done = finish_iter(events)
    assert done[0] == done[1] == 10 and done[2] == 20
    assert its[-1].stats.kv_used == 0 and its[-1].stats.kv_free == 4


def test_guaranteed_no_evict_never_pauses_max_utilization_may():
    # 3 blocks of 16; two requests of 10 + 20 tokens (2 blocks each to finish).
    for policy, admitted_first in (("guaranteed_no_evict", 1), ("max_utilization", 2)):
        e = make(max_batch_size=2, max_tokens_in_paged_kv_cache=48, tokens_per_block=16,
                 enable_kv_cache_reuse=False, batch_scheduler_policy=policy)
        e.enqueue(seq(0, [1] * 10, 20))
        e.enqueue(seq(1, [2] * 10, 20))
        assert e.step().stats.scheduled == admitted_first, policy
        paused = max(it.stats.paused_requests for it in run_all(e, limit=200)[1])
        assert paused == (0 if policy == "guaranteed_no_evict" else 1), policy


def test_request_larger_than_cache_is_refused():
    e = make(max_tokens_in_paged_kv_cache=64, tokens_per_block=16)
    with pytest.raises(EngineError, match="exceeds the paged KV cache"):
        e.enqueue(seq(0, [1] * 60, 10))


def test_max_utilization_pauses_instead_of_reserving():
    e = make(max_batch_size=2, max_tokens_in_paged_kv_cache=32, tokens_per_block=16,
             batch_scheduler_policy="max_utilization", enable_kv_cache_reuse=False)
    e.enqueue(seq(0, [1] * 15, 10))
    e.enqueue(seq(1, [2] * 15, 10))
    s = e.step().stats
    assert (s.scheduled, s.kv_used) == (2, 2)     # both started: only their prompts are held
    s = e.step().stats                            # both need a second block, none left
    assert s.paused_requests == 2 and s.scheduled == 0
    # They never finish on their own here; max_utilization without eviction would stall,
    # which is why guaranteed_no_evict is TRT-LLM's default.


def test_prefix_reuse_hit_skips_prefill_and_miss_does_not():
    tpb = 16
    e = make(tokens_per_block=tpb, max_tokens_in_paged_kv_cache=64 * tpb, prefill_ms_per_token=1.0, decode_ms=0)
    prompt = list(range(1, 101))                  # 100 tokens: 6 full blocks
    e.enqueue(seq("a", prompt, 1))
    first = e.step()
    assert first.stats.total_context_tokens == 100
    e.enqueue(seq("b", prompt, 1))
    hit = e.step()
    assert hit.events[0].seq.reused_blocks == 6
    assert hit.stats.total_context_tokens == 100 - 6 * tpb
    assert hit.stats.kv_reused == 6
    # Same length, different first token: the chain differs from block 0, nothing reused.
    e.enqueue(seq("c", [999] + prompt[1:], 1))
    miss = e.step()
    assert miss.events[0].seq.reused_blocks == 0 and miss.stats.total_context_tokens == 100
    # Shared prefix then divergence: only the leading equal blocks are reused.
    e.enqueue(seq("d", prompt[:40] + [7] * 60, 1))
    part = e.step()
    assert part.events[0].seq.reused_blocks == 40 // tpb


def test_reuse_never_covers_the_last_prompt_token():
    e = make(tokens_per_block=16, max_tokens_in_paged_kv_cache=1024, decode_ms=0)
    prompt = list(range(1, 33))                   # exactly 2 blocks
    e.enqueue(seq("a", prompt, 1))
    e.step()
    e.enqueue(seq("b", prompt, 1))
    it = e.step()
    assert it.events[0].seq.reused_blocks == 1 and it.stats.total_context_tokens == 16


def test_reuse_off_never_reuses():
    e = make(tokens_per_block=16, max_tokens_in_paged_kv_cache=1024, enable_kv_cache_reuse=False)
    prompt = list(range(1, 101))
    for rid in ("a", "b"):
        e.enqueue(seq(rid, prompt, 1))
        it = e.step()
        assert it.stats.total_context_tokens == 100 and it.stats.kv_reused == 0


def test_lru_keeps_recently_used_prefix():
    kv = KvCache(max_tokens=6 * 16, tokens_per_block=16, enable_reuse=True)
    old, recent, new = [1] * 33, [2] * 33, [3] * 33
    kv.release(kv.allocate(old, 33))     # 3 blocks; 2 cached
    kv.release(kv.allocate(recent, 33))  # 3 more; all 6 touched, 4 cached
    assert kv.match(old) == 2 and kv.match(recent) == 2
    kv.release(kv.allocate(old, 33))     # reuse old: now old is most recently used
    kv.release(kv.allocate(new, 33))     # needs 3 blocks: 2 plain free + 1 evicted (LRU)
    assert kv.match(old) == 2            # recently used chain survives
    assert kv.match(recent) == 1         # LRU chain lost its tail block first
    assert kv.evicted_blocks_total == 1


def test_blocks_in_use_are_never_evicted():
    kv = KvCache(max_tokens=4 * 16, tokens_per_block=16, enable_reuse=True)
    held = kv.allocate([5] * 40, 40)     # 3 blocks in use
    assert kv.allocate([6] * 40, 40) is None
    assert kv.free_blocks == 1
    kv.release(held)
    assert kv.allocate([6] * 40, 40) is not None


def test_cancel_frees_slot_and_blocks_at_next_iteration():
    e = make(max_batch_size=1, max_tokens_in_paged_kv_cache=1024, tokens_per_block=16, enable_kv_cache_reuse=False)
    e.enqueue(seq("long", "a long one", 100))
    e.enqueue(seq("next", "next", 2))
    e.enqueue(seq("queued", "queued", 2))
    s = e.step().stats
    assert s.active == 1 and s.kv_used > 0
    e.cancel("long")
    e.cancel("queued")
    it = e.step()
    cancelled = {ev.seq.req_id: ev for ev in it.events if ev.reason == "cancelled"}
    assert set(cancelled) == {"long", "queued"}
    assert cancelled["long"].finished and len(cancelled["long"].seq.generated) == 1  # tokens so far kept
    assert [ev.seq.req_id for ev in it.events if ev.reason != "cancelled"] == ["next"]  # slot reused at once
    assert it.stats.active == 1
    events, its = run_all(e)
    assert its[-1].stats.kv_used == 0


def test_end_id_and_stop_words_end_generation():
    toks = tokens.next_tokens(tokens.encode("stop here"), 6)
    e = make()
    e.enqueue(seq("end", "stop here", 6, end_id=toks[2]))
    e.enqueue(seq("stop", "stop here", 6, stop_words=[toks[3:5]]))
    events, _ = run_all(e)
    out = {}
    for _, ev in events:
        out.setdefault(ev.seq.req_id, []).extend(ev.tokens)
        if ev.finished:
            out[ev.seq.req_id + "_why"] = ev.reason
    assert out["end"] == toks[:3] and out["end_why"] == "end_id"
    assert out["stop"] == toks[:5] and out["stop_why"] == "stop_words"


def test_single_token_bad_words_are_never_generated():
    toks = tokens.next_tokens(tokens.encode("bad"), 8)
    e = make()
    e.enqueue(seq("b", "bad", 8, bad_words=[[toks[0]], [toks[1]]]))
    events, _ = run_all(e)
    got = [t for _, ev in events for t in ev.tokens]
    assert len(got) == 8 and toks[0] not in got and toks[1] not in got


def test_loop_streams_per_iteration_and_ends_with_an_idle_stat():
    clock = [0.0]
    slept = []

    def sleep(s):
        slept.append(s)
        clock[0] += s

    e = make(decode_ms=20.0, prefill_ms_per_token=0.0)
    stats, got, calls = [], [], []
    loop = EngineLoop(e, collective=lambda it: calls.append(it.stats.iteration), on_stats=stats.append,
                      sleep=sleep, clock=lambda: clock[0])
    s = seq("r", "hi", 3, on_event=lambda ev: got.append((clock[0], ev.tokens, ev.finished)))
    loop.submit(s)
    while e.has_work() or loop._final_pending:
        loop.run_once()
    assert [g[1][0] for g in got] == tokens.next_tokens(tokens.encode("hi"), 3)
    assert [round(g[0], 3) for g in got] == [0.02, 0.04, 0.06]       # one token per 20 ms iteration
    assert [g[2] for g in got] == [False, False, True]
    assert [st.active for st in stats] == [1, 1, 1, 0]                  # final stat: active 0
    assert calls == [1, 2, 3, 4]                                        # the collective runs every iteration
    assert slept == [pytest.approx(0.02)] * 3


def test_tokenizer_files_match_token_space():
    import json
    tok_dir = Path(__file__).resolve().parent.parent / "demo" / "tokenizer"
    spec = json.loads((tok_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    assert len(vocab) == tokens.TOTAL_VOCAB == len(set(vocab.values()))
    assert vocab["</s>"] == tokens.END_ID and vocab["<pad>"] == tokens.PAD_ID
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == "</s>" and cfg["pad_token"] == "<pad>"
