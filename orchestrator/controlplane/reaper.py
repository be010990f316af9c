"""Find and stop what a killed daemon left behind.

A SIGKILLed daemon leaves its local groups and its data-plane workers running
(live restore): the next `up` adopts what matches its config (adoption.py) and this
sweep stops the rest; `down` without a daemon stops all of it. Ranks run under
`setpriv --pdeathsig KILL`, so they die with their mpirun; Python-backend stubs exit
when their tritonserver is gone. What is to be stopped is found here: by the pids
in state.json, checked against their start times so a recycled pid is never
killed, and by the environment tag every process of the run carries. Under Slurm the ranks are on other nodes: their job
steps are found by name (launcher/slurm.py) and cancelled through Slurm.
"""

from __future__ import annotations

import asyncio
import glob
import logging
import os

import psutil

from orchestrator.launcher.process_tree import OsOps, alive, same_process, stop_processes, tagged_processes
from orchestrator.launcher.slurm import sweep_steps
from orchestrator.controlplane.statedir import StateDir

log = logging.getLogger("trtllm-orch")


def leftover_processes(sd: StateDir) -> list[psutil.Process]:
    procs: dict[int, psutil.Process] = {p.pid: p for p in tagged_processes(str(sd.root))}
    state = sd.read_state() or {}
    recorded: list[tuple[int, float | None]] = []
    for pid in state.get("proxy_pids", []):
        recorded.append((pid, None))
    for inst in state.get("instances", {}).values():
        if inst.get("mpirun_pid"):
            recorded.append((inst["mpirun_pid"], inst.get("mpirun_create_time")))
    for pid, created in recorded:
        if pid in procs or pid == os.getpid():
            continue
        try:
            proc = psutil.Process(pid)
        except psutil.Error:
            continue
        if not alive(proc):  # a zombie is dead; only its parent (maybe init) can reap it
            continue
        # Without a start time (nginx) we accept only a process that is one of ours by name.
        if created is not None and same_process(pid, created):
            procs[pid] = proc
        elif created is None and _looks_like_nginx(proc, sd):
            procs[pid] = proc
    return list(procs.values())


def _looks_like_nginx(proc: psutil.Process, sd: StateDir) -> bool:
    try:
        return "nginx" in proc.name() and str(sd.root) in " ".join(proc.cmdline())
    except psutil.Error:
        return False


async def sweep_leftovers(sd: StateDir, ops: OsOps, grace_s: float, slurm_steps: bool = True,
                          keep: frozenset[int] = frozenset()) -> list[int]:
    """Stop what a previous daemon left, except `keep`: what this daemon adopts (live restore)."""
    # Job steps on other nodes first (a Slurm run, found by name): nothing local reaches them.
    if slurm_steps:
        await sweep_steps(sd.root)
    procs = [p for p in await asyncio.to_thread(leftover_processes, sd) if p.pid not in keep]
    pids = [p.pid for p in procs]
    if procs:
        async def rescan() -> list[psutil.Process]:
            return [p for p in await asyncio.to_thread(tagged_processes, str(sd.root)) if p.pid not in keep]
        await stop_processes(procs, grace_s, ops, rescan=rescan)
    await asyncio.to_thread(_sweep_shm)
    return pids


def _sweep_shm() -> None:
    regions = glob.glob("/dev/shm/orch_i*_r*_*")
    if not regions:
        return
    in_use = _mapped_shm_paths()  # one scan of every process's maps, not one per region
    for path in regions:
        # Only regions whose owners are gone; our prefixes are unique to this tool. Live
        # ones belong to groups this daemon adopts (live restore), or to another state dir.
        try:
            if os.stat(path).st_uid == os.geteuid() and path not in in_use:
                os.unlink(path)
        except OSError:
            pass


def _mapped_shm_paths() -> set[str]:
    """Every /dev/shm file some process maps now (its /proc/PID/maps)."""
    out: set[str] = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps, "rb") as f:
                for line in f:
                    i = line.find(b"/dev/shm/")
                    if i >= 0:
                        out.add(line[i:].rstrip(b"\n").decode(errors="replace").removesuffix(" (deleted)"))
        except OSError:
            continue
    return out
