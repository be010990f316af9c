"""Copy an instance's output (mpirun + every rank, tagged by rank) into a capped, rotated file.

We read mpirun's stdout through a pipe instead of handing it the file so that
the file can be rotated by size and the last lines are at hand for `status` and
for the error printed when an instance fails to start.
"""

from __future__ import annotations

import asyncio
import collections
import os
from pathlib import Path


class RotatingLog:
    def __init__(self, path: Path, max_bytes: int, backups: int, tail_lines: int = 40):
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self._tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self._fh = open(path, "ab", buffering=0)
        os.chmod(path, 0o600)
        self._size = self._fh.tell()

    def configure(self, max_bytes: int, backups: int) -> None:
        self.max_bytes = max_bytes
        self.backups = backups

    def write_line(self, line: bytes) -> None:
        if self._size + len(line) > self.max_bytes:
            self._rotate()
        self._fh.write(line)
        self._size += len(line)
        self._tail.append(line.decode(errors="replace").rstrip("\n"))

    def note(self, text: str) -> None:
        """A line from the orchestrator itself (launch command, exit status)."""
        self.write_line(f"[trtllm-orch] {text}\n".encode())

    def tail(self, n: int = 20) -> list[str]:
        return list(self._tail)[-n:]

    def _rotate(self) -> None:
        self._fh.close()
        shift_out(self.path, self.backups)
        self._fh = open(self.path, "ab", buffering=0)
        os.chmod(self.path, 0o600)
        self._size = 0

    def close(self) -> None:
        self._fh.close()


def shift_out(path: Path, backups: int) -> None:
    """path -> path.1 -> ... -> path.<backups> (the oldest dropped); path itself is gone after."""
    if backups:
        for i in range(backups - 1, 0, -1):
            src = path.with_name(f"{path.name}.{i}")
            if src.exists():
                src.replace(path.with_name(f"{path.name}.{i + 1}"))
        path.replace(path.with_name(f"{path.name}.1"))
    else:
        path.unlink(missing_ok=True)


def shift_out_if_over(path: Path, max_bytes: int, backups: int) -> bool:
    """For a log another process writes (NGINX's error.log): shift it out once it is over
    max_bytes. True when it did: the writer must reopen it (it still writes to path.1)."""
    try:
        if path.stat().st_size <= max_bytes:
            return False
    except FileNotFoundError:
        return False
    shift_out(path, backups)
    return True


async def pump(stream: asyncio.StreamReader, log: RotatingLog) -> None:
    """Copy lines until EOF (mpirun and every rank have closed their output)."""
    while True:
        try:
            line = await stream.readuntil(b"\n")
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                log.write_line(exc.partial + b"\n")
            return
        except asyncio.LimitOverrunError as exc:
            line = await stream.read(exc.consumed)
        log.write_line(line)
