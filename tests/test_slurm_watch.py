"""The node watch, the step bookkeeping and FAILED-on-a-dead-node, with Slurm replaced by a fake.

The real slurmctld/slurmd run in tests/test_slurm_e2e.py; here every Slurm answer is
scripted, so each verdict and each edge is checked in milliseconds.
"""

from __future__ import annotations

import pytest

import orchestrator.launcher.slurm as slurm
from orchestrator.launcher.command import LaunchCommand
from orchestrator.launcher.group import LaunchFailed
from orchestrator.launcher.slurm import SlurmGroup, SlurmLauncher, SlurmUnreachable, sweep_steps, write_record
from orchestrator.launcher.slurm_cli import JobInfo, NodeState, Result, Step
from orchestrator.launcher.slurm_command import step_name
from orchestrator.plan import InstancePlan, Ports
from orchestrator.controlplane.states import State
from tests.test_instance_machine import Rig

pytestmark = pytest.mark.unit


class FakeSlurm:
    def __init__(self, job_id: str = "7") -> None:
        self.job_id = job_id
        self.job_info: JobInfo | None = JobInfo(job_id, "RUNNING", ("n1", "n2"), {})
        self.states = {"n1": NodeState("n1", "mixed", ""), "n2": NodeState("n2", "mixed", "")}
        self.listed: list[Step] = []
        self.signals: list[tuple[tuple[str, ...], str]] = []
        self.unreachable = False
        self.steps_end_on_kill = True
        self.runs: dict[str, bool | None] = {}  # what sstat says of a step (default: it runs)
        self.asked: list[str] = []

    async def steps(self, job_id: str | None = None) -> list[Step]:
        if self.unreachable:
            raise SlurmUnreachable("squeue: timed out")
        return [s for s in self.listed if job_id is None or s.step_id.startswith(f"{job_id}.")]

    async def signal(self, step_ids: list[str], sig: str) -> Result:
        self.signals.append((tuple(step_ids), sig))
        if sig == "KILL" and self.steps_end_on_kill:
            self.listed = [s for s in self.listed if s.step_id not in step_ids]
        return Result(0, "", "")

    async def step_runs(self, step_id: str) -> bool | None:
        self.asked.append(step_id)
        return self.runs.get(step_id, True)

    async def job(self) -> JobInfo | None:
        if self.unreachable:
            raise SlurmUnreachable("scontrol show job: timed out")
        return self.job_info

    async def node_states(self, nodes) -> dict[str, NodeState]:
        return dict(self.states)


class Calls:
    def __init__(self) -> None:
        self.trouble: list[str] = []
        self.back = 0

    def on_trouble(self, reason: str) -> None:
        self.trouble.append(reason)

    def on_back(self) -> None:
        self.back += 1


class NoLog:
    def note(self, text: str) -> None:
        pass


def rig(tmp_path, fake: FakeSlurm) -> tuple[SlurmLauncher, list[SlurmGroup], list[Calls]]:
    launcher = SlurmLauncher(fake.job_id, ("n1", "n2"), tmp_path, lambda: 0.01, client=fake)  # type: ignore[arg-type]
    groups, calls = [], []
    for i, node in enumerate(("n1", "n2")):
        c = Calls()
        plan = InstancePlan(str(i), (0, 1), Ports(8000 + 3 * i, 8001 + 3 * i, 8002 + 3 * i), f"10.0.0.{i}",
                            nodes=(node,))
        groups.append(launcher.make_group(plan, None, NoLog(), c.on_trouble, c.on_back))  # type: ignore[arg-type]
        calls.append(c)
    return launcher, groups, calls


