"""OutlierDetector: consecutive failures per instance eject exactly once."""

from __future__ import annotations

import pytest

from orchestrator.health.outlier import OutlierDetector


def test_ejects_exactly_when_the_threshold_is_crossed() -> None:
    d = OutlierDetector(3)
    assert [d.record_failure("a", "502") for _ in range(6)] == [False, False, True, False, False, False]
    assert d.consecutive("a") == 6


def test_success_breaks_the_streak() -> None:
    d = OutlierDetector(3)
    d.record_failure("a", "502")
    d.record_failure("a", "502")
    d.record_success("a")
    assert d.consecutive("a") == 0
    assert [d.record_failure("a", "x") for _ in range(3)] == [False, False, True]


def test_streak_after_success_can_eject_again() -> None:
    d = OutlierDetector(2)
    assert [d.record_failure("a", "x") for _ in range(2)] == [False, True]
    d.record_success("a")
    assert [d.record_failure("a", "x") for _ in range(2)] == [False, True]


def test_instances_are_independent() -> None:
    d = OutlierDetector(2)
    assert d.record_failure("a", "x") is False
    assert d.record_failure("b", "y") is False
    d.record_success("b")
    assert d.record_failure("a", "x") is True
    assert d.record_failure("b", "y") is False


def test_reset_forgets_streak_and_reason() -> None:
    d = OutlierDetector(2)
    d.record_failure(0, "connect refused")
    assert d.last_reason(0) == "connect refused"
    d.reset(0)
    assert d.consecutive(0) == 0 and d.last_reason(0) == ""
    assert d.record_failure(0, "x") is False


def test_threshold_one_ejects_on_first_failure() -> None:
    d = OutlierDetector(1)
    assert d.record_failure("a", "x") is True
    assert d.record_failure("a", "x") is False


def test_unknown_instance_operations_are_harmless() -> None:
    d = OutlierDetector(3)
    d.record_success("nope")
    d.reset("nope")
    assert d.consecutive("nope") == 0


def test_last_reason_is_the_latest() -> None:
    d = OutlierDetector(5)
    d.record_failure("a", "first")
    d.record_failure("a", "second")
    assert d.last_reason("a") == "second"


@pytest.mark.parametrize("bad", [0, -1])
def test_rejects_bad_threshold(bad: int) -> None:
    with pytest.raises(ValueError, match="threshold"):
        OutlierDetector(bad)
