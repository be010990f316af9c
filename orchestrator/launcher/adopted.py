"""A process a previous daemon started, taken over by this one (live restore).

It is not our child: no exit status reaches us and `asyncio`'s child watcher cannot
wait for it. It stands in for `asyncio.subprocess.Process` where the daemon keeps one
(a group's mpirun, a data-plane worker): `pid`, `returncode`, `wait()`,
`send_signal()`, `kill()`. Its exit comes through a pidfd (health/exit_watch.py), with
a poll as the fallback, and its identity is pinned by the start time read when it was
adopted, so a recycled pid is never taken for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import psutil

from orchestrator.health.exit_watch import ExitWatcher

POLL_S = 0.05
UNKNOWN_EXIT = -255  # what `returncode` says once it is gone: the exit status went to init


def still_running(pid: int, create_time: float | None) -> bool:
    """`pid` is alive and still the process that started at `create_time`."""
    try:
        proc = psutil.Process(pid)
        return (create_time is None or abs(proc.create_time() - create_time) < 0.01) and \
            proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class AdoptedProcess:
    stdout = None  # its output goes to a file of its own

    def __init__(self, pid: int, create_time: float | None, watcher: ExitWatcher | None = None) -> None:
        self.pid = pid
        self.create_time = create_time
        self.returncode: int | None = None
        self._exited = asyncio.Event()
        self._watcher = watcher
        if watcher is None or not watcher.watch(pid, self._gone):
            if not still_running(pid, create_time):
                self._gone(pid)

    def _gone(self, pid: int) -> None:
        if self.returncode is None:
            self.returncode = UNKNOWN_EXIT
        self._exited.set()

    async def wait(self) -> int:
        # The pidfd says it at once; the poll covers a watch someone removed (a group's
        # stop unwatches every pid it knows) and hosts without pidfd_open.
        while not self._exited.is_set():
            if not still_running(self.pid, self.create_time):
                self._gone(self.pid)
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._exited.wait(), POLL_S)
        return self.returncode if self.returncode is not None else UNKNOWN_EXIT

    def send_signal(self, sig: int) -> None:
        if self.returncode is None and still_running(self.pid, self.create_time):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
