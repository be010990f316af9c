"""The instance's state machine and health loop, with the process side replaced
(tests/fakes.py): every edge, the backoff, passive health and reload, in milliseconds."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from orchestrator.config import Settings
from orchestrator.controlplane.instance import Instance, Shared
from orchestrator.launcher.command import LaunchCommand
from orchestrator.plan import InstancePlan, Ports
from orchestrator.controlplane.states import State
from orchestrator.controlplane.statedir import StateDir
from tests.fakes import OK, FakeChecks, FakeGroup, bad

pytestmark = pytest.mark.unit

FAST = dict(probe_interval_s=0.01, probe_failures=2, backoff_initial_s=0.0, backoff_max_s=0.01,
            max_failures=3, failure_window_s=60, canary_interval_s=0, outlier_failures=2)


class Rig:
    def __init__(self, tmp_path, checks: FakeChecks | None = None, adopt=None, **overrides) -> None:
        self.settings = Settings(gpus="0-1", tp=2, model_repo="/models/a", **{**FAST, **overrides})
        sd = StateDir(tmp_path / "state")
        sd.ensure()
        self.checks = checks or FakeChecks()
        self.groups: list[FakeGroup] = []

        def make_group(plan, log_file, on_trouble) -> FakeGroup:
            self.groups.append(FakeGroup(plan, log_file, on_trouble))
            return self.groups[-1]

        self.shared = Shared(self.settings, sd, lambda plan: LaunchCommand(("mpirun", "A"), {}),
                             make_group, lambda backend: self.checks)
        plan = InstancePlan("0", (0, 1), Ports(9000, 9001, 9002), "127.0.0.1")
        self.moves: list[State] = []
        self.inst = Instance(plan, self.shared, self._changed, adopt=adopt)
        self.group = self.groups[0]

    def _changed(self, inst: Instance) -> None:
        if not self.moves or self.moves[-1] != inst.state:
            self.moves.append(inst.state)

    async def __aenter__(self) -> "Rig":
        self.task = asyncio.create_task(self.inst.supervise())
        await self.until(State.READY)
        return self

    async def __aexit__(self, *exc) -> None:
        self.inst.request_stop()
        await asyncio.wait_for(self.task, 5)

    async def until(self, *states: State) -> None:
        await asyncio.wait_for(self.inst.wait_for(lambda: self.inst.state in states), 5)

    async def relaunched(self, launches: int) -> None:
        await asyncio.wait_for(self.inst.wait_for(
            lambda: self.inst.launches >= launches and self.inst.state == State.READY), 5)


async def test_start_serve_stop(tmp_path):
    rig = Rig(tmp_path)
    async with rig:
        assert rig.group.running and rig.inst.serving
        assert rig.inst.running_config["model_repo"] == "/models/a"
    assert rig.moves == [State.STARTING, State.READY, State.STOPPING, State.STOPPED]
    assert rig.group.stops[-1][1] is False  # a requested stop is a clean one (full grace)
    assert not rig.group.running


async def test_a_dead_process_restarts_the_whole_group_without_grace(tmp_path):
    rig = Rig(tmp_path)
    async with rig:
        rig.group.die("tritonserver (pid 5) exited")
        assert rig.inst.state == State.UNHEALTHY  # out of rotation at once, before any await
        await rig.relaunched(2)
        assert rig.group.stops == [(rig.settings.stop_grace_s, True)]
        assert rig.inst.restarts == 1 and "tritonserver (pid 5) exited" in rig.inst.last_failure
    assert rig.moves[:6] == [State.STARTING, State.READY, State.UNHEALTHY, State.STOPPING,
                             State.BACKOFF, State.STARTING]


async def test_one_failed_probe_ejects_and_a_pass_readmits(tmp_path):
    rig = Rig(tmp_path, FakeChecks(probes=[bad("GET /v2/health/ready -> 503"), OK]))
    async with rig:
        await rig.until(State.UNHEALTHY)
        await rig.until(State.READY)
        assert len(rig.group.launched) == 1  # no restart for a single failure


async def test_probe_failures_at_the_threshold_restart(tmp_path):
    rig = Rig(tmp_path, FakeChecks(probes=[bad("timeout"), bad("timeout"), OK]))
    async with rig:
        await rig.relaunched(2)
        assert "2 health probes failed: timeout" in rig.inst.last_failure


async def test_failed_start_backs_off_then_gives_up(tmp_path):
    rig = Rig(tmp_path, FakeChecks(ready=[bad("not ready after 1s")]))
    task = asyncio.create_task(rig.inst.supervise())
    await rig.until(State.FAILED)
    assert len(rig.group.launched) == rig.settings.max_failures
    assert "not ready after 1s" in rig.inst.reason
    rig.inst.request_stop()
    await asyncio.wait_for(task, 5)
    assert rig.inst.state == State.STOPPED


async def test_launch_failure_is_the_reason(tmp_path):
    rig = Rig(tmp_path, max_failures=20, backoff_initial_s=0.05, backoff_max_s=0.05)
    rig.group.launch_error = "port(s) 9000 (held by pid 7 (nginx)) already in use"
    task = asyncio.create_task(rig.inst.supervise())
    await rig.until(State.BACKOFF)
    assert "held by pid 7" in rig.inst.reason
    rig.group.launch_error = None
    await rig.until(State.READY)
    rig.inst.request_stop()
    await asyncio.wait_for(task, 5)


async def test_passive_failures_eject_and_a_passing_canary_readmits(tmp_path):
    gate = asyncio.Event()
    rig = Rig(tmp_path, FakeChecks(canary_gate=gate))
    async with rig:
        rig.inst.backend.report_failure("http_502")
        assert rig.inst.state == State.READY  # 1 of 2
        rig.inst.backend.report_failure("http_502")
        assert rig.inst.state == State.UNHEALTHY  # ejected on the spot
        gate.set()
        await rig.until(State.READY)
        assert len(rig.group.launched) == 1 and rig.inst.passive.consecutive == 0


async def test_passive_ejection_with_a_failing_canary_restarts(tmp_path):
    rig = Rig(tmp_path, FakeChecks(canaries=[bad("POST generate: timeout after 10s"), OK]))
    async with rig:
        for _ in range(2):
            rig.inst.backend.report_failure("connect refused")
        await rig.relaunched(2)
        assert "ejected after 2 consecutive proxy failures" in rig.inst.last_failure
        assert "canary: POST generate: timeout" in rig.inst.last_failure


async def test_a_success_breaks_the_passive_streak(tmp_path):
    rig = Rig(tmp_path)
    async with rig:
        rig.inst.backend.report_failure("http_502")
        rig.inst.backend.report_success()
        rig.inst.backend.report_failure("http_502")
        assert rig.inst.state == State.READY


async def test_restart_command_is_a_clean_restart(tmp_path):
    rig = Rig(tmp_path)
    async with rig:
        before = rig.inst.launches
        rig.inst.request_restart()
        await rig.relaunched(before + 1)
        assert rig.group.stops == [(rig.settings.stop_grace_s, False)]
        assert rig.inst.restarts == 1


async def test_restart_out_of_failed(tmp_path):
    rig = Rig(tmp_path, FakeChecks(ready=[bad("x"), bad("x"), bad("x"), OK]))
    task = asyncio.create_task(rig.inst.supervise())
    await rig.until(State.FAILED)
    rig.inst.request_restart()
    await rig.until(State.READY)
    assert rig.inst.restarts == 3  # two backoff relaunches and the one out of FAILED
    rig.inst.request_stop()
    await asyncio.wait_for(task, 5)


async def test_reload_applies_knobs_now_and_the_command_at_the_next_launch(tmp_path):
    rig = Rig(tmp_path)
    async with rig:
        new = dataclasses.replace(rig.settings, outlier_failures=1, model_repo="/models/b", max_failures=9,
                                        canary_interval_s=7.0)
        rig.shared.settings = new
        rig.shared.build_command = lambda plan: LaunchCommand(("mpirun", "B"), {})
        rig.shared.generation += 1
        rig.inst.apply_settings(new)
        assert rig.inst.policy.max_failures == 9 and rig.inst.canary.interval_s == 7.0
        assert rig.inst.running_config["model_repo"] == "/models/a"  # still the old group
        rig.inst.request_restart()
        await rig.relaunched(2)
        assert rig.group.launched[-1].argv == ("mpirun", "B")
        assert rig.inst.running_config == {"generation": 2, "model_repo": "/models/b",
                                           "tritonserver_arg": []}
        rig.inst.backend.report_failure("http_500")  # threshold is now 1
        assert rig.inst.state == State.UNHEALTHY


async def test_stop_during_backoff(tmp_path):
    rig = Rig(tmp_path, FakeChecks(ready=[bad("x")]), backoff_initial_s=30.0, backoff_max_s=30.0)
    task = asyncio.create_task(rig.inst.supervise())
    await rig.until(State.STARTING)
    await rig.until(State.BACKOFF)
    rig.inst.request_stop()
    await asyncio.wait_for(task, 5)
    assert rig.inst.state == State.STOPPED


async def test_engine_monitor_runs_while_serving_and_a_stall_restarts(tmp_path):
    rig = Rig(tmp_path, FakeChecks(canaries=[bad("POST generate: timeout after 10s"), OK]))
    async with rig:
        await asyncio.sleep(0)
        assert rig.inst._engine_monitor is not None and not rig.inst._engine_monitor.done()
        first = rig.inst._engine_monitor
        rig.checks.on_stall("engine stalled: iteration_counter stuck at 5 with 2 active requests for 10.0s")
        assert rig.inst.state == State.UNHEALTHY
        await rig.relaunched(2)
        assert first.cancelled() and "iteration_counter stuck" in rig.inst.last_failure
        assert rig.inst._engine_monitor is not first and rig.checks.calls.count("monitor") == 2
    assert rig.inst._engine_monitor is None


# --- live restore: a group the previous daemon left ----------------------------------
def _left(pid: int = 4242):
    from orchestrator.controlplane.adoption import Adoptable
    return Adoptable("0", pid, 1.0, "0.9", frozenset({pid}))


async def test_an_adopted_group_is_ready_without_a_launch(tmp_path):
    rig = Rig(tmp_path, adopt=_left())
    async with rig:
        assert rig.inst.adopted and rig.group.launched == [] and rig.group.pids == [4242]
        assert "adopted" in rig.inst.reason
    # It had its model loaded: it answers within the probes' budget, not --startup-timeout-s.
    assert rig.checks.ready_deadlines == [2 * (0.01 + 1.0)]


async def test_an_adopted_group_that_hung_while_no_daemon_ran_is_relaunched_soon(tmp_path):
    # A SIGSTOPped rank: mpirun and every rank alive (adoptable), nothing answers.
    checks = FakeChecks(ready=[bad("GET /v2/health/ready: timeout"), OK])
    rig = Rig(tmp_path, checks, adopt=_left(), startup_timeout_s=900.0)
    async with rig:
        assert len(rig.group.launched) == 1 and not rig.inst.adopted  # its own launch now
        assert rig.group.stops and rig.group.stops[0][1] is True  # torn down as a failure
    assert "adopted, but not ready within 2.02s" in rig.inst.last_failure
    assert checks.ready_deadlines == [2.02, 900.0]  # the fresh launch gets the model-load budget
    assert rig.moves[:5] == [State.STARTING, State.STOPPING, State.BACKOFF, State.STARTING, State.READY]


async def test_an_adopted_group_gone_before_the_takeover_is_launched(tmp_path):
    rig = Rig(tmp_path, adopt=_left())
    rig.group.adopt_gone = True
    async with rig:
        assert not rig.inst.adopted and len(rig.group.launched) == 1
    assert rig.checks.ready_deadlines == [rig.settings.startup_timeout_s]
