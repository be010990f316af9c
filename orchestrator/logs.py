"""`trtllm-orch logs ID [--rank N] [-f] [--lines N]`: read an instance's log file.

mpirun tags every line with its rank (Open MPI `--tag-output`: `[1,N]<stdout>:`,
Hydra `-prepend-rank`: `[N] `), so one file holds the whole group and a rank
is a filter, whatever the MPI flavour.
"""

from __future__ import annotations

import re
import sys
import time
from collections import deque

from orchestrator.errors import UsageError
from orchestrator.controlplane.statedir import StateDir

_RANK_TAG = re.compile(rb"^\[(?:\d+,)?(\d+)\](?:<std(?:out|err)>:)?")


def line_rank(line: bytes) -> int | None:
    m = _RANK_TAG.match(line)
    return int(m.group(1)) if m else None


def show_logs(sd: StateDir, instance_id: str, rank: int | None, lines: int, follow: bool) -> int:
    if lines < 0:  # deque(maxlen=-1) raised a ValueError traceback
        raise UsageError("--lines", lines, "must be >= 0")
    try:
        return _show_logs(sd, instance_id, rank, lines, follow)
    except BrokenPipeError:  # `logs ID | head`: the reader is gone, which is no error
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0


def _show_logs(sd: StateDir, instance_id: str, rank: int | None, lines: int, follow: bool) -> int:
    path = sd.instance_dir(instance_id) / "instance.log"
    if not path.exists():
        known = sorted(p.name for p in (sd.root / "instances").glob("*")) if (sd.root / "instances").exists() else []
        raise UsageError("ID", instance_id, f"no log at {path} (instances with logs: {', '.join(known) or 'none'})")

    def keep(line: bytes) -> bool:
        return rank is None or line_rank(line) == rank

    out = sys.stdout.buffer
    with open(path, "rb") as fh:
        for line in deque((ln for ln in fh if keep(ln)), maxlen=lines):
            out.write(line)
        out.flush()
        if not follow:
            return 0
        inode = path.stat().st_ino
        try:
            while True:
                line = fh.readline()
                if line:
                    if keep(line):
                        out.write(line)
                        out.flush()
                    continue
                time.sleep(0.2)
                try:
                    if path.stat().st_ino != inode:  # rotated: continue in the new file
                        fh.close()
                        fh = open(path, "rb")
                        inode = path.stat().st_ino
                except FileNotFoundError:
                    pass
        except KeyboardInterrupt:
            return 0
