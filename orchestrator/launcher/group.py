"""One TP group's mpirun job, from spawn to "nothing of it is left".

`ProcessGroup` is the process side of an instance: it spawns the job, copies its
output into the instance log, reports any exit of its processes, and stops it
(grace, SIGKILL, ports free, GPUs released, shared memory cleaned). The
instance's state machine (`orchestrator/controlplane/instance.py`) decides *when*; this
decides nothing and only does. Unit tests of the state machine replace it
(see tests/fakes.py).

Every call that scans /proc, asks NVML or the kernel's socket table runs in a
worker thread: the event loop that runs the group also serves traffic.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pwd
import signal
import time
from collections.abc import Callable, Mapping

import psutil

from orchestrator import release
from orchestrator.health.exit_watch import ExitWatcher
from orchestrator.launcher.adopted import UNKNOWN_EXIT, AdoptedProcess
from orchestrator.plan import InstancePlan
from orchestrator.launcher.command import LaunchCommand, shm_prefix, shm_scope
from orchestrator.launcher.logfile import RotatingLog, pump
from orchestrator.launcher.process_tree import OsOps, alive, stop_processes

log = logging.getLogger("trtllm-orch")

# systemd's notify/watchdog variables are the daemon's alone (NotifyAccess=main).
_DAEMON_ONLY_ENV = frozenset({"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"})


def spawn_env(daemon_env: Mapping[str, str], added: Mapping[str, str]) -> dict[str, str]:
    """The environment a group starts with: the daemon's, less what is systemd's word to the
    daemon alone, plus the command's. HOME is set when missing: systemd starts a service
    without one unless it names a User=, and Open MPI's mpirun then fails at once
    ("Unable to get the user home directory", opal_init)."""
    env = {k: v for k, v in daemon_env.items() if k not in _DAEMON_ONLY_ENV}
    env.update(added)
    if not env.get("HOME"):
        try:
            env["HOME"] = pwd.getpwuid(os.getuid()).pw_dir or "/"
        except KeyError:  # a uid with no passwd entry
            env["HOME"] = "/"
    return env

# A group that already failed has nothing to drain (a TP job missing a rank cannot
# answer): stop() SIGKILLs all of it at once, mpirun included (prterun took ~0.3 s to
# exit on SIGTERM once its ranks were gone, and a rank blocked in a collective does
# not act on SIGTERM). On the H200 acceptance run a 0.3 s grace for the survivors was
# spent in full on every TP2 restart. This grace is only for failed groups whose
# processes cannot be SIGKILLed from here (launcher.slurm: the step's node).
FAILED_GROUP_GRACE_S = 0.3
# How long the SIGKILLed processes of a failed group may take to be gone (a process
# in the GPU driver exits when the driver lets it) before stop() goes on regardless.
KILL_WAIT_S = 30.0
RESCAN_EVERY_S = 0.2
KILL_POLL_S = 0.005

# How long stop() waits for ports and GPUs to be released before it gives up and
# lets the next start report what still holds them, and how often it looks (off the
# loop; on the H200 machine one look at NVML's process lists of two GPUs took ~8 ms
# while the driver was tearing contexts down).
RELEASE_TIMEOUT_S = 10.0
RELEASE_POLL_S = 0.002


class LaunchFailed(Exception):
    """The group could not be started; the message is the instance's failure reason."""


Trouble = Callable[[str], None]  # called with a reason when a process of the group exits


