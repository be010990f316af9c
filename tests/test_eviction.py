"""routing/eviction.py: whether a prefix routed to an instance is surely gone from its KV cache,
judged from the engine's own counters, and what prefix-affinity does with the verdict."""

from __future__ import annotations

import gc
import math
import random

import pytest

from orchestrator.health.engine_state import EngineSnapshot, EngineView
from orchestrator.routing.backends import Backend
from orchestrator.routing.eviction import KEEP_S, KvWrites
from orchestrator.routing.llm_policies import PrefixAffinity, RouteHints
from orchestrator.routing.prefix_index import PrefixIndex

pytestmark = pytest.mark.unit

TPB = 64


def engine(at, finished=0, prompt_tokens=0, output_tokens=0, reused=0, free=100, max_active=8, waiting=0,
           scheduled=0):
    return EngineSnapshot(at=at, max_active=max_active, waiting=waiting, scheduled=scheduled, kv_max=200,
                          kv_free=free, kv_used=200 - free, tokens_per_block=TPB, kv_reused=reused,
                          iteration=1.0, input_tokens=prompt_tokens, finished=finished,
                          output_tokens=output_tokens)


def written(finished, blocks, reused=0, free=100, at=10.0, **kw):
    """An engine that, since t=1, finished `finished` requests computing `blocks` new blocks."""
    w = KvWrites()
    w.observe(engine(1.0, free=free, **kw))
    w.observe(engine(at, finished=finished, prompt_tokens=(blocks + reused) * TPB, reused=reused, free=free, **kw))
    return w


def test_gone_once_a_free_pool_of_blocks_was_computed_by_as_many_requests_as_run():
    assert written(finished=8, blocks=100).gone(0.5)
    assert not written(finished=8, blocks=99).gone(0.5)  # one block of the pool may still be it
    assert not written(finished=7, blocks=500).gone(0.5)  # the request that carried it may still hold it


def test_cache_hits_are_not_writes():
    # 40 requests of a tenant whose prefix is cached: 400 prompt blocks, all but 40 reused.
    assert not written(finished=40, blocks=40, reused=360).gone(0.5)


def test_reuses_counted_at_the_start_do_not_make_requests_finishing_later_count_whole():
    # 10 queued requests of a cached tenant start (their 32 reused blocks each counted then),
    # and finish after the prefix was routed again: their prompt tokens arrive in a span that
    # holds none of their reuse. Counted whole, 335 blocks, more than the free pool.
    w = KvWrites()
    w.observe(engine(1.0))
    w.observe(engine(5.0, reused=320))
    w.observe(engine(7.0, reused=320))
    w.observe(engine(10.0, finished=10, prompt_tokens=335 * TPB, reused=320))
    assert not w.gone(6.0)
    # A tenant whose prompts the cache did not hold: the same span is computed blocks.
    w = KvWrites()
    w.observe(engine(1.0))
    w.observe(engine(7.0))
    w.observe(engine(10.0, finished=10, prompt_tokens=335 * TPB))
    assert w.gone(6.0)


def test_a_kv_bound_engine_runs_fewer_than_its_slots():
    # 3 of 8 slots scheduled while others wait for blocks: 3 finished requests are enough.
    assert written(finished=3, blocks=20, free=10, waiting=5, scheduled=3).gone(0.5)
    assert not written(finished=3, blocks=20, free=10).gone(0.5)


def test_only_what_came_after_the_routing_counts():
    w = KvWrites()
    w.observe(engine(1.0))
    w.observe(engine(2.0, finished=8, prompt_tokens=100 * TPB))
    w.observe(engine(3.0, finished=9, prompt_tokens=101 * TPB))
    assert w.gone(0.5)  # before both: 9 requests, 101 blocks
    assert not w.gone(1.5)  # after the big one: 1 request, 1 block
    assert not w.gone(3.0)  # nothing scraped since


