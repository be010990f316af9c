"""Running a short external command from the event loop (systemctl, the Slurm client
commands): never blocking the loop, always with a timeout, and a cancel kills the child
rather than leaving it to run unowned."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Result:
    code: int
    out: str
    err: str

    def line(self) -> str:
        """The last line the command printed about a failure, for one-line error messages."""
        text = (self.err or self.out).strip()
        return text.splitlines()[-1] if text else f"exit code {self.code}"


async def run_command(argv: list[str], timeout_s: float) -> Result:
    """Exit code 127 when the command is not found, 124 when it did not end within `timeout_s`."""
    try:
        proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
    except FileNotFoundError:
        return Result(127, "", f"{argv[0]} not found")
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except asyncio.TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        return Result(124, "", f"{argv[0]} did not answer within {timeout_s:g}s")
    except asyncio.CancelledError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise
    return Result(proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace"))


__all__ = ["Result", "run_command"]