class ProcessGroup:
    # A local mpirun writes its output to the instance log itself and outlives the daemon
    # (live restore: the next daemon adopts it). SlurmGroup's srun does not (False).
    outlives_daemon = True

    def __init__(self, plan: InstancePlan, state_dir: str, ops: OsOps, exit_watcher: ExitWatcher,
                 gpu_holders: Callable[[tuple[int, ...]], set[int]] | None, log_file: RotatingLog,
                 on_trouble: Trouble):
        self.plan = plan
        self._state_dir = state_dir
        self._ops = ops
        self._watcher = exit_watcher
        self._gpu_holders = gpu_holders
        self.log = log_file
        self._on_trouble = on_trouble
        self.mpirun: asyncio.subprocess.Process | None = None
        self.mpirun_create_time: float | None = None
        self.pids: list[int] = []
        self.command: LaunchCommand | None = None  # what runs now: `status` shows it
        self.started_by = ""  # the version of trtllm-orch that launched what runs now
        self._stopping = False
        self._pump: asyncio.Task | None = None
        self._exit_wait: asyncio.Task | None = None

    # --- views -----------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self.mpirun is not None and self.mpirun.returncode is None

    @property
    def mpirun_pid(self) -> int | None:
        return self.mpirun.pid if self.running else None  # type: ignore[union-attr]  # running: mpirun is set

    @property
    def exit_code(self) -> int | None:
        return self.mpirun.returncode if self.mpirun is not None else None

    # --- launch ----------------------------------------------------------------------
    async def launch(self, cmd: LaunchCommand) -> None:
        """Spawn the job. Raises LaunchFailed with the reason (a taken port, a missing binary)."""
        busy = await asyncio.to_thread(self._ops.taken_ports, self.plan.bind_address, self.plan.ports.all())
        if busy:
            raise LaunchFailed(f"port(s) {', '.join(busy)} already in use")
        await self._spawn(cmd)

    async def _spawn(self, cmd: LaunchCommand) -> None:
        """Start the local process of the job (mpirun; srun for launcher.slurm.SlurmGroup)."""
        self.log.note("launch: " + cmd.shell_text())
        env = spawn_env(os.environ, cmd.env)
        try:
            if cmd.scratch:
                await asyncio.to_thread(self._ops.fresh_dir, cmd.scratch)
            proc = await self._ops.spawn(cmd.argv, env, self.log.child_fd() if self.outlives_daemon else None)
        except OSError as exc:
            raise LaunchFailed(f"could not start {cmd.argv[0]}: {exc}") from None
        self._stopping = False
        self.command = cmd
        self.started_by = release()
        self.mpirun = proc
        self.mpirun_create_time = self._ops.create_time(proc.pid)  # one stat of /proc/PID
        self.pids = [proc.pid]
        if proc.stdout is not None:
            self._pump = asyncio.create_task(pump(proc.stdout, self.log), name=f"log-pump-{self.plan.instance_id}")
        self._exit_wait = asyncio.create_task(self._watch_mpirun(proc),
                                              name=f"mpirun-wait-{self.plan.instance_id}")

    def adopt(self, pid: int, create_time: float, cmd: LaunchCommand, started_by: str) -> bool:
        """Take over the group a previous daemon launched (live restore). Its mpirun is not
        our child: its exit comes through a pidfd; the ranks are watched as after a launch
        (`watch_all`). False if it is gone already."""
        proc = AdoptedProcess(pid, create_time, self._watcher)
        if proc.returncode is not None:
            return False
        self._stopping = False
        self.command = cmd
        self.started_by = started_by
        self.mpirun = proc  # type: ignore[assignment]
        self.mpirun_create_time = create_time
        self.pids = [pid]
        self.log.note(f"adopted mpirun pid {pid} (started by trtllm-orch {started_by or '?'})")
        self._exit_wait = asyncio.create_task(self._watch_mpirun(proc),  # type: ignore[arg-type]
                                              name=f"mpirun-wait-{self.plan.instance_id}")
        return True

    async def _watch_mpirun(self, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        if not self._stopping:
            self._on_trouble(self._exit_reason(proc.pid, code))

    def _exit_reason(self, pid: int, code: int) -> str:
        if code == UNKNOWN_EXIT:  # adopted: its exit status went to init
            return f"mpirun (pid {pid}, adopted) exited"
        return f"mpirun (pid {pid}) exited with code {code}"

    async def watch_all(self) -> None:
        """Event-driven exit detection for every rank, daemon and stub of the running job."""
        if self.mpirun is None:
            return
        procs = await asyncio.to_thread(self._ops.process_tree, self.mpirun.pid)
        self.pids = [p.pid for p in procs] or [self.mpirun.pid]
        for p in procs[1:]:  # mpirun itself is watched through proc.wait()
            name = await asyncio.to_thread(_name, p)
            watching = self._watcher.watch(
                p.pid, lambda pid, name=name: self._report_exit(f"{name} (pid {pid}) exited"))  # type: ignore[misc]
            if not watching:  # died between the tree scan and the watch
                self._report_exit(f"{name} (pid {p.pid}) exited")

    def _report_exit(self, reason: str) -> None:
        if not self._stopping:
            self._on_trouble(reason)

    # --- stop ------------------------------------------------------------------------
    async def stop(self, grace_s: float, failed: bool = False) -> None:
        """Every process of the group gone, ports free, GPUs released, shm cleaned.

        A clean stop gives every process `grace_s` to finish its requests. A failed
        group has nothing left to drain (a TP job missing a rank cannot answer; its
        ranks and stubs are often blocked mid-collective and deaf to SIGTERM), so all
        of it, mpirun included, is SIGKILLed at once: restart overhead is what clients
        wait for.
        """
        self._stopping = True
        t0 = time.monotonic()
        for pid in self.pids:
            self._watcher.unwatch(pid)
        iid = self.plan.instance_id
        root = self.mpirun.pid if self.mpirun is not None else None
        pgids = [root] if root is not None and self.running else []  # its own session: pgid == pid
        known = list(self.pids)
        if failed:
            # What we know of the group dies before the /proc scan that finds the rest:
            # every millisecond here is one more of the GPU driver's teardown to wait for.
            for pgid in pgids:
                self._ops.killpg(pgid, signal.SIGKILL)
            for pid in known:
                self._ops.kill(pid, signal.SIGKILL)
        procs = await asyncio.to_thread(self._ops.group_processes, self._state_dir, iid, root)

        async def rescan() -> list[psutil.Process]:
            return await asyncio.to_thread(self._ops.group_processes, self._state_dir, iid, None)

        killed: list[int] = []
        at_once: list[int] = []
        if failed:
            grace_s = 0.0
            at_once = await self._kill_all(procs, pgids, rescan, known)
            self.log.note(f"SIGKILLed at once (failed group, nothing to drain): {at_once}")
        else:
            killed = await stop_processes(procs, grace_s, self._ops, pgids=pgids, rescan=rescan)
            if killed:
                self.log.note(f"SIGKILLed after {grace_s:g}s grace: {killed}")
        t_killed = time.monotonic()
        if self.mpirun is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.mpirun.wait(), 5)
            self.log.note(f"mpirun exited with code {self.mpirun.returncode}")
        await self._end_tasks()
        t_reaped = time.monotonic()
        stopped_pids = set(self.pids) | {p.pid for p in procs}  # before READY, self.pids is only mpirun
        scratch = self.command.scratch if self.command is not None else ""
        self.mpirun, self.pids, self.command = None, [], None
        await asyncio.to_thread(self._ops.unlink_shm, self._shm_prefixes())
        if scratch:
            await asyncio.to_thread(self._ops.remove_dir, scratch)
        released = await self._wait_released(stopped_pids)
        how = f"{len(at_once)} SIGKILLed at once" if failed else f"{len(killed)} SIGKILLed after {grace_s:g}s grace"
        log.debug("instance=%s stop: processes %.3fs (%s), reap+log %.3fs, release %.3fs (%s)", iid,
                  t_killed - t0, how, t_reaped - t_killed, time.monotonic() - t_reaped, released)

    async def _kill_all(self, procs: list[psutil.Process], pgids: list[int], rescan,
                        signalled_before: list[int]) -> list[int]:
        """SIGKILL every process (and mpirun's process group) now; wait until they are gone.

        A process that appears meanwhile (a rank forking a stub) is SIGKILLed as found.
        Returns the pids signalled, `signalled_before` (SIGKILLed by the caller) included."""
        for pgid in pgids:
            self._ops.killpg(pgid, signal.SIGKILL)
        live = {p.pid: p for p in procs}
        for pid in live:
            self._ops.kill(pid, signal.SIGKILL)
        signalled = set(live) | set(signalled_before)
        deadline = time.monotonic() + KILL_WAIT_S
        next_rescan = time.monotonic() + RESCAN_EVERY_S
        while time.monotonic() < deadline:
            live = {pid: p for pid, p in live.items() if alive(p)}
            if not live or time.monotonic() >= next_rescan:
                late = [p for p in await rescan() if p.pid not in signalled]
                for p in late:
                    self._ops.kill(p.pid, signal.SIGKILL)
                    signalled.add(p.pid)
                    live[p.pid] = p
                next_rescan = time.monotonic() + RESCAN_EVERY_S
                if not live:
                    break
            await asyncio.sleep(KILL_POLL_S)
        else:
            log.warning("instance=%s pids %s still alive %.0fs after SIGKILL", self.plan.instance_id,
                        sorted(live), KILL_WAIT_S)
        return sorted(signalled)

    async def _end_tasks(self) -> None:
        for task in (self._exit_wait, self._pump):
            if task is not None:
                if not task.done():
                    with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                        await asyncio.wait_for(task, 2)
                task.cancel()
        self._exit_wait = self._pump = None

    def _shm_prefixes(self) -> list[str]:
        # A SIGKILLed Python-backend stub leaves its regions in /dev/shm (RAM); they are ours.
        scope = shm_scope(self._state_dir)
        return [shm_prefix(self.plan.instance_id, rank, scope) for rank in range(self.plan.tp)]

    async def _wait_released(self, pids: set[int]) -> str:
        """Ports free and (with NVML) the group's GPUs no longer hold its processes.

        Returns what it saw, for the stop's debug line: when the ports and the GPUs
        were free, relative to the call, and how many polls it took."""
        t0 = time.monotonic()
        deadline = t0 + RELEASE_TIMEOUT_S
        ports = self.plan.ports.all()
        busy: list[str] = []
        holders: set[int] = set()
        ports_free_at = gpus_free_at = None
        polls = 0
        pending = tuple(self.plan.gpus)
        while time.monotonic() < deadline:
            # Ports once free stay ours to take, and so does a GPU that no longer lists our
            # processes (they are gone): from then on only the rest is asked.
            busy, holders, strangers, pending = await asyncio.to_thread(
                self._held, ports if ports_free_at is None else (), pids, pending)
            polls += 1
            now = time.monotonic() - t0
            if not busy and ports_free_at is None:
                ports_free_at = now
            if not holders and gpus_free_at is None:
                gpus_free_at = now
            if not busy and not holders:
                return f"ports free +{ports_free_at:.3f}s, GPUs free +{gpus_free_at:.3f}s, {polls} polls"
            if strangers:
                # Another program holds the port: waiting cannot free it, and the next
                # start reports who holds it (BACKOFF) instead of stalling here for 10 s.
                return f"port(s) {', '.join(busy)} held by another program"
            await asyncio.sleep(RELEASE_POLL_S)
        log.warning("instance=%s resources still held %.0fs after stop (ports %s, GPU pids %s)",
                    self.plan.instance_id, RELEASE_TIMEOUT_S, busy, sorted(holders))
        return f"still held after {RELEASE_TIMEOUT_S:g}s: ports {busy}, GPU pids {sorted(holders)}"

    def _held(self, ports: tuple[int, ...], pids: set[int],
              gpus: tuple[int, ...]) -> tuple[list[str], set[int], bool, tuple[int, ...]]:
        """(taken ports, our pids still on `gpus`, whether the ports are held by a stranger,
        the GPUs among `gpus` that still list our pids)."""
        busy = self._ops.taken_ports(self.plan.bind_address, ports)
        holders: set[int] = set()
        still = []
        if self._gpu_holders is not None:
            for gpu in gpus:  # one GPU at a time: a freed GPU is not asked again
                on = self._gpu_holders((gpu,)) & pids
                if on:
                    holders |= on
                    still.append(gpu)
        strangers = False
        if busy and not holders:
            owners = self._ops.listening_pids(ports)
            strangers = owners is not None and not owners & pids
        return busy, holders, strangers, tuple(still)


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.Error:
        return "process"
