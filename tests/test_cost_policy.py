"""The `cost-model` policy on recorded engine snapshots: where a prompt goes and why, what
every data-plane worker decides, what it reports to the metrics, `top` and the Balancer."""

from __future__ import annotations

import gc
import random
from types import MappingProxyType

import pytest

from orchestrator.dataplane.metrics import ProxyMetrics
from orchestrator.dataplane.shared_prefix import SharedPrefixIndex
from orchestrator.health.engine_state import EngineSnapshot, EngineView
from orchestrator.routing.backends import Backend
from orchestrator.routing.balancer import Balancer, SharedRouting
from orchestrator.routing.cost_model import ttft_estimate
from orchestrator.routing.cost_policy import HIT, LOAD, MISS, SPILL, CostModel
from orchestrator.routing.journal import Journal
from orchestrator.routing.llm_policies import RouteHints
from orchestrator.routing.prefix_index import PrefixIndex
from orchestrator.top import render
from tests.test_top_render import STATUS, text_of

pytestmark = pytest.mark.unit

SYSTEM = "[tenant {0}] You are the assistant of tenant {0}. " + "Follow the house rules with care. " * 60


class Clock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Engines:
    """Instances whose views get a busy engine's snapshots: iterations of 20 ms plus 0.1 ms per
    context token, one prompt of 2000 tokens every 4th iteration, 20 output tokens a request."""

    def __init__(self, n: int, clock: Clock, slots: int = 8) -> None:
        self.clock = clock
        self.slots = slots
        self.views = [EngineView(stale_after_s=1.0) for _ in range(n)]
        self.backends = tuple(Backend(str(i), "127.0.0.1", 1, 2, 3, engine=v) for i, v in enumerate(self.views))
        self.k = 0
        self.active = [1] * n

    def scrape(self, rounds: int = 1) -> None:
        for _ in range(rounds):
            self.k += 1
            k = self.k
            self.clock.t += 0.1
            for v, active in zip(self.views, self.active):
                # 5 iterations per scrape; the scraped one had a prompt every other scrape
                v.update(EngineSnapshot(
                    at=self.clock.t, active=active, max_active=self.slots, scheduled=active, kv_max=256, kv_used=50,
                    tokens_per_block=64, iteration=float(5 * k), timestamp_us=int(self._ts(k) * 1e6),
                    context_tokens=2000 if k % 2 else 0,
                    finished=k, input_tokens=2000 * k, output_tokens=20 * k))

    @staticmethod
    def _ts(k: int) -> float:
        # iterations 5(k-1) .. 5k-1: 5 x 20 ms, plus 2000 x 0.1 ms where the first had the prompt
        return sum(0.1 + (0.2 if j % 2 else 0.0) for j in range(1, k))


def learnt(n: int = 2, slots: int = 8, **kw) -> tuple[CostModel, Engines, Clock]:
    clock = Clock()
    eng = Engines(n, clock, slots)
    policy = CostModel(random.Random(1), clock=clock, **kw)
    policy.choose(eng.backends, (), {})  # listens to the views from now on
    # one prompt of the engines' mean length (2000 tokens a finished request): the token ratio
    # calibrates against the input histogram to 1 token per character, as the byte-level twin's
    policy.choose(eng.backends, (), {}, RouteHints.from_prompt("warm-up " * 250))
    eng.scrape(60)
    assert all(policy.book.rates(b.instance_id) is not None for b in eng.backends)
    assert policy.ratio.source == "engine" and policy.ratio.value == 1.0
    return policy, eng, clock


def hints(tenant: int, question: str = "What is the refund policy?") -> RouteHints:
    return RouteHints.from_prompt(SYSTEM.format(tenant) + question)


def test_rates_come_from_the_views_snapshots():
    policy, eng, _ = learnt()
    r = policy.book.rates("0")
    assert r.prefill_s == pytest.approx(0.0001, rel=0.1) and r.out_tokens == pytest.approx(20)


