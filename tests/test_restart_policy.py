"""RestartPolicy with a fake clock and a seeded rng: every rule, no sleeping."""

from __future__ import annotations

import random

import pytest

from orchestrator.health.restart_policy import JITTER, RestartPolicy, ordinal

pytestmark = pytest.mark.unit


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, s: float) -> None:
        self.now += s


class FixedRng(random.Random):
    """uniform() returns the low end, the middle, or the high end of the range on demand."""

    def __init__(self, where: float) -> None:
        super().__init__(0)
        self.where = where

    def uniform(self, a: float, b: float) -> float:
        return a + (b - a) * self.where


def policy(clock: FakeClock, *, initial: float = 1.0, cap: float = 30.0, stable: float = 60.0,
           max_failures: int = 100, window: float = 600.0, rng: random.Random | None = None) -> RestartPolicy:
    return RestartPolicy(initial, cap, stable, max_failures, window, rng=rng or FixedRng(0.5), clock=clock)


def test_first_failure_ever_restarts_immediately() -> None:
    d = policy(FakeClock()).record_failure()
    assert (d.give_up, d.delay_s) == (False, 0.0)
    assert d.reason == "1st failure in 600s: restarting now"


@pytest.mark.parametrize("initial,cap,expected", [
    # k-th repeat failure waits initial * 2^(k-1); the first failure is free.
    (1.0, 30.0, [0, 1, 2, 4, 8, 16, 30, 30, 30]),
    (0.5, 3.0, [0, 0.5, 1, 2, 3, 3]),
    (2.0, 100.0, [0, 2, 4, 8, 16, 32, 64, 100]),
    (1.0, 0.0, [0, 0, 0, 0]),  # cap 0: always immediate
    (0.0, 30.0, [0, 0, 0, 0]),  # initial 0: never waits
    (5.0, 1.0, [0, 1, 1]),  # cap below initial wins
])
def test_delay_sequence_without_jitter_noise(initial: float, cap: float, expected: list[float]) -> None:
    clock = FakeClock()
    p = policy(clock, initial=initial, cap=cap)  # FixedRng(0.5): jitter factor exactly 1.0
    delays = []
    for _ in expected:
        delays.append(p.record_failure().delay_s)
        clock.advance(0.001)
    assert delays == pytest.approx(expected)


def test_delays_when_ready_but_never_stable_keep_growing() -> None:
    clock = FakeClock()
    p = policy(clock, stable=60.0)
    delays = []
    for _ in range(5):
        delays.append(p.record_failure().delay_s)
        p.record_ready()
        clock.advance(59.9)  # READY, but not for stable_after_s
    assert delays == pytest.approx([0, 1, 2, 4, 8])


@pytest.mark.parametrize("where,factor", [(0.0, 1 - JITTER), (1.0, 1 + JITTER), (0.25, 0.9)])
def test_jitter_is_plus_minus_20_percent(where: float, factor: float) -> None:
    clock = FakeClock()
    p = policy(clock, initial=1.0, cap=1000.0, rng=FixedRng(where))
    p.record_failure()
    assert p.record_failure().delay_s == pytest.approx(1.0 * factor)
    assert p.record_failure().delay_s == pytest.approx(2.0 * factor)


def test_jitter_bounds_with_real_seeded_rng() -> None:
    clock = FakeClock()
    for seed in range(50):
        p = RestartPolicy(1.0, 30.0, 60.0, 100, 600.0, rng=random.Random(seed), clock=clock)
        p.reset()
        seen = [p.record_failure().delay_s for _ in range(10)]
        assert seen[0] == 0.0
        for k, delay in enumerate(seen[1:], start=1):
            base = min(2.0 ** (k - 1), 30.0)
            assert base * (1 - JITTER) - 1e-9 <= delay <= min(base * (1 + JITTER), 30.0) + 1e-9
            assert delay <= 30.0  # the cap bounds the jittered value too


def test_jitter_spreads_instances_that_fail_together() -> None:
    clock = FakeClock()
    delays = set()
    for seed in range(8):
        p = RestartPolicy(1.0, 30.0, 60.0, 100, 600.0, rng=random.Random(seed), clock=clock)
        p.record_failure()
        delays.add(round(p.record_failure().delay_s, 6))
    assert len(delays) == 8


def test_same_seed_same_delays() -> None:
    def run(seed: int) -> list[float]:
        clock = FakeClock()
        p = RestartPolicy(1.0, 30.0, 60.0, 100, 600.0, rng=random.Random(seed), clock=clock)
        return [p.record_failure().delay_s for _ in range(8)]
    assert run(7) == run(7)


def test_cap_holds_for_huge_repeat_counts() -> None:
    p = policy(FakeClock(), cap=30.0, rng=FixedRng(1.0), max_failures=10_000)
    for _ in range(3000):  # 2**3000 would overflow a float without the clamp
        d = p.record_failure()
    assert d.delay_s == 30.0
    assert not d.give_up


