"""Passive health: the proxies report each upstream outcome to the instance that
served it, and an instance whose requests fail N times in a row is ejected (taken
out of rotation, then checked by a canary).

Consecutive, not a rate: under heavy traffic a rate hides a dead instance behind
many good ones for a while, while N straight failures on one instance is a strong
signal that costs nothing to compute (Envoy's consecutive_5xx).

One object per instance, owned by it: a proxy holds it through the instance's
`Backend` and calls it directly, so a report is one call, not a relay.
"""

from __future__ import annotations

from collections.abc import Callable


class PassiveHealth:
    def __init__(self, threshold: int, on_eject: Callable[[str], None], on_ok: Callable[[], None]) -> None:
        self.threshold = threshold
        self._on_eject = on_eject
        self._on_ok = on_ok
        self._streak = 0
        self.last_reason = ""

    @property
    def threshold(self) -> int:
        return self._threshold

    @threshold.setter
    def threshold(self, value: int) -> None:
        if value < 1:
            raise ValueError(f"threshold={value!r}: must be at least 1")
        self._threshold = value

    @property
    def consecutive(self) -> int:
        return self._streak

    def failure(self, reason: str) -> None:
        """A connect failure, reset or 5xx. Ejects exactly once per streak, on the
        failure that reaches the threshold, not once per later request."""
        self._streak += 1
        self.last_reason = reason
        if self._streak == self._threshold:
            self._on_eject(f"ejected after {self._threshold} consecutive proxy failures (last: {reason})")

    def success(self) -> None:
        self._streak = 0
        self._on_ok()

    def reset(self) -> None:
        """The instance was restarted or re-admitted: its old streak says nothing now."""
        self._streak = 0
        self.last_reason = ""