def test_a_prefix_stays_where_it_is_cached_while_that_pays():
    policy, eng, clock = learnt()
    first = policy.choose(eng.backends, (), {}, hints(1)).instance_id
    assert policy.last_reason == MISS
    other = "1" if first == "0" else "0"
    # the holder is busier (4 in flight vs 0) but has free slots: the cached prefix wins
    assert policy.choose(eng.backends, (), {first: 4}, hints(1, "another question")).instance_id == first
    assert policy.last_reason == HIT
    assert policy.last_decision.cached_tokens > 0.8 * policy.last_decision.prompt_tokens
    # a queue there costs more than the prefill the cache saves: it moves
    moved = policy.choose(eng.backends, (), {first: 40, other: 0}, hints(1, "a third question"))
    assert moved.instance_id == other and policy.last_reason == SPILL


def test_a_busy_holder_of_a_popular_prefix_gets_a_copy_once_its_requests_have_paid_for_one():
    # 64 slots: nothing queues, and a holder is costlier only by the prefill routed there and not
    # done yet. Staying costs each request a little; the copy costs one request ~0.4 s. Those
    # little losses add up: the copy is made once they reach its price, long before one request
    # alone would pay it (every question leaves its ~20 tokens pending at the holder here, so
    # that takes over 100 requests).
    policy, eng, clock = learnt(slots=64)
    first = policy.choose(eng.backends, (), {}, hints(1)).instance_id
    policy.last_decision.first_token(policy.last_decision.estimate_s)  # the prefix is computed
    other = "1" if first == "0" else "0"
    picks = []
    while len(picks) < 200 and (not picks or picks[-1] == first):
        picks.append(policy.choose(eng.backends, (), {first: 4}, hints(1, f"question {len(picks)}")).instance_id)
    assert picks[-1] == other and policy.last_reason == SPILL
    assert 2 < len(picks) < 40
    policy.last_decision.first_token(policy.last_decision.estimate_s)
    # with the copy there, the tenant's requests go to the one with less pending
    assert policy.choose(eng.backends, (), {first: 4}, hints(1, "after the copy")).instance_id == other
    assert policy.last_reason == HIT


def _busy_requests_until_a_copy(policy, eng, first, start, limit=200):
    """Requests of tenant 1 while `first` holds 4 more in flight than the other, until one goes to
    the other instance (the copy bought); how many were sent."""
    for q in range(limit):
        if policy.choose(eng.backends, (), {first: 4}, hints(1, f"busy {start + q}")).instance_id != first:
            return q + 1
    return limit


def test_the_rent_paid_is_kept_while_the_holder_is_not_busier():
    # At a light load the holder is ahead only now and then: the rent its requests paid while it
    # was ahead still counts once it is ahead again, so the copy comes after as many busy
    # requests in all as without the pause (forgetting it made the light 64-slot tenant cells
    # of bench/routing_sim.py 1.056-1.060 x the best baseline's TTFT p90; keeping it, 1.034-1.041 x).
    policy, eng, clock = learnt(slots=64)
    first = policy.choose(eng.backends, (), {}, hints(1)).instance_id
    policy.last_decision.first_token(policy.last_decision.estimate_s)
    straight = _busy_requests_until_a_copy(policy, eng, first, 0)
    assert 4 < straight < 40

    policy, eng, clock = learnt(slots=64)
    first = policy.choose(eng.backends, (), {}, hints(1)).instance_id
    policy.last_decision.first_token(policy.last_decision.estimate_s)
    paid = straight - 2  # all but the last two of those that bought it
    for q in range(paid):
        assert policy.choose(eng.backends, (), {first: 4}, hints(1, f"busy {q}")).instance_id == first
    for q in range(20):  # the holder no busier: these pay nothing, and take nothing back
        assert policy.choose(eng.backends, (), {}, hints(1, f"calm {q}")).instance_id == first
        policy.last_decision.first_token(policy.last_decision.estimate_s)
    rest = _busy_requests_until_a_copy(policy, eng, first, paid)
    assert rest <= 3  # the last two of them (forgotten in the pause: 5 more)