def test_stable_ready_resets_the_backoff() -> None:
    clock = FakeClock()
    p = policy(clock, stable=60.0)
    assert [p.record_failure().delay_s for _ in range(4)] == pytest.approx([0, 1, 2, 4])
    p.record_ready()
    clock.advance(60.0)  # exactly stable_after_s counts as stable
    assert p.record_failure().delay_s == 0.0
    assert p.record_failure().delay_s == pytest.approx(1.0)
    assert p.repeats == 2


def test_ready_just_short_of_stable_does_not_reset() -> None:
    clock = FakeClock()
    p = policy(clock, stable=60.0)
    p.record_failure()
    p.record_failure()
    p.record_ready()
    clock.advance(59.999)
    assert p.record_failure().delay_s == pytest.approx(2.0)


def test_record_ready_is_idempotent_while_ready() -> None:
    clock = FakeClock()
    p = policy(clock, stable=60.0)
    p.record_failure()
    p.record_failure()
    p.record_ready()
    for _ in range(10):  # a caller that reports READY on every good probe
        clock.advance(10.0)
        p.record_ready()
    assert p.record_failure().delay_s == 0.0  # 100 s since the first record_ready


def test_ready_timer_does_not_carry_over_a_failure() -> None:
    clock = FakeClock()
    p = policy(clock, stable=60.0)
    p.record_ready()
    clock.advance(30.0)
    p.record_failure()
    clock.advance(100.0)  # in BACKOFF/STARTING, never READY again
    assert p.record_failure().delay_s == pytest.approx(1.0)


def test_stable_after_zero_forgives_any_ready() -> None:
    clock = FakeClock()
    p = policy(clock, stable=0.0)
    for _ in range(5):
        assert p.record_failure().delay_s == 0.0
        p.record_ready()


def test_gives_up_at_max_failures_within_window() -> None:
    clock = FakeClock()
    p = policy(clock, max_failures=5, window=600.0)
    for i in range(4):
        d = p.record_failure()
        assert not d.give_up
        clock.advance(100.0)
    assert p.failures_in_window == 4
    d = p.record_failure()
    assert d.give_up
    assert d.reason == "5 failures within 600s: giving up"


def test_stable_ready_does_not_hide_a_slow_crash_loop() -> None:
    # Backoff is forgiven after each stable READY, but the window still counts.
    clock = FakeClock()
    p = policy(clock, max_failures=3, window=600.0, stable=60.0)
    for expected_give_up in (False, False, True):
        d = p.record_failure()
        assert d.give_up is expected_give_up
        assert d.delay_s == 0.0
        p.record_ready()
        clock.advance(120.0)


def test_old_failures_expire_from_the_window() -> None:
    clock = FakeClock()
    p = policy(clock, max_failures=3, window=600.0)
    p.record_failure()
    clock.advance(300.0)
    p.record_failure()
    clock.advance(300.0)  # the first one is now exactly window_s old: it no longer counts
    assert p.failures_in_window == 1
    d = p.record_failure()
    assert not d.give_up
    assert d.reason.startswith("2nd failure in 600s")
    clock.advance(599.0)
    assert p.failures_in_window == 1  # only the third is younger than 600 s
    clock.advance(1.0)
    assert p.failures_in_window == 0


def test_max_failures_one_gives_up_on_first_failure() -> None:
    d = policy(FakeClock(), max_failures=1).record_failure()
    assert d.give_up and d.reason == "1 failures within 600s: giving up"


def test_reset_clears_history_and_backoff() -> None:
    clock = FakeClock()
    p = policy(clock, max_failures=3)
    p.record_failure()
    p.record_failure()
    p.reset()
    assert p.failures_in_window == 0
    assert p.repeats == 0
    d = p.record_failure()
    assert (d.give_up, d.delay_s) == (False, 0.0)


def test_reason_names_count_window_and_delay() -> None:
    clock = FakeClock()
    p = policy(clock, initial=1.0, rng=FixedRng(1.0))
    p.record_failure()
    p.record_failure()
    assert p.record_failure().reason == "3rd failure in 600s: restarting in 2.4s"


@pytest.mark.parametrize("n,text", [(1, "1st"), (2, "2nd"), (3, "3rd"), (4, "4th"), (11, "11th"),
                                    (12, "12th"), (13, "13th"), (21, "21st"), (22, "22nd"), (101, "101st"),
                                    (111, "111th")])
def test_ordinal(n: int, text: str) -> None:
    assert ordinal(n) == text


@pytest.mark.parametrize("kwargs,field", [
    ({"initial_s": -1}, "initial_s"), ({"cap_s": -1}, "cap_s"), ({"stable_after_s": -0.1}, "stable_after_s"),
    ({"max_failures": 0}, "max_failures"), ({"window_s": 0}, "window_s"),
])
def test_rejects_bad_settings_naming_the_field(kwargs: dict, field: str) -> None:
    args = {"initial_s": 1.0, "cap_s": 30.0, "stable_after_s": 60.0, "max_failures": 5, "window_s": 600.0}
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        RestartPolicy(**args)


def test_uses_real_clock_and_rng_by_default() -> None:
    p = RestartPolicy(1.0, 30.0, 60.0, 5, 600.0)
    assert p.record_failure().delay_s == 0.0
    assert 0.8 <= p.record_failure().delay_s <= 1.2
