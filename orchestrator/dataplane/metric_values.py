"""A data-plane worker's Prometheus values, written to its multiprocess file once per loop turn.

prometheus_client's multiprocess mode (how any worker's scrape adds up every worker's values)
writes each increment through to the worker's mmap file: a lock, a struct pack and a slice
assignment on top of the value's own lock and add. A request makes a dozen (its count, latency,
in-flight gauge up and down, routing reason, TTFT, events, inter-token buckets): in process on
the 2-core box the compiled front's decide + release took 45.8 us write-through, 41.2 us
turn-batched, 35.7 us with no multiprocess files (bench/README, "The front's Python per
request, off the path of the bytes").

Here an increment changes the value in memory and marks it; the marked values are written
when the event loop's turn ends (one `call_soon`, scheduled by the first mark of the turn). A
turn that serves ten requests writes each touched value once. What a scrape reads is at most
one loop turn old (under a millisecond under load), and nothing is lost: `flush()` also runs
when the worker stops. Where no loop is running in this thread (start-up, the render thread,
a test without one) a value is written at once, as prometheus_client writes it.

State: the set of marked values, owned by the worker's loop thread (a lock guards it against
the render thread's rare set()).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from prometheus_client import values


def install(pid: int) -> "TurnBatched":
    """Make every metric value made from now on in this process turn-batched; the worker calls
    this before any metric exists (each value takes the class when it is made)."""
    batched = TurnBatched(pid)
    values.ValueClass = batched.value_class
    return batched


class TurnBatched:
    """The value class and the set of values marked since the last write."""

    def __init__(self, pid: int) -> None:
        # A worker never forks: its pid is asked once, not on every increment (nine system
        # calls per request otherwise: 13-17% of a worker's CPU on a tiny answer).
        base = values.MultiProcessValue(process_identifier=lambda: pid)
        self._marked: list[Any] = []
        self._lock = threading.Lock()
        self._loop_thread: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        batched = self

        class TurnBatchedValue(base):  # type: ignore[misc, valid-type]
            _multiprocess = True

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                self._marked = False
                super().__init__(*args, **kwargs)

            def inc(self, amount: float) -> None:
                with batched._lock:
                    self._value += amount
                    self._timestamp = 0.0
                    batched._mark(self)

            def set(self, value: float, timestamp: float | None = None) -> None:
                with batched._lock:
                    self._value = value
                    self._timestamp = timestamp or 0.0
                    batched._mark(self)

            def get(self) -> float:
                return self._value

        self.value_class = TurnBatchedValue

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Batch per turn of `loop` (the worker's, from its thread) from now on."""
        self._loop = loop
        self._loop_thread = threading.get_ident()

    def _mark(self, value: Any) -> None:
        """Under the lock."""
        if value._marked:  # the loop's turn writes it, whichever thread changed it since
            return
        if threading.get_ident() != self._loop_thread or self._loop is None or self._loop.is_closed():
            value._file.write_value(value._key, value._value, value._timestamp)
            return
        value._marked = True
        if not self._marked:
            self._loop.call_soon(self.flush)
        self._marked.append(value)

    def flush(self) -> None:
        """Write every marked value to the file (the end of a loop turn, and the worker's stop)."""
        with self._lock:
            marked, self._marked = self._marked, []
            for value in marked:
                value._marked = False
                value._file.write_value(value._key, value._value, value._timestamp)