def test_no_copy_is_bought_where_it_would_push_out_prefixes_found_cached_there():
    # The same busy holder, but the other instance's cache is taken by prefixes found there
    # (206 blocks not held by running requests, 190 of them others' prefixes, and the copy
    # needs 31): a copy there would cost another prefix its copy, so none is bought.
    policy, eng, clock = learnt(slots=64)
    first = policy.choose(eng.backends, (), {}, hints(1)).instance_id
    policy.last_decision.first_token(policy.last_decision.estimate_s)
    other = "1" if first == "0" else "0"
    policy.journal.holdings.found(other, b"another tenant", 190, clock.t)
    for q in range(30):  # three times what bought the copy above; the queue alone moves it at ~45
        assert policy.choose(eng.backends, (), {first: 4}, hints(1, f"question {q}")).instance_id == first


def test_a_holder_no_busier_than_the_others_buys_no_copy():
    # What each request would lose or gain by staying nets out: equal instances never pay rent.
    policy, eng, clock = learnt(slots=64)
    first = policy.choose(eng.backends, (), {}, hints(1)).instance_id
    policy.last_decision.first_token(policy.last_decision.estimate_s)
    for q in range(300):
        assert policy.choose(eng.backends, (), {}, hints(1, f"question {q}")).instance_id == first
        decision = policy.last_decision
        decision.first_token(decision.estimate_s)  # its prefill is done: nothing pending


def test_costs_within_the_estimates_own_error_are_ties_that_keep_the_cache():
    policy, eng, clock = learnt()
    first = policy.choose(eng.backends, (), {}, hints(1)).instance_id
    other = "1" if first == "0" else "0"
    decision = policy.last_decision
    decision.first_token(decision.estimate_s + 0.5)  # the estimates miss by ~0.5 s
    assert policy.journal.errors.value == pytest.approx(0.5, rel=0.05)
    # a queue there worth a spill when the estimates are exact (test above), not when they are
    # this far off: within the error the cached instance is kept
    assert policy.choose(eng.backends, (), {first: 12, other: 0}, hints(1, "again")).instance_id == first
    policy.journal.errors = type(policy.journal.errors)()
    assert policy.choose(eng.backends, (), {first: 12, other: 0}, hints(1, "and again")).instance_id == other


def test_equal_holders_of_a_prefix_take_its_requests_in_turn():
    # Both instances hold tenant 1's prefix and cost the same: its requests alternate between
    # them, as NGINX's least_conn takes its equals, instead of all going to the one its checksum
    # names (where one tenant's requests were most of the load, that one ran busier).
    policy, eng, clock = learnt(slots=64)
    keys = hints(1).prompt_keys
    for iid in ("0", "1"):
        policy.index.record(keys, iid)
    picks = []
    for q in range(20):
        picks.append(policy.choose(eng.backends, (), {}, hints(1, f"question {q}")).instance_id)
        assert policy.last_reason == HIT
        policy.last_decision.first_token(policy.last_decision.estimate_s)
    assert picks.count("0") == picks.count("1") == 10


def test_multi_turn_chat_follows_its_history():
    policy, eng, clock = learnt()
    prompt = SYSTEM.format(7) + "\nUser: a long document " + "lorem ipsum " * 100 + "\nAssistant:"
    where = policy.choose(eng.backends, (), {}, RouteHints.from_prompt(prompt)).instance_id
    for turn in range(4):
        clock.t += 0.5
        prompt += " an answer of a few words\nUser: and what about turn %d?\nAssistant:" % turn
        load = {where: 2}  # the conversation's instance is the busier one
        assert policy.choose(eng.backends, (), load, RouteHints.from_prompt(prompt)).instance_id == where
        assert policy.last_reason == HIT