async def test_a_node_not_responding_fails_only_its_groups_and_its_return_restarts_them(tmp_path):
    fake = FakeSlurm()
    launcher, groups, calls = rig(tmp_path, fake)
    await launcher.check_nodes()
    assert [c.trouble for c in calls] == [[], []]
    fake.states["n2"] = NodeState("n2", "mixed+not_responding", "")
    await launcher.check_nodes()
    await launcher.check_nodes()  # the same verdict again is no news
    assert calls[0].trouble == [] and calls[1].trouble == ["Slurm: n2 is MIXED+NOT_RESPONDING"]
    assert groups[1].unavailable == "Slurm: n2 is MIXED+NOT_RESPONDING" and groups[0].unavailable is None
    fake.unreachable = True  # slurmctld busy: no verdict changes
    await launcher.check_nodes()
    assert groups[1].unavailable and calls[1].back == 0
    fake.unreachable = False
    fake.states["n2"] = NodeState("n2", "mixed", "")
    await launcher.check_nodes()
    assert groups[1].unavailable is None and calls[1].back == 1 and calls[0].back == 0


async def test_a_node_removed_from_the_allocation_or_an_ended_job_fails_the_groups(tmp_path):
    fake = FakeSlurm()
    launcher, groups, calls = rig(tmp_path, fake)
    fake.job_info = JobInfo("7", "RUNNING", ("n1",), {})
    await launcher.check_nodes()
    assert calls[1].trouble == ["node n2 left allocation 7"] and not calls[0].trouble
    fake.job_info = None
    await launcher.check_nodes()
    assert calls[0].trouble == ["allocation 7 is gone (Slurm no longer knows the job)"]


async def test_launch_is_refused_on_a_dead_node_and_clears_an_old_step_first(tmp_path, monkeypatch):
    monkeypatch.setattr(slurm, "STEP_GONE_TIMEOUT_S", 0.05)
    fake = FakeSlurm()
    launcher, groups, _ = rig(tmp_path, fake)
    launcher.recorded.set()
    groups[1].node_trouble("Slurm: n2 is DOWN")
    with pytest.raises(LaunchFailed, match="Slurm: n2 is DOWN"):
        await groups[1].launch(LaunchCommand(("srun",), {}))
    # A step of ours that Slurm still lists (its node was unreachable at stop): KILLed, and
    # while it stays listed, no new step starts on top of it (it holds the ports).
    name = step_name(str(tmp_path), "0")
    fake.listed = [Step("7.4", name, "n1"), Step("7.5", "someone-else", "n1")]
    fake.steps_end_on_kill = False
    with pytest.raises(LaunchFailed, match=r"step 7\.4 of an earlier launch still runs on n1"):
        await groups[0].launch(LaunchCommand(("srun",), {}))
    assert fake.signals == [(("7.4",), "KILL")]  # once, and never someone else's step


async def test_stop_of_a_group_on_an_unreachable_node_asks_slurm_nothing(tmp_path):
    fake = FakeSlurm()
    _, groups, _ = rig(tmp_path, fake)
    groups[1].node_trouble("Slurm: n2 is MIXED+NOT_RESPONDING")
    fake.listed = [Step("7.4", groups[1].step_name, "n2")]
    await groups[1].stop(10.0, failed=True)
    assert fake.signals == []  # left to Slurm; the next launch cancels it


async def test_sweep_finds_steps_by_name_in_any_job_and_forgets_the_run_once_none_is_left(tmp_path, monkeypatch):
    monkeypatch.setattr(slurm, "POLL_S", 0.001)
    fake = FakeSlurm()
    assert await sweep_steps(tmp_path, client=fake) == ([], [])  # no record: Slurm is not asked
    write_record(tmp_path, "7")
    mine = step_name(str(tmp_path), "0")
    fake.listed = [Step("7.1", mine, "n1"), Step("9.2", step_name(str(tmp_path), "1"), "n2"),
                   Step("7.3", step_name(str(tmp_path / "other"), "0"), "n1")]
    assert await sweep_steps(tmp_path, client=fake) == (["7.1", "9.2"], [])
    assert [s.step_id for s in fake.listed] == ["7.3"]  # another state dir's step stays
    assert not (tmp_path / slurm.RECORD_FILE).exists()
    write_record(tmp_path, "7")
    fake.listed, fake.steps_end_on_kill = [Step("7.1", mine, "n1")], False
    assert await sweep_steps(tmp_path, timeout_s=0.01, client=fake) == (["7.1"], ["7.1"])
    assert (tmp_path / slurm.RECORD_FILE).exists()  # `down` says so and keeps it for the next try


