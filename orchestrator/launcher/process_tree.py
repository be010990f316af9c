"""Spawn an instance's mpirun and make sure every process of it is gone when stopped.

All OS calls go through `OsOps`, so tests can inject failures (a spawn that
raises, a kill that is ignored) without monkeypatching the standard library;
supervisor does the same with its `options` object.

What "every process" means: mpirun, its daemons (prted/orted), the ranks and the
Python-backend stubs. We find them two ways and take the union: the live process
tree under mpirun, and any process whose environment carries our tags (the
rank's tree can be cut when mpirun dies, and then only the tag still links an
orphan to us).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import glob
import os
import shutil
import signal
import time
from collections.abc import Awaitable, Callable, Iterable

import psutil

from orchestrator.launcher.command import ENV_INSTANCE, ENV_STATE_DIR
from orchestrator.launcher.ports import listening_pids, taken_ports

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    # If the daemon is SIGKILLed, mpirun gets SIGTERM and tears its ranks down,
    # so nothing of the run is left unsupervised.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _pdeathsig_wrapper() -> tuple[str, ...]:
    setpriv = shutil.which("setpriv")
    return (setpriv, "--pdeathsig", "TERM", "--") if setpriv else ()


class OsOps:
    """The OS calls the launcher makes. Tests subclass it to inject faults."""

    async def spawn(self, argv: tuple[str, ...], env: dict[str, str], log_fd: int | None,
                    cwd: str | None = None) -> asyncio.subprocess.Process:
        """Start argv in a session of its own.

        log_fd None: its output comes through a pipe, and it dies with the daemon (parent-death
        signal): Slurm's srun, whose steps the daemon cancels through Slurm. log_fd given: it
        writes its output to that file (O_APPEND) and outlives the daemon: a local mpirun,
        adopted by the next daemon (live restore), stopped only by `down` or a restart. A
        pipe would not do for that: with its reader gone, the next line would kill it (EPIPE).
        """
        # Parent-death signal through `setpriv` (same pid: it execs argv[0]) rather than a
        # preexec_fn: a preexec_fn forces fork() + Python code in the child, which runs the
        # daemon's pthread_atfork handlers; gRPC's (the gRPC proxy) restart its poller
        # thread in the child, and close_fds then makes it abort the child (SIGABRT,
        # "epoll_wait error: Bad file descriptor") before mpirun even starts. Without
        # a preexec_fn CPython uses vfork(), which runs no atfork handlers.
        outlives = log_fd is not None
        wrapper = () if outlives else _pdeathsig_wrapper()
        if wrapper and shutil.which(argv[0]) is None:  # as exec would fail without the wrapper
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), argv[0])
        return await asyncio.create_subprocess_exec(
            *wrapper, *argv, env=env, cwd=cwd, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE if log_fd is None else log_fd,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,  # own session and process group: killpg reaches all of it
            preexec_fn=None if wrapper or outlives else _die_with_parent)

    def kill(self, pid: int, sig: int) -> None:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    def killpg(self, pgid: int, sig: int) -> None:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    # Discovery. These block (they read /proc or the socket table): callers on the
    # event loop run them in a worker thread (asyncio.to_thread).
    def process_tree(self, root_pid: int) -> list[psutil.Process]:
        return process_tree(root_pid)

    def group_processes(self, state_dir: str, instance_id: str, root_pid: int | None) -> list[psutil.Process]:
        """The union of the live tree under `root_pid` and every process tagged for the instance."""
        procs = {p.pid: p for p in tagged_processes(state_dir, instance_id)}
        if root_pid is not None:
            for p in process_tree(root_pid):
                procs.setdefault(p.pid, p)
        return list(procs.values())

    def create_time(self, pid: int) -> float | None:
        try:
            return psutil.Process(pid).create_time()
        except psutil.Error:
            return None

    def taken_ports(self, host: str, ports: tuple[int, ...]) -> list[str]:
        return taken_ports(host, ports)

    def listening_pids(self, ports: tuple[int, ...]) -> set[int] | None:
        return listening_pids(ports)

    def fresh_dir(self, path: str) -> None:
        """`path` exists, owner-only and empty."""
        self.remove_dir(path)
        os.makedirs(path, mode=0o700)

    def remove_dir(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def unlink_shm(self, prefixes: Iterable[str]) -> None:
        for prefix in prefixes:
            for path in glob.glob(f"/dev/shm/{prefix}*"):
                with contextlib.suppress(OSError):
                    os.unlink(path)


def alive(proc: psutil.Process) -> bool:
    """Running and not a zombie (a zombie holds no resources, only a pid)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def process_of(pid: int) -> psutil.Process | None:
    """The process with this pid now (it keeps its start time: `alive` later tells a reused pid
    apart), or None where there is none."""
    if pid <= 0:
        return None
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def tagged_processes(state_dir: str, instance_id: str | None = None) -> list[psutil.Process]:
    """Processes whose environment says they belong to this state dir (and instance)."""
    found = []
    me = os.getpid()
    for proc in psutil.process_iter(["pid"]):
        if proc.pid == me:
            continue
        try:
            env = proc.environ()
        except (psutil.Error, OSError):
            continue
        if env.get(ENV_STATE_DIR) != state_dir:
            continue
        if instance_id is not None and env.get(ENV_INSTANCE) != instance_id:
            continue
        if alive(proc):
            found.append(proc)
    return found