def test_instances_skipped_are_passed_over_and_the_pick_returned_is_the_one_priced():
    # A retry skips the instances tried: the choice is among the others, and the instance handed
    # back is the one its decision names (the proxy counts it in flight there).
    policy, eng, _ = learnt(4)
    load = {"0": 0, "1": 6, "2": 3, "3": 7}
    assert policy.choose(eng.backends, (), load).instance_id == "0"
    chosen = policy.choose(eng.backends, ("0",), load)
    assert chosen.instance_id == "2" == policy.last_decision.instance
    chosen = policy.choose(eng.backends, ("2", "0"), load)
    assert chosen.instance_id == "1" == policy.last_decision.instance
    assert policy.choose(eng.backends, ("0", "1", "2", "3"), load) is None


def test_the_prefill_routed_there_and_not_done_yet_counts():
    policy, eng, clock = learnt()
    long_prompt = RouteHints.from_prompt("unique long prompt " * 600)
    a = policy.choose(eng.backends, (), {}, long_prompt).instance_id
    # a short prompt arriving right behind it avoids the instance busy prefilling ~11k tokens
    short = RouteHints.from_prompt("a short unique prompt of its own")
    assert policy.choose(eng.backends, (), {a: 1}, short).instance_id != a
    assert policy.last_reason == MISS
    # once its first token is out, the prefill is done: nothing pending there any more
    decision = policy.last_decision
    assert decision.first_token(0.05) == pytest.approx(0.05 - decision.estimate_s)


def test_estimate_is_the_documented_formula():
    policy, eng, _ = learnt()
    policy.choose(eng.backends, (), {"0": 9, "1": 9}, hints(2))
    d = policy.last_decision
    r = policy.book.rates(d.instance)
    inst = policy._insts[d.instance]
    n = 9 + inst.foreign
    pending = inst.pending.total - (d.prompt_tokens - d.cached_tokens)  # before this one's own
    assert d.estimate_s == pytest.approx(ttft_estimate(r, inst.slots, n, pending + d.prompt_tokens - d.cached_tokens))


def test_reasons_without_a_prompt_and_before_rates():
    clock = Clock()
    eng = Engines(2, clock)
    policy = CostModel(random.Random(1), clock=clock)
    b = policy.choose(eng.backends, (), {"0": 3, "1": 1}, None)
    assert policy.last_reason == LOAD and policy.last_decision.estimate_s is None
    assert b.instance_id == "1"  # no rates yet: the fewest requests
    eng.scrape()  # one scrape: the slots are known, no rates yet (that takes two busy ones)
    assert policy.book.rates("0") is None
    policy.choose(eng.backends, (), {}, hints(3))
    holder = policy.last_decision.instance
    # still no rates: a holder with a free slot keeps its prefix even if busier
    assert policy.choose(eng.backends, (), {holder: 5}, hints(3, "again")).instance_id == holder


def test_before_any_engine_numbers_a_holder_keeps_its_prefix():
    """An engine exports no iteration or KV numbers before its first iteration: a burst at
    start-up still finds the instance a tenant's first request went to (it used to count no
    holder without the engine's block size, and spread the tenant by load)."""
    clock = Clock()
    eng = Engines(2, clock)  # views without a snapshot
    policy = CostModel(random.Random(1), clock=clock)
    holder = policy.choose(eng.backends, (), {}, hints(3)).instance_id
    assert policy.last_reason == MISS
    other = "1" if holder == "0" else "0"
    assert policy.choose(eng.backends, (), {holder: 1, other: 0}, hints(3, "again")).instance_id == holder
    assert policy.last_reason == HIT and policy.last_decision.cached_tokens > 0


def test_an_evicted_prefix_is_not_counted_as_cached():
    policy, eng, clock = learnt()
    holder = policy.choose(eng.backends, (), {}, hints(4)).instance_id
    # then many other tenants' prompts to that instance: the cache (256 blocks) turns over
    for t in range(20, 40):
        clock.t += 0.01
        policy.choose([b for b in eng.backends if b.instance_id == holder], (), {}, hints(t))
    policy.choose(eng.backends, (), {}, hints(4, "back again"))
    assert policy.last_decision.cached_tokens == 0 and policy.last_reason == MISS


