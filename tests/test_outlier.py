"""PassiveHealth: consecutive proxy-seen failures on one instance eject it exactly once."""

from __future__ import annotations

import pytest

from orchestrator.health.outlier import PassiveHealth

pytestmark = pytest.mark.unit


class Recorder:
    def __init__(self, threshold: int) -> None:
        self.ejections: list[str] = []
        self.oks = 0
        self.health = PassiveHealth(threshold, self.ejections.append, self._ok)

    def _ok(self) -> None:
        self.oks += 1

    def fail(self, n: int, reason: str = "502") -> list[int]:
        """Number of ejections after each of n failures."""
        out = []
        for _ in range(n):
            self.health.failure(reason)
            out.append(len(self.ejections))
        return out


def test_ejects_exactly_when_the_threshold_is_crossed() -> None:
    r = Recorder(3)
    assert r.fail(6) == [0, 0, 1, 1, 1, 1]
    assert r.health.consecutive == 6
    assert "3 consecutive proxy failures (last: 502)" in r.ejections[0]


def test_success_breaks_the_streak_and_counts_as_traffic() -> None:
    r = Recorder(3)
    r.fail(2)
    r.health.success()
    assert r.health.consecutive == 0 and r.oks == 1
    assert r.fail(3) == [0, 0, 1]


def test_streak_after_success_can_eject_again() -> None:
    r = Recorder(2)
    assert r.fail(2) == [0, 1]
    r.health.success()
    assert r.fail(2) == [1, 2]


def test_reset_forgets_streak_and_reason() -> None:
    r = Recorder(2)
    r.fail(1, "connect refused")
    assert r.health.last_reason == "connect refused"
    r.health.reset()
    assert r.health.consecutive == 0 and r.health.last_reason == ""
    assert r.fail(1) == [0]


def test_threshold_one_ejects_on_first_failure() -> None:
    r = Recorder(1)
    assert r.fail(2) == [1, 1]


def test_last_reason_is_the_latest() -> None:
    r = Recorder(5)
    r.fail(1, "first")
    r.fail(1, "second")
    assert r.health.last_reason == "second"


def test_threshold_can_change_on_reload() -> None:
    r = Recorder(5)
    r.fail(1)
    r.health.threshold = 2
    assert r.fail(1) == [1]


@pytest.mark.parametrize("bad", [0, -1])
def test_rejects_bad_threshold(bad: int) -> None:
    with pytest.raises(ValueError, match="threshold"):
        PassiveHealth(bad, lambda _: None, lambda: None)
