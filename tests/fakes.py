"""Stand-ins for the process side of an instance, for unit tests of its state machine.

`FakeGroup` replaces `launcher.group.ProcessGroup` and `FakeChecks` replaces
`health.checks.InstanceChecks`: the instance's supervisor runs its real code
(state machine, health loop, backoff, passive health) against scripted answers,
without a process or a socket. The real ones are tested end to end elsewhere.
`ManualClock` is a clock the test moves, for the routing policies and shared indexes.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field

from orchestrator.health.probes import ProbeResult
from orchestrator.launcher.group import LaunchFailed
from orchestrator.routing.backends import ReadyBackends

OK = ProbeResult(True, "", 0.0)


def bad(reason: str) -> ProbeResult:
    return ProbeResult(False, reason, 0.0)


class FakeGroup:
    def __init__(self, plan, log_file, on_trouble) -> None:
        self.plan = plan
        self.log = log_file
        self._on_trouble = on_trouble
        self.running = False
        self.exit_code: int | None = None
        self.mpirun = None
        self.mpirun_create_time: float | None = None
        self.pids: list[int] = []
        self.command = None
        self.launched: list = []  # every LaunchCommand, in order
        self.stops: list[tuple[float, bool]] = []  # (grace, failed)
        self.launch_error: str | None = None
        self.adopt_gone = False  # adopt() finds the previous daemon's mpirun gone
        self.started_by = ""

    @property
    def mpirun_pid(self) -> int | None:
        return self.pids[0] if self.running else None

    async def launch(self, cmd) -> None:
        if self.launch_error:
            raise LaunchFailed(self.launch_error)
        self.launched.append(cmd)
        self.command, self.running, self.exit_code = cmd, True, None
        self.pids = [10_000 + len(self.launched)]

    def adopt(self, pid, create_time, cmd, started_by) -> bool:
        """Take over a group a previous daemon left (live restore): alive unless a test says not."""
        if self.adopt_gone:
            return False
        self.command, self.running, self.exit_code, self.started_by = cmd, True, None, started_by
        self.pids = [pid]
        return True

    async def watch_all(self) -> None:
        pass

    async def stop(self, grace_s: float, failed: bool = False) -> None:
        self.stops.append((grace_s, failed))
        self.running, self.pids, self.command = False, [], None

    def die(self, reason: str, code: int = 137) -> None:
        """A process of the group exited (what the exit watcher would report)."""
        self.running, self.exit_code = False, code
        self._on_trouble(reason)


@dataclass
class FakeChecks:
    """Scripted answers; each list is consumed front first, its last entry repeats."""

    ready: list[ProbeResult] = field(default_factory=lambda: [OK])
    probes: list[ProbeResult] = field(default_factory=lambda: [OK])
    canaries: list[ProbeResult] = field(default_factory=lambda: [OK])
    canary_gate: asyncio.Event | None = None  # set to let a canary answer (a hung instance)
    calls: list[str] = field(default_factory=list)
    ready_deadlines: list[float] = field(default_factory=list)  # deadline_s of each wait_ready

    @staticmethod
    def _next(answers: list[ProbeResult]) -> ProbeResult:
        return answers.pop(0) if len(answers) > 1 else answers[0]

    async def wait_ready(self, model, deadline_s, is_alive) -> ProbeResult:
        self.calls.append("ready")
        self.ready_deadlines.append(deadline_s)
        await asyncio.sleep(0)
        return self._next(self.ready)

    async def probe(self, model, timeout_s) -> ProbeResult:
        self.calls.append("probe")
        await asyncio.sleep(0)
        return self._next(self.probes)

    async def monitor_engine(self, view, period_s, stall_after_s, on_stall, silent_after_s=0.0,
                             on_silent=None) -> None:
        self.calls.append("monitor")
        self.on_stall = on_stall  # a test calls it to play a stalled engine
        self.on_silent = on_silent  # ... or one that stopped answering
        await asyncio.Event().wait()  # until the instance cancels it

    async def canary(self, model, body, deadline_s) -> ProbeResult:
        self.calls.append("canary")
        if self.canary_gate is not None:
            await self.canary_gate.wait()
        await asyncio.sleep(0)
        return self._next(self.canaries)


class RecordingBackends(ReadyBackends):
    """A ReadyBackends whose published Backends carry a recording stand-in for each
    instance's PassiveHealth: proxy tests read what the proxy reported, and to whom."""

    def __init__(self) -> None:
        super().__init__()
        self.failures: list[tuple[str, str]] = []
        self.successes: list[str] = []

    def publish(self, backends) -> None:
        super().publish(tuple(b if b.health is not None else
                              dataclasses.replace(b, health=_RecordedHealth(self, b.instance_id))
                              for b in backends))


class _RecordedHealth:
    def __init__(self, owner: RecordingBackends, instance_id: str) -> None:
        self._owner, self._iid = owner, instance_id

    def failure(self, reason: str) -> None:
        self._owner.failures.append((self._iid, reason))

    def success(self) -> None:
        self._owner.successes.append(self._iid)


class ManualClock:
    """A clock that moves only when a test sets `t` (the policies' and indexes' `clock`)."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t
