"""One instance: the state machine and health loop of a TP group.

`Instance.supervise()` is the instance's whole life and the only place that
decides to start or stop its group. The group's processes live behind a
`ProcessGroup` (launcher/group.py) and its HTTP checks behind `InstanceChecks`
(health/checks.py); unit tests replace both (tests/fakes.py), so every edge of
the state machine is tested without a process. Everything else (exit reports,
the proxies' passive health, `restart`/`down` commands) only records what
happened and wakes the loop; state changes all go through `_move`, which checks
the edge is legal and logs why.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from orchestrator.config import Settings
from orchestrator.health.canary import CanaryScheduler, default_canary_body
from orchestrator.health.checks import InstanceChecks
from orchestrator.health.engine_state import EngineView
from orchestrator.health.outlier import PassiveHealth
from orchestrator.health.probes import ProbeResult
from orchestrator.health.restart_policy import RestartPolicy
from orchestrator.launcher.command import LaunchCommand
from orchestrator.launcher.group import LaunchFailed, ProcessGroup, Trouble
from orchestrator.launcher.logfile import RotatingLog
from orchestrator.plan import InstancePlan
from orchestrator.routing.backends import Backend
from orchestrator.controlplane.states import SERVING_STATES, State, check_transition
from orchestrator.controlplane.statedir import StateDir
from orchestrator.tasks import cancel_and_wait

if TYPE_CHECKING:
    from orchestrator.controlplane.adoption import Adoptable

log = logging.getLogger("trtllm-orch")

# tritonserver error lines ("E1121 12:00:00.1 ..."), Python exceptions, failed loads.
_ERROR_LINE = re.compile(r"(<std(?:out|err)>:\s*|^)E\d{4} |Traceback|Error|error:|failed to load|"
                         r"Exception|exited with code [^0]")


class GroupFactory(Protocol):
    def __call__(self, plan: InstancePlan, log_file: RotatingLog, on_trouble: Trouble) -> ProcessGroup: ...


@dataclass
class Shared:
    """What every instance of one daemon shares; owned by the daemon.

    `build_command` and `settings` are replaced by a reload: each launch reads them anew.
    """

    settings: Settings
    state_dir: StateDir
    build_command: Callable[[InstancePlan], LaunchCommand]
    make_group: GroupFactory
    make_checks: Callable[[Backend], InstanceChecks]
    generation: int = 1  # bumped by every applied reload; status shows what each instance runs
    # Tells the data plane to fail the requests in flight to an instance that stopped
    # answering (backend, reason, answering): those still waiting for an answer, which are
    # retried elsewhere, and with answering=True also the answers arriving (streams, cut).
    abort_upstream: Callable[[Backend, str, bool], None] = lambda backend, reason, answering: None


def adopted_ready_s(s: Settings) -> float:
    """How long an adopted group has to answer ready: it was serving under the previous
    daemon and has its model loaded, so it answers at once, or it hung while no daemon
    watched (a SIGSTOPped or deadlocked rank: mpirun and every rank alive, nothing
    answering). As long as --probe-failures failed probes take, not --startup-timeout-s
    (15 minutes by default, made for a model load)."""
    return min(s.startup_timeout_s, s.probe_failures * (s.probe_interval_s + s.probe_timeout_s))


class _Command:
    STOP = "stop"
    RESTART = "restart"


class Instance:
    def __init__(self, plan: InstancePlan, shared: Shared, on_change: Callable[["Instance"], None],
                 adopt: "Adoptable | None" = None):
        self.plan = plan
        self.id = plan.instance_id
        self._shared = shared
        self._s = shared.settings
        self._on_change = on_change
        self.state = State.STOPPED
        self.reason = "not started"
        self.last_failure = ""
        self.restarts = 0
        self.launches = 0  # moves into STARTING: a rolling restart waits for the next one
        self.started_at: float | None = None  # monotonic
        self.ready_at: float | None = None
        self.startup_s: float | None = None  # how long the last start took to READY
        self.running_config: dict[str, Any] = {}  # what the running group was launched with
        self._moved = asyncio.Event()  # set (and replaced) on every move: see wait_for()
        self._wake = asyncio.Event()
        self._command: str | None = None
        self._trouble: str | None = None
        self._suspect: str | None = None
        self._silent: str | None = None  # the engine monitor heard nothing from it (see silent())
        self.dir = shared.state_dir.make_instance_dir(self.id)
        self._log = RotatingLog(self.dir / "instance.log", self._s.log_max_bytes, self._s.log_backups)
        self.policy = RestartPolicy(self._s.backoff_initial_s, self._s.backoff_max_s,
                                    self._s.stable_after_s, self._s.max_failures,
                                    self._s.failure_window_s)
        self.canary = CanaryScheduler(self._s.canary_interval_s, self._s.canary_idle_s)
        self.canary_body = _canary_body(self._s)
        self.passive = PassiveHealth(self._s.outlier_failures, self.suspect, self.canary.note_traffic)
        self.engine = EngineView(stale_after_s=_stale_after(self._s))
        self._engine_monitor: asyncio.Task | None = None  # runs while the group serves
        p = plan.ports
        # What the proxies route to; it carries this instance's passive health and engine view.
        self.backend = Backend(self.id, plan.bind_address, p.http, p.grpc, p.metrics,
                               health=self.passive, engine=self.engine)
        self.group = shared.make_group(plan, self._log, self.report_trouble)
        self.checks = shared.make_checks(self.backend)
        # A group a previous daemon left running for us (live restore): the first start
        # takes it over instead of launching; it is then probed like a fresh launch.
        self._adopt = adopt
        self.adopted = False

    # --- views ---------------------------------------------------------------------
    @property
    def serving(self) -> bool:
        return self.state in SERVING_STATES

    def rotate_log(self) -> None:
        self._log.rotate_if_over()

    def log_tail(self, n: int = 20) -> list[str]:
        return self._log.tail(n)

    def error_lines(self, n: int = 3) -> list[str]:
        """The last lines that look like the actual error (a model's exception, a
        tritonserver E-line), not mpirun's closing boilerplate; else the plain tail."""
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
            "nodes": list(self.plan.nodes),
            "mpirun_pid": self.group.mpirun_pid,
            "pids": self.group.pids,
            "started_by": self.group.started_by, "adopted": self.adopted,
            "uptime_s": round(now - self.ready_at, 1) if self.ready_at and self.serving else None,
            "startup_s": round(self.startup_s, 2) if self.startup_s is not None else None,
            "running": self.running_config,
            "passive": {"consecutive_failures": self.passive.consecutive,
                        "eject_after": self.passive.threshold},
            "engine": self.engine.describe() if self.serving else None,
            "log": str(self.dir / "instance.log"),
            "log_tail": self.log_tail(10) if self.state not in SERVING_STATES else [],
            "errors": self.error_lines(5) if self.state not in SERVING_STATES else [],
        }

    def state_record(self) -> dict[str, Any]:
        """What `down` needs if the daemon is SIGKILLed: pids with their start times."""
        cmd = self.group.command
        return {"state": self.state.value,
                "mpirun_pid": self.group.mpirun.pid if self.group.mpirun else None,
                "mpirun_create_time": self.group.mpirun_create_time,
                # What the next daemon compares before it adopts the group (live restore).
                "launch": cmd.shell_text() if cmd is not None else None,
                "started_by": self.group.started_by, "tp": self.plan.tp, "restarts": self.restarts,
                "pids": self.group.pids, "gpus": list(self.plan.gpus),
                "ports": list(self.plan.ports.all())}

    async def wait_for(self, done: Callable[[], bool]) -> None:
        """Return once `done()` holds; checked after every state move (no polling)."""
        while not done():
            await self._moved.wait()

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

    def silent(self, reason: str) -> None:
        """Nothing answered for --silent-after-s (its processes stopped, its node or the link
        to it gone): out of rotation now, and the requests waiting on it are retried on the
        others (no byte of their answers reached a client). A canary decides, as after a
        passive ejection; if the instance is torn down still silent, its streams are cut."""
        if self.state not in (State.READY, State.UNHEALTHY):
            return
        self._silent = reason
        self.suspect(reason)  # READY -> UNHEALTHY: the data plane's set loses it first
        self._shared.abort_upstream(self.backend, reason, False)

    def apply_settings(self, settings: Settings) -> None:
        """A reload. Health, backoff and canary knobs apply now; the launch command (model
        repository, tritonserver args) applies at this instance's next launch."""
        self._s = settings
        self.canary_body = _canary_body(settings)
        self.policy.configure(settings.backoff_initial_s, settings.backoff_max_s, settings.stable_after_s,
                              settings.max_failures, settings.failure_window_s)
        self.canary.configure(settings.canary_interval_s, settings.canary_idle_s)
        self.passive.threshold = settings.outlier_failures
        self.engine.stale_after_s = _stale_after(settings)
        self._log.configure(settings.log_max_bytes, settings.log_backups)

    # --- the state machine -----------------------------------------------------------
    def _move(self, new: State, reason: str) -> None:
        check_transition(self.state, new)
        old, self.state, self.reason = self.state, new, reason
        if new == State.STARTING:
            self.launches += 1
        if new == State.READY:
            self.passive.reset()  # a fresh or re-admitted instance starts with a clean streak
            self._silent = None
        level = logging.WARNING if new in (State.UNHEALTHY, State.FAILED, State.BACKOFF) else logging.INFO
        log.log(level, "instance=%s gpus=%s %s -> %s: %s", self.id, self.plan.cuda_visible_devices,
                old.value, new.value, reason)
        moved, self._moved = self._moved, asyncio.Event()
        moved.set()
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
        if failure and (self._silent or getattr(self.group, "unavailable", None)):
            # Nothing will come from it: no idle timeout should keep a client waiting on it.
            self._shared.abort_upstream(self.backend, failure, True)
        await self._stop_engine_monitor()
        await self.group.stop(self._s.stop_grace_s, failed=failure is not None)
        self.ready_at = None
        self.running_config = {}
        self._on_change(self)  # the pids are gone from state.json
        if command == _Command.STOP:
            self._move(State.STOPPED, "stopped")  # STOPPING -> STOPPED
            return "exit"
        if command == _Command.RESTART:
            self.policy.reset()
            self.restarts += 1
            return "restart requested"
        # A launcher that knows the group cannot run now (Slurm: its node is down) says so:
        # no retries against a dead node; the launcher asks for a restart when it is back.
        unavailable = getattr(self.group, "unavailable", None)
        if unavailable:
            self._move(State.FAILED, unavailable if unavailable in (failure or "")
                       else f"{unavailable}; last: {failure}")  # STOPPING -> FAILED
            return None
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
        self._silent = None
        s, shared = self._s, self._shared
        cmd = shared.build_command(self.plan)  # read now: a reload may have replaced it
        self.started_at = time.monotonic()
        adopt, self._adopt = self._adopt, None
        try:
            if adopt is not None and self.group.adopt(adopt.mpirun_pid, adopt.create_time, cmd, adopt.started_by):
                self.adopted = True
            else:
                self.adopted = False  # what runs from now on is this daemon's own launch
                await self.group.launch(cmd)
        except LaunchFailed as exc:
            return str(exc)
        self.running_config = {"generation": shared.generation, "model_repo": s.model_repo,
                               "tritonserver_arg": list(s.tritonserver_arg)}
        self._on_change(self)  # record the pid in state.json before anything can go wrong
        deadline_s = adopted_ready_s(s) if self.adopted else s.startup_timeout_s
        result = await self._until_woken(
            self.checks.wait_ready(s.served_model, deadline_s, lambda: self.group.running))
        if self._command is not None:
            return None  # a stop/restart command: _teardown handles it, it is no failure
        if self._trouble:
            return self._trouble
        if result is None or not result.ok:
            why = result.reason if result is not None else "interrupted"
            if self.group.exit_code is not None:
                why = f"mpirun exited with code {self.group.exit_code} before ready"
            elif self.adopted:
                why = f"adopted, but not ready within {deadline_s:g}s: hung while no daemon ran? ({why})"
            elif time.monotonic() - self.started_at >= s.startup_timeout_s:
                why = f"not ready within --startup-timeout-s={s.startup_timeout_s:g} ({why})"
            return why
        self.startup_s = time.monotonic() - self.started_at
        await self.group.watch_all()
        if self._trouble:
            return self._trouble  # a process exited while we started watching
        self.ready_at = time.monotonic()
        self.policy.record_ready()
        self.canary.ran()  # a fresh instance just answered: no canary needed right away
        self._start_engine_monitor()
        how = f"adopted (started by trtllm-orch {self.group.started_by or '?'})" if adopt is not None and \
            self.adopted else "ready"
        self._move(State.READY, f"{how} after {self.startup_s:.1f}s")  # STARTING -> READY
        return None

    def _start_engine_monitor(self) -> None:
        if self._s.engine_poll_s <= 0:
            return
        self._engine_monitor = asyncio.get_running_loop().create_task(
            self.checks.monitor_engine(self.engine, self._s.engine_poll_s, self._s.stall_after_s, self.suspect,
                                       self._s.silent_after_s, self.silent),
            name=f"engine-monitor-{self.id}")

    async def _stop_engine_monitor(self) -> None:
        task, self._engine_monitor = self._engine_monitor, None
        await cancel_and_wait(task)  # its error is not the teardown's concern
        self.engine.clear()

    # --- serving ------------------------------------------------------------------------
    async def _serve(self) -> str | None:
        """READY/UNHEALTHY: probe, canary, react. Returns a failure reason, or None on a command."""
        failures = 0
        next_probe = time.monotonic() + self._s.probe_interval_s
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
                    self._move(State.READY, "canary passed after ejection")  # UNHEALTHY -> READY
                continue
            delay = next_probe - time.monotonic()
            if delay > 0:
                self._wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), delay)
                continue
            next_probe = time.monotonic() + self._s.probe_interval_s
            result = await self._until_woken(self.checks.probe(self._s.served_model, self._s.probe_timeout_s))
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

    async def _canary(self) -> ProbeResult:
        result = await self.checks.canary(self._s.served_model, self.canary_body, self._s.canary_deadline_s)
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
        await cancel_and_wait(task)
        return None

    # --- the daemon's own end -----------------------------------------------------------
    async def stop_now(self) -> None:
        """For a daemon that failed: stop the group without going through the state machine."""
        await self._stop_engine_monitor()
        await self.group.stop(self._s.stop_grace_s, failed=True)
        self._log.close()


def _stale_after(settings: Settings) -> float:
    # Several missed scrapes before routing stops trusting the engine's numbers.
    return max(0.5, settings.engine_poll_s * 5)


def _canary_body(settings: Settings) -> dict:
    if settings.canary_body:
        return json.loads(settings.canary_body)
    return default_canary_body()
