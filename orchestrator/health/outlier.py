"""Passive health: the proxy reports each upstream outcome, and an instance whose
requests fail N times in a row is ejected (taken out of rotation, then checked).

Consecutive, not a rate: under heavy traffic a rate hides a dead instance behind
many good ones for a while, while N straight failures on one instance is a strong
signal that costs nothing to compute (Envoy's consecutive_5xx). Pure logic.
"""

from __future__ import annotations

from typing import Hashable


class OutlierDetector:
    def __init__(self, threshold: int) -> None:
        if threshold < 1:
            raise ValueError(f"threshold={threshold!r}: must be at least 1")
        self.threshold = threshold
        self._streak: dict[Hashable, int] = {}
        self._last_reason: dict[Hashable, str] = {}

    def record_failure(self, instance_id: Hashable, reason: str) -> bool:
        """True exactly once per streak: on the failure that reaches the threshold.

        Later failures in the same streak return False so the caller ejects once,
        not once per request.
        """
        streak = self._streak.get(instance_id, 0) + 1
        self._streak[instance_id] = streak
        self._last_reason[instance_id] = reason
        return streak == self.threshold

    def record_success(self, instance_id: Hashable) -> None:
        self._streak.pop(instance_id, None)

    def reset(self, instance_id: Hashable) -> None:
        """The instance was restarted or re-admitted: its old streak says nothing now."""
        self._streak.pop(instance_id, None)
        self._last_reason.pop(instance_id, None)

    def consecutive(self, instance_id: Hashable) -> int:
        return self._streak.get(instance_id, 0)

    def last_reason(self, instance_id: Hashable) -> str:
        return self._last_reason.get(instance_id, "")
