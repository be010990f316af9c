"""Routing policies: pure, with a seeded RNG and a fake clock."""

import random
from collections import Counter

import pytest

from orchestrator.routing.backends import Backend
from orchestrator.routing.balancer import Balancer

pytestmark = pytest.mark.unit


def be(i: int) -> Backend:
    return Backend(str(i), "127.0.0.1", 8000 + 3 * i, 8001 + 3 * i, 8002 + 3 * i)


B = tuple(be(i) for i in range(4))


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_unknown_policy_rejected():
    with pytest.raises(ValueError, match="lb_policy"):
        Balancer("random")


def test_empty_set_gives_none():
    assert Balancer().pick(()) is None
    assert Balancer("round-robin").pick(()) is None


def test_least_outstanding_prefers_idle():
    b = Balancer(rng=random.Random(1))
    for iid in ("0", "0", "1", "2"):
        b.acquire(iid)
    for _ in range(20):
        assert b.pick(B).instance_id == "3"


def test_least_outstanding_ties_are_random_but_fair():
    b = Balancer(rng=random.Random(7))
    seen = Counter(b.pick(B).instance_id for _ in range(4000))
    assert set(seen) == {"0", "1", "2", "3"}
    assert all(800 < n < 1200 for n in seen.values()), seen


def test_least_outstanding_ties_only_among_minimum():
    b = Balancer(rng=random.Random(3))
    b.acquire("0")
    b.acquire("2")
    seen = {b.pick(B).instance_id for _ in range(200)}
    assert seen == {"1", "3"}


def test_least_outstanding_spreads_as_load_builds():
    b = Balancer(rng=random.Random(5))
    for _ in range(8):
        b.acquire(b.pick(B).instance_id)
    assert b.inflight == {"0": 2, "1": 2, "2": 2, "3": 2}


def test_release_balances_and_forgets_zero():
    b = Balancer()
    b.acquire("1")
    b.acquire("1")
    b.release("1")
    assert b.snapshot() == {"1": 1}
    b.release("1")
    assert b.snapshot() == {}
    b.release("1")  # never negative
    assert b.snapshot() == {}


def test_exclude_skips_tried_instances():
    b = Balancer(rng=random.Random(2))
    for _ in range(50):
        assert b.pick(B, exclude={"0", "1", "3"}).instance_id == "2"
    assert b.pick(B, exclude={"0", "1", "2", "3"}) is None


def test_round_robin_cycles_in_order():
    b = Balancer("round-robin")
    assert [b.pick(B).instance_id for _ in range(9)] == list("012301230")


def test_round_robin_ignores_inflight():
    b = Balancer("round-robin")
    b.acquire("0")
    b.acquire("0")
    assert b.pick(B).instance_id == "0"


def test_round_robin_skips_excluded_and_continues_after_it():
    b = Balancer("round-robin")
    assert b.pick(B, exclude={"0"}).instance_id == "1"
    assert b.pick(B).instance_id == "2"


def test_round_robin_survives_set_shrinking():
    b = Balancer("round-robin")
    for _ in range(3):
        b.pick(B)
    small = B[:2]
    got = [b.pick(small).instance_id for _ in range(4)]
    assert sorted(got) == ["0", "0", "1", "1"]


@pytest.mark.parametrize("policy", ["least-outstanding", "round-robin"])
def test_connect_failure_cools_instance_down(policy):
    clock = Clock()
    b = Balancer(policy, rng=random.Random(1), clock=clock, cooldown_s=1.0)
    b.connect_failed("1")
    assert b.is_cooling("1")
    picks = {b.pick(B[:2]).instance_id for _ in range(50)}
    assert picks == {"0"}
    clock.t += 1.5
    assert not b.is_cooling("1")
    picks = {b.pick(B[:2]).instance_id for _ in range(50)}
    assert picks == {"0", "1"}


@pytest.mark.parametrize("policy", ["least-outstanding", "round-robin"])
def test_cooling_instance_used_when_nothing_else(policy):
    b = Balancer(policy, clock=Clock())
    b.connect_failed("0")
    b.connect_failed("1")
    assert b.pick(B[:2]).instance_id in {"0", "1"}
    assert b.pick(B[:2], exclude={"0"}).instance_id == "1"


def test_success_ends_cooldown():
    b = Balancer(clock=Clock())
    b.connect_failed("0")
    b.succeeded("0")
    assert not b.is_cooling("0")


def test_skip_on_failure_sequence():
    """What the proxy does per request: pick, fail, exclude, pick again."""
    b = Balancer(rng=random.Random(4), clock=Clock())
    tried: list[str] = []
    first = b.pick(B)
    tried.append(first.instance_id)
    b.connect_failed(first.instance_id)
    second = b.pick(B, tried)
    assert second.instance_id != first.instance_id
    # the next request avoids the failed instance too (cool-down)
    assert all(b.pick(B).instance_id != first.instance_id for _ in range(50))


def test_every_configurable_policy_exists():
    # config.LB_POLICIES are the flag's choices, POLICIES what the balancer can run.
    from orchestrator.config import LB_POLICIES
    from orchestrator.routing.balancer import POLICIES
    assert set(LB_POLICIES) == set(POLICIES)
    for name in LB_POLICIES:
        assert Balancer(name).pick(B) is not None
