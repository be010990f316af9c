"""Stopping an asyncio task we own: the one rule every owner uses.

A single `task.cancel()` then `await task` can wait forever on Python 3.11: a cancel that
lands in the same loop iteration as the thing it interrupts finishing is lost
(`asyncio.wait_for` returns the finished result instead of raising, aiohttp turns it into
its own timeout), and a loop like "poll, sleep, poll" simply goes on. Seen twice under a
loaded CI run: a SIGSTOPped group hung in STOPPING (its engine monitor went on scraping),
and `down` waited 180 s for a daemon whose Slurm node poller went on polling.

So we cancel again until the task is done, then retrieve its outcome: a task's error at
its own stop is not its owner's concern, and must not be logged as never retrieved.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

RECANCEL_S = 0.5  # how long one cancel gets before the next; a task that honours it ends at once


async def cancel_and_wait(*tasks: Optional[asyncio.Future]) -> None:
    """Cancel each task (None and finished ones are skipped) until all of them are done."""
    pending = {t for t in tasks if t is not None and not t.done()}
    while pending:
        for task in pending:
            task.cancel()
        await asyncio.wait(pending, timeout=RECANCEL_S)
        pending = {t for t in pending if not t.done()}
    for t in tasks:
        if t is not None and t.done() and not t.cancelled():
            t.exception()  # retrieved


def awaiting(task: asyncio.Task, depth: int = 16) -> str:
    """Where a suspended task waits: its chain of coroutines, outermost first, each as
    `function:line` ("?" where the chain is not there to read). For a log line about a task
    being cancelled (what a stop gave up waiting for); asyncio's own `get_stack` shows the
    outermost frame of a suspended task only."""
    names: list[str] = []
    coro: Any = task.get_coro()
    while coro is not None and len(names) < depth:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            break
        names.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return " > ".join(names) or "?"
