"""Is systemd restarting this daemon's unit, or stopping it? Asked on SIGTERM.

`systemctl stop` and `systemctl restart` both end in one SIGTERM to the main process
(KillMode=process): systemd runs a restart job as its stop half, then its start half, and
tells the process nothing more. The two must differ here: stop (and disable --now, and a
shutdown) stops the engines; restart must not (issue 23: a package upgrade's
`systemctl restart` would otherwise reload every model), so the daemon then detaches and the
daemon that the job starts adopts. The job's type says which it is: `systemctl list-jobs`
lists `<unit> restart running` while the stop half runs. Anything unclear (no systemd, no
unit, systemctl failing or slow) answers "stop": the safe default stops what it started.
"""

from __future__ import annotations

import os
from pathlib import Path

from orchestrator.commands import run_command

LIST_JOBS_TIMEOUT_S = 2.0


def own_unit(cgroup_text: str) -> str | None:
    """The .service unit of this process, from /proc/self/cgroup (v1 name=systemd or v2)."""
    for line in cgroup_text.splitlines():
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers in ("", "name=systemd"):
            for part in reversed(path.split("/")):
                if part.endswith(".service"):
                    return part
    return None


def restart_job_for(unit: str, list_jobs_output: str) -> bool:
    """Whether `systemctl list-jobs --no-legend` lists a restart job of `unit`
    (columns: JOB UNIT TYPE STATE)."""
    for line in list_jobs_output.splitlines():
        fields = line.split()
        if len(fields) >= 3 and fields[1] == unit and fields[2] in ("restart", "try-restart", "reload-or-restart"):
            return True
    return False


async def being_restarted() -> bool:
    if not os.environ.get("INVOCATION_ID"):  # systemd sets it for every service it runs
        return False
    try:
        unit = own_unit(Path("/proc/self/cgroup").read_text())
    except OSError:
        return False
    if unit is None:
        return False
    try:
        jobs = await run_command(["systemctl", "list-jobs", "--no-legend", "--no-pager"], LIST_JOBS_TIMEOUT_S)
    except OSError:
        return False
    return jobs.code == 0 and restart_job_for(unit, jobs.out)


__all__ = ["being_restarted", "own_unit", "restart_job_for"]
