"""Hold requests while no instance is ready, instead of failing them.

With one instance (or all of them restarting at once) a restart would otherwise
fail every request for its duration. A request that finds the ready set empty
(when it arrives, or when its attempt failed because its instance just died)
waits here for an instance to become ready, up to `hold_s`, then proceeds; past
the deadline, or when `max_held` requests already wait, the proxy answers 503
with Retry-After. Streams are held the same way before their first byte.

One gate per proxy, owned by it: subscribed to the ready set at start, closed at
stop (waiters then see "nothing ready" at once).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from orchestrator.routing.backends import Backend, ReadyBackends


class HoldGate:
    def __init__(self, backends: ReadyBackends, hold_s: float, max_held: int,
                 on_held: Callable[[float, bool], None] | None = None) -> None:
        self._backends = backends
        self.hold_s = hold_s
        self.max_held = max_held
        self.held = 0
        self._on_held = on_held  # (seconds waited, got an instance) for the metrics
        self._ready = asyncio.Event()
        self._unsubscribe: Callable[[], None] | None = None
        self._closed = False

    def start(self) -> None:
        self._unsubscribe = self._backends.subscribe(self._on_change)

    def close(self) -> None:
        self._closed = True
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        self._ready.set()  # release every waiter

    def _on_change(self, backends: tuple[Backend, ...]) -> None:
        if backends:
            self._ready.set()
        else:
            self._ready.clear()

    async def ready(self) -> tuple[Backend, ...]:
        """The ready set, waiting for one up to hold_s when it is empty; () when none came."""
        current = self._backends.current()
        if current or self._closed or self.hold_s <= 0 or self.held >= self.max_held:
            return current
        self.held += 1
        start = time.monotonic()
        deadline = start + self.hold_s
        try:
            while not self._closed:
                current = self._backends.current()
                left = deadline - time.monotonic()
                if current or left <= 0:
                    break
                self._ready.clear()
                try:
                    await asyncio.wait_for(self._ready.wait(), left)
                except asyncio.TimeoutError:
                    pass
            current = self._backends.current()
            return current
        finally:
            self.held -= 1
            if self._on_held is not None:
                self._on_held(time.monotonic() - start, bool(current))
