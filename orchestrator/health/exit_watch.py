"""Event-driven process exit detection.

A pidfd (pidfd_open, Linux >= 5.3) becomes readable the moment its process exits,
zombie or not, child of ours or not. Registering it with loop.add_reader turns
every exit into an event on the loop: no polling interval to tune, no SIGCHLD
handler (which only sees our own children, and mpirun's ranks are not), and no
race with whoever reaps the process.

A pidfd also pins the process identity: if the pid is reused after the exit, the
fd still refers to the old process, so we never mistake a new process for ours.
"""

from __future__ import annotations

import asyncio
import errno
import os
from typing import Callable

import psutil

# Only for the fallback: how often to look when the kernel cannot tell us.
POLL_S = 0.1


class ExitWatcher:
    """Calls back as soon as any watched pid exits, using pidfd_open + loop.add_reader
    (Linux >= 5.3). Works for processes that are not our children (mpirun's ranks,
    python stubs).

    Without pidfd_open (older kernels, other systems) it falls back to a psutil poll
    every POLL_S seconds: correct, but exits are noticed up to POLL_S late.
    The owner must call close() (or use it as a context manager).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None, *, use_pidfd: bool | None = None) -> None:
        self._loop = loop
        # None: use pidfd when the kernel has it. Tests pass False to exercise the fallback.
        self._use_pidfd = hasattr(os, "pidfd_open") if use_pidfd is None else use_pidfd
        self._fds: dict[int, int] = {}  # pid -> pidfd
        self._polled: dict[int, psutil.Process] = {}  # pid -> process, fallback only
        self._callbacks: dict[int, Callable[[int], None]] = {}
        self._poll_handle: asyncio.TimerHandle | None = None
        self._closed = False

    @property
    def watched(self) -> frozenset[int]:
        return frozenset(self._callbacks)

    def watch(self, pid: int, callback: Callable[[int], None]) -> bool:
        """Call callback(pid) once, on the loop, when pid exits. False (and no call) if it is already gone.

        Watching a pid twice replaces its callback: one owner per process.
        """
        if self._closed:
            raise RuntimeError("ExitWatcher is closed")
        loop = self._get_loop()
        if pid in self._callbacks:
            self._callbacks[pid] = callback
            return True
        if self._use_pidfd:
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                return False
            except OSError as exc:
                if exc.errno != errno.ENOSYS:
                    raise
                # The Python has pidfd_open but the kernel does not: poll from now on.
                self._use_pidfd = False
            else:
                # A zombie's pidfd is readable at once, so an exit before this line is still reported.
                self._fds[pid] = fd
                self._callbacks[pid] = callback
                loop.add_reader(fd, self._on_pidfd, pid)
                return True
        return self._watch_polled(pid, callback, loop)

    def unwatch(self, pid: int) -> None:
        self._callbacks.pop(pid, None)
        self._polled.pop(pid, None)
        fd = self._fds.pop(pid, None)
        if fd is not None:
            self._get_loop().remove_reader(fd)
            os.close(fd)
        if not self._polled and self._poll_handle is not None:
            self._poll_handle.cancel()
            self._poll_handle = None

    def close(self) -> None:
        """Remove every reader and close every fd; no callback runs afterwards."""
        for pid in list(self._callbacks):
            self.unwatch(pid)
        self._closed = True

    def __enter__(self) -> "ExitWatcher":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _get_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def _on_pidfd(self, pid: int) -> None:
        callback = self._callbacks.get(pid)
        # Clean up before calling out, so a callback that raises or re-watches sees a consistent state.
        self.unwatch(pid)
        if callback is not None:
            callback(pid)

    # --- fallback: psutil poll ---------------------------------------------------
    def _watch_polled(self, pid: int, callback: Callable[[int], None], loop: asyncio.AbstractEventLoop) -> bool:
        try:
            proc = psutil.Process(pid)
        except psutil.NoSuchProcess:
            return False
        if not _running(proc):
            return False
        self._polled[pid] = proc
        self._callbacks[pid] = callback
        if self._poll_handle is None:
            self._poll_handle = loop.call_later(POLL_S, self._poll)
        return True

    def _poll(self) -> None:
        self._poll_handle = None
        loop = self._get_loop()
        gone = [pid for pid, proc in self._polled.items() if not _running(proc)]
        for pid in gone:
            callback = self._callbacks.get(pid)
            self.unwatch(pid)
            if callback is not None:
                # Each callback in its own handle: one that raises is logged by the loop
                # and cannot stop the others or the next poll.
                loop.call_soon(callback, pid)
        if self._polled and self._poll_handle is None and not self._closed:
            self._poll_handle = self._get_loop().call_later(POLL_S, self._poll)


def _running(proc: psutil.Process) -> bool:
    """Alive and not a zombie; is_running() also compares create times, so a reused pid reads as gone."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        # Another user's process: we cannot read its status, but it exists.
        return proc.is_running()
