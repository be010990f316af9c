"""An instance's output (mpirun + every rank, tagged by rank) in a capped, rotated file.

A local mpirun writes into the file itself (O_APPEND), so it outlives the daemon
(live restore: no pipe whose reader could die). The file is rotated by copy and
truncate (the writer's fd stays valid and its next write lands at the new end), and
the last lines for `status` and for a failed start's error are read from its end.
Slurm's srun still comes through a pipe (`pump`), into the same file.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

TAIL_BYTES = 64 * 1024


class RotatingLog:
    def __init__(self, path: Path, max_bytes: int, backups: int, tail_lines: int = 40):
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self._fh = open(path, "ab", buffering=0)
        os.chmod(path, 0o600)

    def configure(self, max_bytes: int, backups: int) -> None:
        self.max_bytes = max_bytes
        self.backups = backups

    def child_fd(self) -> int:
        """The file's descriptor (O_APPEND) for a child's stdout and stderr."""
        return self._fh.fileno()

    def write_line(self, line: bytes) -> None:
        self._fh.write(line)
        self.rotate_if_over()

    def note(self, text: str) -> None:
        """A line from the orchestrator itself (launch command, exit status)."""
        self.write_line(f"[trtllm-orch] {text}\n".encode())

    def tail(self, n: int = 20) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - TAIL_BYTES))
                data = f.read(TAIL_BYTES)
        except OSError:
            return []
        return [ln.decode(errors="replace") for ln in data.splitlines()[-n:]]

    def rotate_if_over(self) -> None:
        """Copy, then truncate: whoever writes the file (mpirun) keeps writing, at its new end."""
        if os.fstat(self._fh.fileno()).st_size <= self.max_bytes:
            return
        if self.backups:
            for i in range(self.backups - 1, 0, -1):
                src = self.path.with_name(f"{self.path.name}.{i}")
                if src.exists():
                    src.replace(self.path.with_name(f"{self.path.name}.{i + 1}"))
            shutil.copyfile(self.path, self.path.with_name(f"{self.path.name}.1"))
        os.ftruncate(self._fh.fileno(), 0)

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