def test_stale_snapshots_leave_only_our_counts():
    policy, eng, clock = learnt()
    eng.active = [8, 0]
    eng.scrape()
    assert policy._insts["0"].foreign == 8
    clock.t += 5  # the snapshots age past stale_after_s
    policy.choose(eng.backends, (), {"0": 0, "1": 2}, None)
    assert policy.last_decision.instance == "0"


def test_two_workers_decide_alike():
    """Two policies (two data-plane workers) on the same snapshots, the same global in-flight
    counts, one prefix index and one journal, taking turns with the requests: before every pick
    the other worker would have picked the same instance."""
    clock = Clock()
    eng = Engines(4, clock)
    index, journal = PrefixIndex(clock=clock), Journal()
    a = CostModel(random.Random(1), clock=clock, index=index, journal=journal)
    b = CostModel(random.Random(2), clock=clock, index=index, journal=journal)
    for p in (a, b):
        p.choose(eng.backends, (), {})
    eng.scrape(60)
    rng = random.Random(5)
    inflight: dict[str, int] = {}
    for k in range(400):
        h = hints(rng.randrange(12), f"q{k}") if k % 5 else RouteHints.from_prompt(f"unique {k} " * rng.randint(1, 80))
        mine, other = (a, b) if k % 2 else (b, a)
        assert mine._evaluate(eng.backends, (), inflight, h, clock.t)[0] is not None
        assert mine._evaluate(eng.backends, (), inflight, h, clock.t)[0].iid == \
            other._evaluate(eng.backends, (), inflight, h, clock.t)[0].iid
        picked = mine.choose(eng.backends, (), inflight, h).instance_id
        inflight[picked] = inflight.get(picked, 0) + 1
        if k % 3 == 0:
            done = rng.choice([i for i, c in inflight.items() if c])
            inflight[done] -= 1
            clock.t += 0.02
        if k % 20 == 0:
            eng.active = [rng.randint(0, 8) for _ in eng.views]
            eng.scrape()


def test_shared_prefix_index_of_the_workers_serves_the_policy(tmp_path):
    clock = Clock()
    eng = Engines(2, clock)
    shared = SharedPrefixIndex.create(tmp_path / "prefixes", slots=1 << 10, clock=clock)
    policy = CostModel(random.Random(1), clock=clock, index=shared)  # match() only: no recency
    policy.choose(eng.backends, (), {})
    eng.scrape(60)
    first = policy.choose(eng.backends, (), {}, hints(1)).instance_id
    assert policy.choose(eng.backends, (), {first: 3}, hints(1, "again")).instance_id == first
    assert policy.last_reason == HIT
    shared.close()


def test_with_the_workers_shared_index_an_evicted_prefix_is_not_counted_as_cached(tmp_path):
    """The shared index answers only who holds a chunk; when it was routed there comes from the
    journal, so the cache's turnover is modelled as with an in-process index."""
    clock = Clock()
    eng = Engines(2, clock)
    shared = SharedPrefixIndex.create(tmp_path / "prefixes", slots=1 << 12, clock=clock)
    policy = CostModel(random.Random(1), clock=clock, index=shared)
    policy.choose(eng.backends, (), {})
    policy.choose(eng.backends, (), {}, RouteHints.from_prompt("warm-up " * 250))
    eng.scrape(60)
    holder = policy.choose(eng.backends, (), {}, hints(4)).instance_id
    clock.t += 0.01
    policy.choose(eng.backends, (), {}, hints(4, "soon after"))
    assert policy.last_reason == HIT and policy.last_decision.cached_tokens > 0
    for t in range(20, 40):  # the holder's cache (256 blocks) turns over
        clock.t += 0.01
        policy.choose([b for b in eng.backends if b.instance_id == holder], (), {}, hints(t))
    assert dict(shared.match(hints(4).prompt_keys)[1]).get(holder)  # the index still names it
    policy.choose(eng.backends, (), {}, hints(4, "back again"))
    assert policy.last_decision.cached_tokens == 0 and policy.last_reason == MISS
    shared.close()