def test_no_counters_or_no_block_size_judges_nothing_gone():
    w = KvWrites()
    assert not w.gone(0.0)
    for t in range(1, 50):  # an engine that exports no histograms and no reuse
        w.observe(EngineSnapshot(at=float(t), max_active=8, kv_max=200, kv_free=0, tokens_per_block=TPB,
                                 iteration=float(t)))
    assert not w.gone(0.5)
    w2 = KvWrites()
    w2.observe(engine(1.0))
    w2.observe(EngineSnapshot(at=2.0, finished=50, input_tokens=10**6, iteration=1.0))  # no tokens_per_block
    assert not w2.gone(0.5)


def test_an_engine_restart_starts_the_count_again():
    w = written(finished=8, blocks=100)
    w.observe(engine(11.0, finished=1, prompt_tokens=2 * TPB))  # counters went back
    assert not w.gone(0.5)


def test_samples_are_kept_for_a_window_and_older_routings_get_a_lower_bound():
    w = KvWrites()
    for t in range(0, int(3 * KEEP_S)):
        w.observe(engine(float(t), finished=t // 10, prompt_tokens=(t // 10) * TPB))
    assert len(w._samples) <= KEEP_S + 2
    # routed long before the oldest kept sample: what was computed in the window (~6 requests,
    # ~6 blocks) is too little for a pool of 100
    assert not w.gone(-1000.0)
    w.observe(engine(3 * KEEP_S, finished=100, prompt_tokens=300 * TPB))
    assert w.gone(-1000.0)


def first_scrape_after_verdict(scrapes, routed_at):
    """The verdict as the module doc states it, read off the scrapes directly: from the first scrape
    after the routing, the engine finished as many requests as it runs and computed its free pool."""
    tpb = TPB
    after = [s for s in scrapes if s.at > routed_at]
    if not after:
        return False
    since, last = after[0], scrapes[-1]
    window = (last.input_tokens - scrapes[0].input_tokens) / tpb
    hit = min(1.0, (last.kv_reused - scrapes[0].kv_reused) / window) if window > 0 else 0.0
    running = last.scheduled if last.waiting > 0 and last.scheduled > 0 else last.max_active
    if last.finished - since.finished < max(1, running):
        return False
    computed = (last.input_tokens - since.input_tokens) / tpb * (1 - hit) + \
        (last.output_tokens - since.output_tokens) / tpb
    return computed >= max(1, last.kv_free)


@pytest.mark.parametrize("seed", range(40))
def test_the_verdict_worked_out_per_scrape_is_the_first_scrape_after_verdict_for_every_routing_time(seed):
    # `gone` compares with one cutoff found at each scrape; it must answer as judging from the
    # first scrape after the routing does, for a routing between any two scrapes, on engines
    # that finish, compute and reuse at random rates.
    rng = random.Random(seed)
    w = KvWrites()
    scrapes: list[EngineSnapshot] = []
    finished = prompt = output = reused = 0
    for k in range(rng.randrange(2, 60)):
        finished += rng.choice((0, 0, 1, 2, 5))
        new_prompt = rng.randrange(0, 40) * TPB
        prompt += new_prompt
        reused += int(new_prompt / TPB * rng.random())
        output += rng.randrange(0, 10) * TPB
        waiting = rng.choice((0, 0, 3))
        snap = engine(float(k), finished=finished, prompt_tokens=prompt, output_tokens=output, reused=reused,
                      free=rng.randrange(1, 80), waiting=waiting, scheduled=rng.randrange(1, 8))
        w.observe(snap)
        scrapes.append(snap)
        for routed_at in (-1.0, *(t + d for t in range(k + 1) for d in (-0.5, 0.0, 0.5))):
            assert w.gone(routed_at) == first_scrape_after_verdict(scrapes, routed_at), (k, routed_at)


# --- prefix-affinity with the verdict -------------------------------------------------------------
SYSTEM = "You are a helpful assistant for tenant {0}. " * 40  # ~1.6k chars: several chunks


def hints(tenant: int, question: str) -> RouteHints:
    return RouteHints.from_prompt(SYSTEM.format(tenant) + question)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def backends_at(clock, *snaps):
    out = []
    for i, s in enumerate(snaps):
        view = EngineView(stale_after_s=1.0)
        view.update(s)
        out.append(Backend(str(i), "127.0.0.1", 1, 2, 3, engine=view))
    return out


def scrape(backends, *snaps):
    for b, s in zip(backends, snaps):
        b.engine.update(s)


def test_a_holder_that_surely_evicted_the_prefix_is_a_miss():
    clock = Clock()
    policy = PrefixAffinity(random.Random(1), clock=clock, index=PrefixIndex(clock=clock))
    bs = backends_at(clock, engine(clock.t), engine(clock.t))
    holder = policy.choose(bs, (), {}, hints(1, "turn 1")).instance_id
    other = "1" if holder == "0" else "0"
    # The holder has one more request in flight: within the slack, the prefix keeps it there...
    inflight = {holder: 1, other: 0}
    clock.t += 1.0
    assert policy.choose(bs, (), inflight, hints(1, "turn 2")).instance_id == holder
    assert policy.last_reason == "prefix"
    # ...until its engine has computed a free pool's worth of blocks since (other prompts).
    clock.t += 0.1
    scrape(bs, engine(clock.t), engine(clock.t))
    clock.t += 5.0
    snaps = {holder: engine(clock.t, finished=20, prompt_tokens=150 * TPB), other: engine(clock.t)}
    scrape(bs, snaps["0"], snaps["1"])
    assert policy.choose(bs, (), inflight, hints(1, "turn 3")).instance_id == other
    assert policy.last_reason == "prefix-evicted"


def test_a_split_prefix_goes_back_to_the_copy_that_is_left():
    clock = Clock()
    index = PrefixIndex(clock=clock)
    policy = PrefixAffinity(random.Random(1), clock=clock, index=index)
    bs = backends_at(clock, engine(clock.t), engine(clock.t))
    policy.choose(bs, (), {}, hints(9, "another tenant"))  # the policy sees the engines before
    keys = list(hints(4, "q").prompt_keys)
    index.record(keys, "0")  # routed to both: a spill made a second copy
    clock.t += 1.0
    index.record(keys, "1")
    clock.t += 0.1
    scrape(bs, engine(clock.t), engine(clock.t))
    policy.choose(bs, (), {}, hints(9, "another tenant"))
    clock.t += 1.0
    # Instance 1 then computed a whole pool of other prompts; instance 0 kept serving the tenant
    # (its prompts reused the prefix: little was written).
    index.record(keys, "0")
    clock.t += 1.0
    scrape(bs, engine(clock.t, finished=30, prompt_tokens=300 * TPB, reused=280),
           engine(clock.t, finished=30, prompt_tokens=300 * TPB))
    # Instance 0 carries 3 more requests: by load alone the tenant would go to 1.
    assert policy.choose(bs, (), {"0": 3, "1": 0}, hints(4, "q2")).instance_id == "0"
    assert policy.last_reason == "prefix"


def test_every_scrape_reaches_the_verdict_without_a_choice_between():
    """The policy listens to the engine views: the scrape right after a routing is the verdict's
    start, whether or not a request came in between (pulled at each choice, it was missed, and
    the next scrape's work counted from itself: nothing ever looked computed)."""
    clock = Clock()
    policy = PrefixAffinity(random.Random(1), clock=clock, index=PrefixIndex(clock=clock))
    bs = backends_at(clock, engine(clock.t), engine(clock.t))
    holder = policy.choose(bs, (), {}, hints(2, "turn 1")).instance_id
    clock.t += 0.1
    scrape(bs, engine(clock.t), engine(clock.t))
    clock.t += 5.0
    scrape(bs, *(engine(clock.t, finished=20, prompt_tokens=150 * TPB) if b.instance_id == holder
                 else engine(clock.t) for b in bs))
    assert policy.choose(bs, (), {holder: 1}, hints(2, "turn 2")).instance_id != holder
    assert policy.last_reason == "prefix-evicted"


def test_a_replaced_prefix_affinity_stops_listening():
    clock = Clock()
    bs = backends_at(clock, engine(clock.t), engine(clock.t))
    policy = PrefixAffinity(random.Random(1), clock=clock, index=PrefixIndex(clock=clock))
    policy.choose(bs, (), {}, None)
    assert len(bs[0].engine.listeners) == 1
    del policy
    gc.collect()
    scrape(bs, engine(clock.t + 0.1), engine(clock.t + 0.1))  # nobody behind the listener: nothing happens
    new = PrefixAffinity(random.Random(1), clock=clock, index=PrefixIndex(clock=clock))
    new.choose(bs, (), {}, None)
    assert len(bs[0].engine.listeners) == 1  # the dead one's listener made room for the new one


def test_a_worker_that_starts_late_judges_eviction_as_the_daemon_does():
    """A data-plane worker started (or a policy made by a reload) after a prefix was routed sees
    the engine's snapshots from then on only: from those alone nothing looked computed since, and
    it sent the tenant back to a holder every other worker judged evicted. The daemon's verdict,
    sent with each snapshot (controlplane/workers.py, `gone_before`), is the same for all."""
    import copy
    import dataclasses

    clock = Clock()
    index = PrefixIndex(clock=clock)
    verdicts = {"0": KvWrites(), "1": KvWrites()}  # the daemon's, over every snapshot since the instances joined

    def sent(iid: str, snap: EngineSnapshot) -> EngineSnapshot:
        verdicts[iid].observe(snap)
        return dataclasses.replace(snap, gone_before=verdicts[iid].gone_before)

    early = PrefixAffinity(random.Random(1), clock=clock, index=index)
    bs = backends_at(clock, sent("0", engine(clock.t)), sent("1", engine(clock.t)))
    holder = early.choose(bs, (), {}, hints(1, "turn 1")).instance_id
    clock.t += 0.1
    scrape(bs, sent("0", engine(clock.t)), sent("1", engine(clock.t)))
    clock.t += 5.0
    latest = {iid: sent(iid, engine(clock.t, finished=20, prompt_tokens=150 * TPB) if iid == holder
                        else engine(clock.t)) for iid in ("0", "1")}
    scrape(bs, latest["0"], latest["1"])

    def late_worker() -> PrefixAffinity:
        """A worker that connects now: the routing as the shared index has it; it gets the latest
        snapshots only (the feed's catch-up)."""
        return PrefixAffinity(random.Random(2), clock=clock, index=copy.deepcopy(index))

    late, unaided = late_worker(), late_worker()
    chosen_late = late.choose(backends_at(clock, latest["0"], latest["1"]), (), {holder: 1}, hints(1, "turn 2"))
    without = {iid: dataclasses.replace(s, gone_before=None) for iid, s in latest.items()}  # an older daemon
    chosen_unaided = unaided.choose(backends_at(clock, without["0"], without["1"]), (), {holder: 1},
                                    hints(1, "turn 2"))
    chosen_early = early.choose(bs, (), {holder: 1}, hints(1, "turn 2"))
    assert chosen_early.instance_id != holder and early.last_reason == "prefix-evicted"
    assert chosen_late.instance_id == chosen_early.instance_id and late.last_reason == "prefix-evicted"
    # what the verdict fixes: from its own snapshots alone the late worker judged the prefix there
    assert chosen_unaided.instance_id == holder and unaided.last_reason == "prefix"
    # A daemon restarted under live restore knows nothing of the past yet (-inf): the workers it
    # adopted keep the verdict of what they saw.
    clock.t += 0.1
    fresh_daemon = [dataclasses.replace(engine(clock.t, finished=20, prompt_tokens=150 * TPB) if iid == holder
                                        else engine(clock.t), gone_before=-math.inf) for iid in ("0", "1")]
    scrape(bs, *fresh_daemon)
    # (turn 2 made a copy where it went: by load alone the holder, idle now, would take turn 3)
    other = chosen_early.instance_id
    assert early.choose(bs, (), {holder: 0, other: 1}, hints(1, "turn 3")).instance_id == other
    assert early.last_reason == "prefix"