async def test_an_unavailable_group_goes_to_failed_at_once_and_back_on_restart(tmp_path):
    r = Rig(tmp_path)
    async with r:
        r.group.unavailable = "Slurm: n2 is DOWN+NOT_RESPONDING (Not responding)"
        r.group.die(r.group.unavailable)
        await r.until(State.FAILED)
        assert r.inst.reason == "Slurm: n2 is DOWN+NOT_RESPONDING (Not responding)"
        assert State.BACKOFF not in r.moves and len(r.group.launched) == 1  # no retry against a dead node
        r.group.unavailable = None
        r.inst.request_restart()  # what the daemon does when Slurm returns the node
        await r.relaunched(2)


async def test_an_orphaned_step_record_is_not_waited_for_and_a_step_of_an_unreachable_node_is(tmp_path, monkeypatch):
    """A node killed whole (its slurmstepd too) and back before Slurm called it DOWN: slurmctld
    lists the step forever, its slurmd knows no such step. Not waited for; a step whose node
    does not answer sstat is."""
    monkeypatch.setattr(slurm, "POLL_S", 0.001)
    monkeypatch.setattr(slurm, "ORPHAN_CHECK_S", 0.01)
    fake = FakeSlurm()
    _, groups, _ = rig(tmp_path, fake)
    notes: list[str] = []
    groups[1].log.note = notes.append  # type: ignore[method-assign]
    name = groups[1].step_name
    fake.listed, fake.steps_end_on_kill = [Step("7.4", name, "n2")], False
    fake.runs["7.4"] = None  # slurmd down: nothing is known
    assert await groups[1]._cancel_steps("KILL", 0.1) == ["7.4"]
    assert fake.asked and not notes
    fake.runs["7.4"] = False  # slurmd back, without the step
    assert await groups[1]._cancel_steps("KILL", 5.0) == []
    assert len(notes) == 1 and notes[0].startswith("step 7.4: Slurm still lists it, but its node's slurmd "
                                                   "knows no such step")
    # `down` does the same, and forgets the run (nothing of it is left to find).
    write_record(tmp_path, "7")
    fake.listed = [Step("7.4", step_name(str(tmp_path), "1"), "n2"), Step("7.5", step_name(str(tmp_path), "0"), "n1")]
    fake.runs["7.4"] = False
    fake.steps_end_on_kill = True  # 7.5 is a live step: it ends when killed
    listed_after_kill = fake.listed

    async def signal(ids, sig):
        fake.signals.append((tuple(ids), sig))
        fake.listed = [s for s in listed_after_kill if s.step_id == "7.4"]  # 7.5 ends, 7.4 stays listed
        return Result(0, "", "")
    fake.signal = signal  # type: ignore[method-assign]
    assert await sweep_steps(tmp_path, timeout_s=5.0, client=fake) == (["7.5"], [])
    assert not (tmp_path / slurm.RECORD_FILE).exists()


async def test_a_node_list_that_changes_between_polls_is_a_logged_decision(tmp_path, caplog):
    fake = FakeSlurm()
    launcher, groups, calls = rig(tmp_path, fake)
    await launcher.check_nodes()
    caplog.clear()
    fake.job_info = JobInfo("7", "RUNNING", ("n1",), {})  # Slurm took n2 away (--no-kill, n2 DOWN)
    await launcher.check_nodes()
    await launcher.check_nodes()  # the same list again is no news
    lines = [r.getMessage() for r in caplog.records if "now holds" in r.getMessage()]
    assert lines == ["slurm: allocation 7 now holds n1 (planned on n1,n2); the groups on n2 stay FAILED for "
                     "the rest of the allocation"]
    assert calls[1].trouble == ["node n2 left allocation 7"] and not calls[0].trouble
    fake.job_info = JobInfo("7", "RUNNING", ("n1", "n3"), {})
    await launcher.check_nodes()
    assert "n3 is not used until `down` and `up` plan again" in caplog.records[-1].getMessage()
    assert calls[1].back == 0  # still out
