"""The state directory: one daemon per directory (a lock), its pids, logs and control socket.

Layout:
    daemon.lock          flock held by the live daemon (contains its pid)
    state.json           what `down` needs after a SIGKILLed daemon: every pid we started
    control.sock         the daemon's control API (0600, in a 0700 directory)
    daemon.log           daemon log when detached
    instances/<id>/      instance.log (+ rotations), the group's private files
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orchestrator.errors import OrchError

log = logging.getLogger("trtllm-orch")


class AlreadyRunning(OrchError):
    pass


class StateDir:
    def __init__(self, root: Path):
        self.root = root
        self._lock_fd: int | None = None

    @property
    def lock_path(self) -> Path:
        return self.root / "daemon.lock"

    @property
    def state_path(self) -> Path:
        return self.root / "state.json"

    @property
    def socket_path(self) -> Path:
        return self.root / "control.sock"

    @property
    def daemon_log_path(self) -> Path:
        return self.root / "daemon.log"

    def instance_dir(self, instance_id: str) -> Path:
        return self.root / "instances" / instance_id

    def ensure(self) -> None:
        # 0700: the control socket and logs are the owner's alone.
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        (self.root / "instances").mkdir(mode=0o700, exist_ok=True)

    def make_instance_dir(self, instance_id: str) -> Path:
        path = self.instance_dir(instance_id)
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        return path

    # --- the one-daemon lock -------------------------------------------------------
    def acquire_lock(self) -> None:
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                holder = self.lock_holder()
                raise AlreadyRunning(f"a daemon{f' (pid {holder})' if holder else ''} already runs "
                                     f"with state dir {self.root}; `trtllm-orch down` stops it") from None
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def lock_holder(self) -> int | None:
        """pid of the daemon holding the lock, or None if nobody holds it."""
        try:
            fd = os.open(self.lock_path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                text = os.pread(fd, 32, 0).decode(errors="replace").strip()
                return int(text) if text.isdigit() else -1
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)

    # --- state file ----------------------------------------------------------------
    def write_state(self, state: dict[str, Any]) -> None:
        tmp = self.state_path.with_suffix(".tmp")
        with open(tmp, "w") as fh:
            json.dump(state, fh, indent=1, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o600)
        tmp.replace(self.state_path)  # atomic: a reader never sees half a file

    def read_state(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.state_path.read_text())
        except FileNotFoundError:
            return None
        except json.JSONDecodeError:
            return {}

    def clear_state(self) -> None:
        self.state_path.unlink(missing_ok=True)


class StateWriter:
    """Writes state.json off the event loop and coalesces bursts of changes.

    The record is taken on the loop when the write starts (consistent, cheap); the
    dump and fsync run in a worker thread. A state change inside a proxy's request
    handler (an ejection) then costs an Event.set(), not a disk flush.
    """

    def __init__(self, state_dir: StateDir, snapshot: Callable[[], dict[str, Any]]):
        self._sd = state_dir
        self._snapshot = snapshot
        self._dirty = asyncio.Event()

    def mark_dirty(self) -> None:
        self._dirty.set()

    async def run(self) -> None:
        """Owned by the daemon, cancelled at its end (after the last write finished)."""
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            write = asyncio.ensure_future(asyncio.to_thread(self._sd.write_state, self._snapshot()))
            try:
                await asyncio.shield(write)
            except asyncio.CancelledError:
                # Let the thread finish, so no write lands after the daemon cleared the file;
                # through the owner's repeated cancels too (tasks.cancel_and_wait).
                while not write.done():
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.wait({write})
                if not write.cancelled():
                    write.exception()  # retrieved: the stop goes on either way
                raise
            except OSError as exc:
                log.error("cannot write %s: %s", self._sd.state_path, exc)