def test_a_replaced_policy_stops_listening():
    policy, eng, clock = learnt()
    before = len(eng.views[0].listeners)
    del policy
    gc.collect()
    new = CostModel(random.Random(1), clock=clock)
    new.choose(eng.backends, (), {})
    assert len(eng.views[0].listeners) == before  # the dead one's listener made room for the new one


def test_forget_clears_the_instances_cache_and_pending_prefill():
    policy, eng, clock = learnt()
    holder = policy.choose(eng.backends, (), {}, hints(6)).instance_id
    policy.forget(holder)
    policy.choose(eng.backends, (), {}, hints(6, "after the restart"))
    assert policy.last_reason == MISS
    assert policy._insts[holder].pending.total == 0 or policy.last_decision.instance == holder


# --- the Balancer and what the operator sees -------------------------------------------------
def test_balancer_runs_cost_model_with_the_workers_shared_index(tmp_path):
    clock = Clock()
    eng = Engines(2, clock)
    index = PrefixIndex(clock=clock)
    counts: dict[str, int] = {}

    class Row:
        def acquire(self, iid):
            counts[iid] = counts.get(iid, 0) + 1

        def release(self, iid):
            counts[iid] -= 1

    bal = Balancer("cost-model", rng=random.Random(1), clock=clock, shared=SharedRouting(counts, Row(), index))
    assert bal.wants_prompt and bal._policy.index is index
    b = bal.pick(eng.backends, hints=hints(2))
    assert bal.last_reason == MISS and bal.last_decision.instance == b.instance_id
    assert Balancer("least-outstanding").last_decision is None


def test_metrics_top_and_recent_show_the_models_picks(monkeypatch):
    policy, eng, clock = learnt()
    metrics = ProxyMetrics()
    timer = metrics.timer("generate_stream")
    b = policy.choose(eng.backends, (), {}, hints(9))
    decision = policy.last_decision
    metrics.routed("cost-model", policy.last_reason, b.instance_id)
    metrics.route_decision(decision, timer)
    timer.events(b.instance_id, 1)
    text = metrics.render().decode()
    iid = b.instance_id
    assert f'trtllm_orch_proxy_route_prompt_tokens_sum{{instance="{iid}"}} {float(decision.prompt_tokens)}' in text
    assert f'trtllm_orch_proxy_route_ttft_error_seconds_count{{instance="{iid}"}} 1.0' in text
    row = metrics.recent.summary()[iid]
    assert row["routes"] == {MISS: 1} and row["ttft_est_err"] is not None
    status = {**STATUS, "instances": [dict(STATUS["instances"][0], llm={
        **STATUS["instances"][0]["llm"], "routes": {"hit": 8, "miss": 1, "spill": 1}, "ttft_est_err": 0.12})]}
    out = text_of(render(status), width=220)
    assert "ROUTE h/m/s" in out and "80/10/10" in out and "12%" in out


def _routed(policy, eng, metrics, timer, prompt: str, tried=()) -> str:
    """A generation's attempt as the proxy makes it: the pick, then its decision on the timer."""
    iid = policy.choose(eng.backends, tried, {}, RouteHints.from_prompt(prompt)).instance_id
    metrics.route_decision(policy.last_decision, timer)
    return iid


def test_a_retried_attempts_pick_is_abandoned_not_left_pending():
    policy, eng, clock = learnt()
    metrics = ProxyMetrics()
    timer = metrics.timer("generate_stream")
    first = _routed(policy, eng, metrics, timer, "unique long prompt " * 600)
    assert policy._insts[first].pending.at(clock.t) > 10000
    # that attempt failed: the proxy picks again, elsewhere, for the same generation
    again = _routed(policy, eng, metrics, timer, "unique long prompt " * 600, tried=(first,))
    assert policy._insts[first].pending.at(clock.t) == 0  # its prefill will not happen there
    timer.events(again, 1)
    assert policy._insts[again].pending.at(clock.t) == 0
    assert policy.journal.errors.value > 0  # the second pick's estimate met its first token