def process_tree(root_pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(root_pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def same_process(pid: int, create_time: float) -> bool:
    """True if `pid` is still the process we started (not a recycled pid)."""
    try:
        return abs(psutil.Process(pid).create_time() - create_time) < 0.01
    except psutil.Error:
        return False


# A rescan reads every process's environment on the host: cheap enough every 200 ms
# (in a worker thread), not every 20 ms. Liveness checks of known pids stay at 20 ms.
RESCAN_EVERY_S = 0.2
POLL_S = 0.02

Rescan = Callable[[], Awaitable[list[psutil.Process]]]


async def stop_processes(procs: Iterable[psutil.Process], grace_s: float, ops: OsOps,
                         first_signal: int = signal.SIGTERM, pgids: Iterable[int] = (),
                         rescan: Rescan | None = None) -> list[int]:
    """TERM (or `first_signal`), wait up to `grace_s`, KILL what is left; return the pids KILLed.

    `rescan` (optional, async) returns processes that appeared meanwhile (a rank
    forked a stub while we were stopping): they are added before the final check.
    """
    live = {p.pid: p for p in procs if alive(p)}
    for pgid in pgids:
        ops.killpg(pgid, first_signal)
    for proc in live.values():
        ops.kill(proc.pid, first_signal)
    deadline = time.monotonic() + grace_s
    killed: list[int] = []
    next_rescan = 0.0
    while True:
        if rescan is not None and time.monotonic() >= next_rescan:
            for p in await rescan():
                live.setdefault(p.pid, p)
            next_rescan = time.monotonic() + RESCAN_EVERY_S
        live = {pid: p for pid, p in live.items() if alive(p)}
        if not live:
            late = await rescan() if rescan is not None else []  # one last look before "done"
            if not late:
                return killed
            live.update((p.pid, p) for p in late)
            continue
        if time.monotonic() >= deadline:
            break
        await asyncio.sleep(POLL_S)
    for pgid in pgids:
        ops.killpg(pgid, signal.SIGKILL)
    for pid in live:
        ops.kill(pid, signal.SIGKILL)
        killed.append(pid)
    # SIGKILL cannot be ignored; a process in uninterruptible sleep (a GPU driver
    # call) may still take a moment, so wait for it rather than declare it gone.
    hard_deadline = time.monotonic() + 30
    next_rescan = 0.0
    while time.monotonic() < hard_deadline:
        if rescan is not None and time.monotonic() >= next_rescan:
            for p in await rescan():
                if p.pid not in live:
                    ops.kill(p.pid, signal.SIGKILL)
                    live[p.pid] = p
            next_rescan = time.monotonic() + RESCAN_EVERY_S
        live = {pid: p for pid, p in live.items() if alive(p)}
        if not live:
            if rescan is None:
                break
            late = [p for p in await rescan() if p.pid not in live]
            if not late:
                break
            for p in late:
                ops.kill(p.pid, signal.SIGKILL)
                live[p.pid] = p
        await asyncio.sleep(POLL_S)
    return killed
