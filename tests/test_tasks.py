"""Stopping an owned task (orchestrator/tasks.py): a lost cancel must not hang its owner."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from orchestrator.controlplane.statedir import StateWriter
from orchestrator.tasks import awaiting, cancel_and_wait


async def poller(lose: int, polls: list[int]) -> None:
    """Polls forever; the first `lose` cancels are lost, as one landing just as a scrape's
    or a subprocess's own wait finishes is (asyncio.wait_for on 3.11, aiohttp's timeouts)."""
    while True:
        try:
            await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            if lose <= 0:
                raise
            lose -= 1
        polls.append(1)


@pytest.mark.unit
async def test_a_task_that_loses_cancels_is_cancelled_again_until_it_ends():
    polls: list[int] = []
    task = asyncio.create_task(poller(2, polls))
    await asyncio.sleep(0.05)
    task.cancel()  # what a plain `cancel(); await task` relies on: lost here
    done, _ = await asyncio.wait({task}, timeout=0.3)
    assert not done and len(polls) > 5  # it went on polling
    await asyncio.wait_for(cancel_and_wait(task), 5)
    assert task.cancelled()


@pytest.mark.unit
async def test_none_finished_and_failing_tasks_are_all_handled_in_one_call():
    async def fails_on_cancel() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise RuntimeError("cleanup failed") from None

    finished = asyncio.create_task(asyncio.sleep(0))
    await finished
    failing = asyncio.create_task(fails_on_cancel())
    honest = asyncio.create_task(asyncio.Event().wait())
    await asyncio.sleep(0)
    t0 = time.monotonic()
    await cancel_and_wait(None, finished, failing, honest)
    assert time.monotonic() - t0 < 0.4  # tasks that honour the cancel are not waited on twice
    assert honest.cancelled() and isinstance(failing.exception(), RuntimeError) and finished.done()


class SlowStateDir:
    """A state dir whose write takes longer than two re-cancels."""

    def __init__(self, tmp_path: Path) -> None:
        self.state_path = tmp_path / "state.json"
        self.started = threading.Event()
        self.finished_at: float | None = None

    def write_state(self, record: dict) -> None:
        self.started.set()
        time.sleep(1.2)
        self.finished_at = time.monotonic()


@pytest.mark.unit
async def test_the_state_writer_finishes_its_write_through_repeated_cancels(tmp_path):
    sd = SlowStateDir(tmp_path)
    writer = StateWriter(sd, lambda: {"x": 1})  # type: ignore[arg-type]
    task = asyncio.create_task(writer.run())
    writer.mark_dirty()
    await asyncio.to_thread(sd.started.wait, 5)
    await cancel_and_wait(task)
    returned_at = time.monotonic()
    # No write lands after its owner's stop returned (the daemon clears the file next).
    assert sd.finished_at is not None and sd.finished_at <= returned_at
    assert task.cancelled()


@pytest.mark.unit
async def test_awaiting_names_where_a_suspended_task_waits():
    gate = asyncio.Event()

    async def inner() -> None:
        await gate.wait()

    async def outer() -> None:
        await inner()

    task = asyncio.create_task(outer())
    await asyncio.sleep(0)  # suspended in gate.wait()
    where = awaiting(task)
    assert [part.split(":")[0] for part in where.split(" > ")][:3] == ["outer", "inner", "wait"], where
    gate.set()
    await task
    assert awaiting(task) == "?"  # done: nothing to read