def test_an_attempt_that_ends_without_a_first_token_leaves_nothing_pending():
    # An error answer, a client gone, a generation that stops before its first event: the
    # proxy ends the attempt (TokenTimer.attempt_over), and the pick's prefill is not
    # pending there until its estimate runs out.
    policy, eng, clock = learnt()
    metrics = ProxyMetrics()
    timer = metrics.timer("generate_stream")
    iid = _routed(policy, eng, metrics, timer, "unique long prompt " * 600)
    assert policy._insts[iid].pending.at(clock.t) > 10000
    timer.attempt_over()
    assert policy._insts[iid].pending.at(clock.t) == 0
    assert policy.journal.errors.value == 0  # no first token: nothing to learn
    # an attempt that had its first token is over with nothing left to abandon
    timer = metrics.timer("generate_stream")
    iid = _routed(policy, eng, metrics, timer, "another prompt " * 600)
    timer.events(iid, 1)
    learnt_error = policy.journal.errors.value
    timer.attempt_over()
    assert policy._insts[iid].pending.at(clock.t) == 0 and policy.journal.errors.value == learnt_error > 0


def test_holdings_count_each_prefix_once_and_drop_the_ones_found_too_long_ago():
    from orchestrator.routing.journal import Holdings
    held = Holdings()
    held.found("0", b"a", 32, 10.0)
    held.found("0", b"b", 16, 20.0)
    held.found("0", b"a", 40, 30.0)  # found again, deeper: counted once, as found last
    assert held.blocks("0", 0.0) == 56 and held.blocks("1", 0.0) == 0
    assert held.blocks("0", 25.0) == 40  # b was last found at 20
    held.forget("0")
    assert held.blocks("0", 0.0) == 0


def _compiled_pass():
    """cost_policy's compiled pass, which these tests hold to the Python: it must be built."""
    from orchestrator.routing import cost_policy

    assert cost_policy.NATIVE is not None, \
        "orchestrator/routing/_cost_pass.c is not built (scripts/bootstrap builds it)"
    return cost_policy.NATIVE


def _random_candidates(seed: int):
    """A choice's pass inputs on a random state: candidates with or without rates, fresh or stale
    snapshots, pending ledgers with entries due and not, counts, cached tokens and the other
    workers' pending prefill; now and then a count that is not an int, or counts that are not in a
    dict (the Python's to price)."""
    from orchestrator.routing.cost_model import Rates
    from orchestrator.routing.cost_policy import _Inst

    rng = random.Random(seed)
    now = 1000.0
    journal = Journal()
    cands = []
    n = rng.randint(1, 16)
    for i in range(n):
        inst = _Inst(str(i), journal)
        inst.at = now - rng.choice([0.05, 0.5, 3.0]) if rng.random() < 0.95 else -float("inf")
        inst.stale_after_s = 1.0
        inst.foreign = rng.randint(0, 12)
        inst.slots = rng.choice([1, 8, 64])
        if rng.random() < 0.97:
            inst.rates = Rates(0.02, rng.choice([1e-4, 2e-4, 5e-5]), rng.choice([0.02, 0.015, 0.03]), 20.0)
            inst.prefill_s, inst.decode_s = inst.rates.prefill_s, inst.rates.decode_s
            inst.wait_unit = 20.0 * 0.02 / inst.slots
        for _ in range(rng.randint(0, 4)):  # prompt tokens pending there, some of them due by now
            inst.pending.add(rng.randint(1, 3000), now + rng.uniform(-0.2, 0.5))
        cands.append(inst)
    inflight = {str(i): rng.randint(0, 70) for i in range(n) if rng.random() < 0.8}
    if rng.random() < 0.05:
        inflight[str(rng.randrange(n))] = 2.0  # not an int: the compiled pass leaves it to the Python
    if rng.random() < 0.03:
        inflight = MappingProxyType(inflight)  # a Mapping, not a dict: the Python's too
    tokens = rng.choice([0, 90, 2100, 12000])
    cached = {str(i): rng.randint(0, tokens) for i in range(n) if tokens and rng.random() < 0.4}
    least = tokens - max(cached.values(), default=0)
    others = {str(i): float(rng.randint(0, 4000)) for i in range(n) if rng.random() < 0.5} or None
    return cands, inflight, tokens, cached, least, others, now, rng.random() < 0.95


