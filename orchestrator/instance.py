"""One instance: a TP group's mpirun job, its state machine, its health, its restarts.

`Instance.supervise()` is the instance's whole life and the only place that
starts or stops its processes. Everything else (exit watchers, the proxy's
passive health reports, `restart`/`down` commands) only records what happened
and wakes the loop; state changes all go through `_move`, which checks the edge
is legal and logs why.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import logging
import os
import re
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from .config import Settings
from .health.canary import CanaryScheduler, default_canary_body, run_canary
from .health.exit_watch import ExitWatcher
from .health.probes import probe_instance, wait_until_ready
from .health.restart_policy import RestartPolicy
from .launcher.command import LaunchCommand, shm_prefix, shm_scope
from .launcher.logfile import RotatingLog, pump
from .launcher.ports import listening_pids, taken_ports
from .launcher.process_tree import OsOps, process_tree, stop_processes, tagged_processes
from .plan import InstancePlan
from .proxy.backends import Backend
from .states import SERVING_STATES, State, check_transition
from .statedir import StateDir

log = logging.getLogger("trtllm-orch")

# tritonserver error lines ("E1121 12:00:00.1 ..."), Python exceptions, failed loads.
_ERROR_LINE = re.compile(r"(<std(?:out|err)>:\s*|^)E\d{4} |Traceback|Error|error:|failed to load|"
                         r"Exception|exited with code [^0]")

_DAEMON_ONLY_ENV = frozenset({"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"})

# Grace for the survivors of a group that already failed (see _stop_group).
# 0.3 s: on the H200 acceptance run a 1 s grace was spent in full on every restart
# (GPUs free after 0.2 s, relaunch after 1.2 s); a broken TP group has nothing to drain.
FAILED_GROUP_GRACE_S = 0.3


@dataclass
class Shared:
    """What every instance of one daemon shares; owned and closed by the daemon."""

    settings: Settings
    state_dir: StateDir
    ops: OsOps
    session: aiohttp.ClientSession
    exit_watcher: ExitWatcher
    build_command: Callable[[InstancePlan], LaunchCommand]
    gpu_holders: Callable[[tuple[int, ...]], set[int]] | None  # NVML: pids holding memory on GPUs


class _Command:
    STOP = "stop"
    RESTART = "restart"


class Instance:
    def __init__(self, plan: InstancePlan, shared: Shared, on_change: Callable[["Instance"], None]):
        self.plan = plan
        self.id = plan.instance_id
        self._shared = shared
        self._s = shared.settings
        self._on_change = on_change
        self.state = State.STOPPED
        self.reason = "not started"
        self.last_failure = ""
        self.restarts = 0
        self.started_at: float | None = None  # monotonic
        self.ready_at: float | None = None
        self.startup_s: float | None = None  # how long the last start took to READY
        self.mpirun: asyncio.subprocess.Process | None = None
        self.mpirun_create_time: float | None = None
        self.pids: list[int] = []
        self._wake = asyncio.Event()
        self._command: str | None = None
        self._trouble: str | None = None
        self._suspect: str | None = None
        self._log: RotatingLog | None = None
        self._pump: asyncio.Task | None = None
        self._exit_wait: asyncio.Task | None = None
        self.policy = RestartPolicy(self._s.backoff_initial_s, self._s.backoff_max_s,
                                    self._s.stable_after_s, self._s.max_failures,
                                    self._s.failure_window_s)
        self.canary = CanaryScheduler(self._s.canary_interval_s, self._s.canary_idle_s)
        self.canary_body = _canary_body(self._s)
        self.dir = shared.state_dir.make_instance_dir(self.id)

    # --- views ---------------------------------------------------------------------
    @property
    def backend(self) -> Backend:
        p = self.plan.ports
        return Backend(self.id, self.plan.bind_address, p.http, p.grpc, p.metrics)

    @property
    def base_url(self) -> str:
        return self.backend.http_url

    @property
    def serving(self) -> bool:
        return self.state in SERVING_STATES

    def log_tail(self, n: int = 20) -> list[str]:
        return self._log.tail(n) if self._log else []

    def error_lines(self, n: int = 3) -> list[str]:
        """The last lines that look like the actual error (a model's exception, a
        tritonserver E-line), not mpirun's closing boilerplate; else the plain tail."""
        if not self._log:
            return []
        lines = self._log.tail(200)
        hits = [ln for ln in lines if _ERROR_LINE.search(ln)]
        return (hits or lines)[-n:]

    def describe(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "id": self.id, "gpus": list(self.plan.gpus), "state": self.state.value,
            "reason": self.reason, "last_failure": self.last_failure, "restarts": self.restarts,
            "ports": {"http": self.plan.ports.http, "grpc": self.plan.ports.grpc,
                      "metrics": self.plan.ports.metrics},
            "bind_address": self.plan.bind_address,
            "mpirun_pid": self.mpirun.pid if self.mpirun and self.mpirun.returncode is None else None,
            "pids": self.pids,
            "uptime_s": round(now - self.ready_at, 1) if self.ready_at and self.serving else None,
            "startup_s": round(self.startup_s, 2) if self.startup_s is not None else None,
            "log": str(self.dir / "instance.log"),
            "log_tail": self.log_tail(10) if self.state not in SERVING_STATES else [],
            "errors": self.error_lines(5) if self.state not in SERVING_STATES else [],
        }

    def state_record(self) -> dict[str, Any]:
        """What `down` needs if the daemon is SIGKILLed: pids with their start times."""
        return {"state": self.state.value,
                "mpirun_pid": self.mpirun.pid if self.mpirun else None,
                "mpirun_create_time": self.mpirun_create_time,
                "pids": self.pids, "gpus": list(self.plan.gpus),
                "ports": list(self.plan.ports.all())}

    # --- commands (from the daemon, the proxy, the control socket) -----------------
    def request_stop(self) -> None:
        self._command = _Command.STOP
        self._wake.set()

    def request_restart(self) -> None:
        if self._command != _Command.STOP:
            self._command = _Command.RESTART
            self._wake.set()

    def report_trouble(self, reason: str) -> None:
        """A process of the group exited, or a check failed: leave rotation now, restart."""
        if self._trouble is None:
            self._trouble = reason
        if self.state == State.READY:
            self._move(State.UNHEALTHY, reason)  # out of the load balancer before anything else
        self._wake.set()

    def suspect(self, reason: str) -> None:
        """The proxy saw repeated failures: stop routing here until a canary says otherwise."""
        if self.state == State.READY:
            self._suspect = reason
            self._move(State.UNHEALTHY, reason)
            self._wake.set()

    def note_traffic_ok(self) -> None:
        self.canary.note_traffic()

    def apply_settings(self, settings: Settings) -> None:
        """A reload: the next launch of this instance uses the new settings (model repo, args)."""
        self._s = settings
        self.canary_body = _canary_body(settings)

    # --- the state machine -----------------------------------------------------------
    def _move(self, new: State, reason: str) -> None:
        check_transition(self.state, new)
        old, self.state, self.reason = self.state, new, reason
        level = logging.WARNING if new in (State.UNHEALTHY, State.FAILED, State.BACKOFF) else logging.INFO
        log.log(level, "instance=%s gpus=%s %s -> %s: %s", self.id, self.plan.cuda_visible_devices,
                old.value, new.value, reason)
        self._on_change(self)

    async def supervise(self, autostart: bool = True) -> None:
        """The instance's life. Returns after a stop request once nothing of it runs."""
        pending_start = "started" if autostart else None
        while True:
            if pending_start is None:
                command = await self._next_command()
                if command == _Command.STOP:
                    if self.state == State.FAILED:
                        self._move(State.STOPPED, "stopped")  # FAILED -> STOPPED
                    return
                self.policy.reset()
                if self.state == State.FAILED:
                    self.restarts += 1  # a relaunch like any other, so `status` counts it
                pending_start = "restart requested"
            # STOPPED/FAILED/BACKOFF/STOPPING -> STARTING
            self._move(State.STARTING, pending_start)
            pending_start = None
            failure = await self._start()
            if failure is None:
                failure = await self._serve()
            outcome = await self._teardown(failure)
            if outcome == "exit":
                return
            pending_start = outcome  # None: wait for a command; str: start again with this reason

    async def _next_command(self) -> str:
        while self._command is None:
            self._wake.clear()
            await self._wake.wait()
        command, self._command = self._command, None
        return command

    async def _teardown(self, failure: str | None) -> str | None:
        """Stop the group after a failure or a command; decide what comes next."""
        command, self._command = self._command, None
        reason = failure or ("stop requested" if command == _Command.STOP else "restart requested")
        if failure:
            self.last_failure = failure
        if self.state == State.READY and failure:
            self._move(State.UNHEALTHY, failure)  # READY -> UNHEALTHY
        self._move(State.STOPPING, reason)  # * -> STOPPING
        await self._stop_group(failed=failure is not None)
        if command == _Command.STOP:
            self._move(State.STOPPED, "stopped")  # STOPPING -> STOPPED
            return "exit"
        if command == _Command.RESTART:
            self.policy.reset()
            self.restarts += 1
            return "restart requested"
        decision = self.policy.record_failure()
        if decision.give_up:
            tail = " | ".join(self.error_lines(3))
            self._move(State.FAILED, f"{decision.reason}; last: {failure}" + (f"; log: {tail}" if tail else ""))
            return None  # FAILED: wait for `restart ID` or stop
        self._move(State.BACKOFF, f"{failure}; {decision.reason}")  # STOPPING -> BACKOFF
        if decision.delay_s > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                self._wake.clear()
                await asyncio.wait_for(self._wake.wait(), decision.delay_s)
        command, self._command = self._command, None
        if command == _Command.STOP:
            self._move(State.STOPPED, "stopped during backoff")  # BACKOFF -> STOPPED
            return "exit"
        self.restarts += 1
        return f"restart #{self.restarts} after: {failure}"

    # --- starting ---------------------------------------------------------------------
    async def _start(self) -> str | None:
        """Launch the group and wait for READY. Returns a failure reason, or None when ready."""
        self._trouble = None
        self._suspect = None
        busy = taken_ports(self.plan.bind_address, self.plan.ports.all())
        if busy:
            return f"port(s) {', '.join(busy)} already in use"
        cmd = self._shared.build_command(self.plan)
        if self._log is None:
            self._log = RotatingLog(self.dir / "instance.log", self._s.log_max_bytes, self._s.log_backups)
        self._log.note("launch: " + cmd.shell_text())
        # systemd's notify/watchdog variables are the daemon's alone (NotifyAccess=main).
        env = {k: v for k, v in os.environ.items() if k not in _DAEMON_ONLY_ENV}
        env.update(cmd.env)
        self.started_at = time.monotonic()
        try:
            proc = await self._shared.ops.spawn(cmd.argv, env, None)
        except OSError as exc:
            return f"could not start {cmd.argv[0]}: {exc}"
        self.mpirun = proc
        with contextlib.suppress(Exception):
            import psutil
            self.mpirun_create_time = psutil.Process(proc.pid).create_time()
        self.pids = [proc.pid]
        self._pump = asyncio.create_task(pump(proc.stdout, self._log), name=f"log-pump-{self.id}")
        self._exit_wait = asyncio.create_task(self._watch_mpirun(proc), name=f"mpirun-wait-{self.id}")
        self._on_change(self)  # record the pid in state.json before anything can go wrong

        result = await self._until_woken(
            wait_until_ready(self._shared.session, self.base_url, self._s.served_model,
                             self._s.startup_timeout_s, poll_s=0.1,
                             is_alive=lambda: proc.returncode is None))
        if self._command is not None:
            return None  # a stop/restart command: _teardown handles it, it is no failure
        if self._trouble:
            return self._trouble
        if result is None or not result.ok:
            why = result.reason if result is not None else "interrupted"
            if proc.returncode is not None:
                why = f"mpirun exited with code {proc.returncode} before ready"
            elif time.monotonic() - self.started_at >= self._s.startup_timeout_s:
                why = f"not ready within --startup-timeout-s={self._s.startup_timeout_s:g} ({why})"
            return why
        self.startup_s = time.monotonic() - self.started_at
        self._watch_group(proc.pid)
        self.ready_at = time.monotonic()
        self.policy.record_ready()
        self.canary.ran()  # a fresh instance just answered: no canary needed right away
        self._move(State.READY, f"ready after {self.startup_s:.1f}s")  # STARTING -> READY
        return None

    async def _watch_mpirun(self, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        if self.state not in (State.STOPPING, State.STOPPED):
            self.report_trouble(f"mpirun (pid {proc.pid}) exited with code {code}")

    def _watch_group(self, root_pid: int) -> None:
        """Event-driven exit detection for every rank, daemon and stub of the group."""
        procs = process_tree(root_pid)
        self.pids = [p.pid for p in procs]
        for p in procs[1:]:  # mpirun itself is watched through proc.wait()
            try:
                name = p.name()
            except Exception:
                name = "process"
            watching = self._shared.exit_watcher.watch(
                p.pid, lambda pid, name=name: self.report_trouble(f"{name} (pid {pid}) exited"))
            if not watching:  # died between the tree scan and the watch
                self.report_trouble(f"{name} (pid {p.pid}) exited")
        self._on_change(self)

    # --- serving ------------------------------------------------------------------------
    async def _serve(self) -> str | None:
        """READY/UNHEALTHY: probe, canary, react. Returns a failure reason, or None on a command."""
        interval = self._s.probe_interval_s
        failures = 0
        next_probe = time.monotonic() + interval
        while True:
            if self._command is not None:
                return None
            if self._trouble:
                return self._trouble
            if self._suspect:
                suspect, self._suspect = self._suspect, None
                result = await self._until_woken(self._canary())
                if result is None:
                    continue
                if not result.ok:
                    return f"{suspect}; canary: {result.reason}"
                if self.state == State.UNHEALTHY:
                    # UNHEALTHY -> READY (the daemon resets the outlier streak on READY)
                    self._move(State.READY, "canary passed after ejection")
                continue
            delay = next_probe - time.monotonic()
            if delay > 0:
                self._wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), delay)
                continue
            next_probe = time.monotonic() + interval
            result = await self._until_woken(
                probe_instance(self._shared.session, self.base_url, self._s.served_model,
                               self._s.probe_timeout_s))
            if result is None:
                continue
            if not result.ok:
                failures += 1
                if failures >= self._s.probe_failures:
                    return f"{failures} health probes failed: {result.reason}"
                if self.state == State.READY:
                    self._move(State.UNHEALTHY, f"probe failed ({failures}/{self._s.probe_failures}): "
                               f"{result.reason}")  # READY -> UNHEALTHY
                continue
            failures = 0
            if self.canary.due():
                result = await self._until_woken(self._canary())
                if result is None:
                    continue
                if not result.ok:
                    return f"canary failed: {result.reason}"
            if self.state == State.UNHEALTHY:
                self._move(State.READY, "health probe passed")  # UNHEALTHY -> READY

    async def _canary(self):
        result = await run_canary(self._shared.session, self.base_url, self._s.served_model,
                                  self.canary_body, self._s.canary_deadline_s)
        self.canary.ran()
        return result

    async def _until_woken(self, coro: Awaitable):
        """Run `coro` unless a command or trouble arrives first (then cancel it, return None)."""
        task = asyncio.ensure_future(coro)
        self._wake.clear()
        waker = asyncio.ensure_future(self._wake.wait())
        try:
            done, _ = await asyncio.wait({task, waker}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waker.cancel()
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        return None

    # --- stopping -------------------------------------------------------------------------
    async def _stop_group(self, failed: bool = False) -> None:
        """Every process of the group gone, ports free, GPUs released, shm cleaned.

        A clean stop gives every process --stop-grace-s to finish its requests. A failed
        group has nothing left to drain (a TP job missing a rank cannot answer), so its
        orphans (a dead rank's Python stubs, often blocked mid-request and deaf to
        SIGTERM) are SIGKILLed at once and the rest get a short grace: restart overhead
        is what clients wait for.
        """
        s = self._shared
        t0 = time.monotonic()
        for pid in self.pids:
            s.exit_watcher.unwatch(pid)
        state_dir = str(s.state_dir.root)
        procs = {p.pid: p for p in tagged_processes(state_dir, self.id)}
        pgids: list[int] = []
        if self.mpirun is not None:
            for p in process_tree(self.mpirun.pid):
                procs.setdefault(p.pid, p)
            if self.mpirun.returncode is None:
                pgids.append(self.mpirun.pid)  # its own session: pgid == pid
        grace = self._s.stop_grace_s
        if failed:
            grace = min(grace, FAILED_GROUP_GRACE_S)
            for pid, proc in list(procs.items()):
                if _orphaned(proc):
                    s.ops.kill(pid, signal.SIGKILL)
        killed = await stop_processes(procs.values(), grace, s.ops, pgids=pgids,
                                      rescan=lambda: tagged_processes(state_dir, self.id))
        t_killed = time.monotonic()
        if killed and self._log:
            self._log.note(f"SIGKILLed after {grace:g}s grace: {killed}")  # the grace applied
        if self.mpirun is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.mpirun.wait(), 5)
            if self._log:
                self._log.note(f"mpirun exited with code {self.mpirun.returncode}")
        for task in (self._exit_wait, self._pump):
            if task is not None:
                if not task.done():
                    with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                        await asyncio.wait_for(task, 2)
                task.cancel()
        self._exit_wait = self._pump = None
        t_reaped = time.monotonic()
        stopped_pids = set(self.pids) | set(procs)  # before READY, self.pids is only mpirun
        self.mpirun, self.pids, self.ready_at = None, [], None
        self._clean_shm()
        await self._wait_released(stopped_pids)
        log.debug("instance=%s stop: processes %.3fs (%d SIGKILLed, grace %gs), reap+log %.3fs, "
                  "release %.3fs", self.id, t_killed - t0, len(killed), grace, t_reaped - t_killed,
                  time.monotonic() - t_reaped)
        self._on_change(self)

    def _clean_shm(self) -> None:
        # A SIGKILLed Python-backend stub leaves its regions in /dev/shm (RAM); they are ours.
        for rank in range(self.plan.tp):
            prefix = shm_prefix(self.id, rank, shm_scope(str(self._shared.state_dir.root)))
            for path in glob.glob(f"/dev/shm/{prefix}*"):
                with contextlib.suppress(OSError):
                    os.unlink(path)

    async def _wait_released(self, pids: set[int], timeout_s: float = 10.0) -> None:
        """Ports free and (with NVML) the group's GPUs no longer hold its processes."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            busy = taken_ports(self.plan.bind_address, self.plan.ports.all())
            holders = set()
            if self._shared.gpu_holders is not None:
                holders = self._shared.gpu_holders(self.plan.gpus) & pids
            if not busy and not holders:
                return
            if busy and not holders:
                owners = listening_pids(self.plan.ports.all())
                if owners is not None and not owners & pids:
                    # Another program holds the port: waiting cannot free it, and the next
                    # start reports who holds it (BACKOFF) instead of stalling here for 10 s.
                    return
            await asyncio.sleep(0.05)
        log.warning("instance=%s resources still held %.0fs after stop (ports %s, GPU pids %s)",
                    self.id, timeout_s, busy, sorted(holders))


def _orphaned(proc) -> bool:
    try:
        return proc.ppid() == 1
    except Exception:
        return False


def _canary_body(settings: Settings) -> dict:
    if settings.canary_body:
        import json
        return json.loads(settings.canary_body)
    return default_canary_body()