def test_the_pricing_pass_compiled_and_in_python_is_the_same(monkeypatch):
    """cost_policy._price and its compiled pass on random states, each on its own copy: the same
    answer to the bit (every cost, count, the lowest, the tolerance, the copy's place and price)
    and the same pending ledgers left behind (an entry due is dropped by either)."""
    from orchestrator.routing import cost_policy

    compiled = _compiled_pass()
    answered = []
    for seed in range(600):
        python_state = _random_candidates(seed)
        python = cost_policy._price(*python_state)
        compiled_state = _random_candidates(seed)
        found = compiled.price(*compiled_state)
        answered.append(found)
        if found is None:  # the plain case only: the Python prices the rest
            found = cost_policy._price(*compiled_state)
        assert repr(found) == repr(python), f"seed {seed}"
        left = [[(inst.pending.total, [e[:2] for e in inst.pending.heap]) for inst in state[0]]
                for state in (python_state, compiled_state)]
        assert left[0] == left[1], f"seed {seed}"
    priced = [a for a in answered if a is not None and a[1] is not None]
    assert len(priced) > 400 and None in answered and any(a is not None and a[1] is None for a in answered)
    assert any(p[1][5] >= 0 for p in priced) and any(not p[0] for p in priced)  # a copy's place; a stale snapshot


def test_cost_model_routes_alike_compiled_and_in_python(monkeypatch):
    """The policy whole, its compiled pass on and off, over 1500 requests on four busy engines
    (tenant prompts, unique ones, none; counts that rise with each choice and fall at random,
    first tokens reported): every choice, its reason and its estimate the same."""
    from orchestrator.routing import cost_policy

    compiled = _compiled_pass()
    runs = {way: learnt(4) for way in ("compiled", "python")}
    rng = random.Random(11)
    inflight: dict[str, int] = {}
    reasons: set[str] = set()
    for k in range(1500):
        kind = rng.random()
        h = hints(rng.randrange(6), f"q{k}") if kind < 0.7 else \
            RouteHints.from_prompt(f"unique {k} " * rng.randint(1, 300)) if kind < 0.9 else None
        chosen = {}
        for way, (policy, eng, clock) in runs.items():
            monkeypatch.setattr(cost_policy, "NATIVE", compiled if way == "compiled" else None)
            picked = policy.choose(eng.backends, (), dict(inflight), h).instance_id
            d = policy.last_decision
            chosen[way] = (picked, policy.last_reason, d.estimate_s, d.cached_tokens)
            if k % 4 == 0:
                d.first_token(0.05)
        assert chosen["compiled"] == chosen["python"], f"request {k}"
        picked, reason = chosen["compiled"][:2]
        reasons.add(reason)
        inflight[picked] = inflight.get(picked, 0) + 1
        for other in list(inflight):
            if rng.random() < 0.1:
                inflight[other] -= 1
        advance = rng.choice([0.0, 0.002, 0.01])
        for way, (policy, eng, clock) in runs.items():
            clock.t += advance
            if k % 25 == 0:
                eng.active = [min(8, inflight.get(str(i), 0)) for i in range(4)]
                eng.scrape()
    assert {HIT, MISS, LOAD} <= reasons, reasons
