"""TP groups as job steps of a Slurm allocation, and the watch on the allocation's nodes.

`SlurmGroup` is the process side of one instance under Slurm, with the interface of
`ProcessGroup` (launch / watch_all / stop / running / pids / exit_code): the
instance's state machine drives either without knowing which. What runs locally is
`srun`, one per group; the ranks run on the group's node(s) in a step named
`trtllm-orch.<state-dir tag>.i<id>`, so the step can be found by name by anyone, after
anything (the daemon SIGKILLed, srun lost with its host).

Stopping a group is Slurm's business, not kill(2)'s: the ranks are on another
machine. SIGTERM to the step (scancel, through slurmctld and the node's slurmd), the
grace, then SIGTERM to srun (which cancels the step through its own connection to
the node's slurmstepd), then SIGKILL; the group is stopped once squeue lists no
step of its name. A node Slurm cannot reach cannot be cleaned now: its step is left
to Slurm and cancelled before the next launch there.

`SlurmLauncher` owns the allocation's view: it polls sinfo and scontrol (off the
event loop: asyncio subprocesses) and tells each group when its node is down,
failed, not responding or gone from the allocation, in Slurm's own words, and when
it is back. The instance then goes to FAILED at once (no retries against a dead
node) and is restarted when the node returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from orchestrator.plan import InstancePlan
from orchestrator.launcher.command import LaunchCommand
from orchestrator.launcher.group import FAILED_GROUP_GRACE_S, LaunchFailed, ProcessGroup, Trouble
from orchestrator.launcher.logfile import RotatingLog
from orchestrator.launcher.process_tree import OsOps
from orchestrator.launcher.slurm_cli import (JobInfo, NodeState, Result, Step, job_argv, parse_job, parse_sinfo_nodes,
                        parse_sstat, parse_steps, run_async, scancel_argv, sinfo_argv, sstat_argv, steps_argv)
from orchestrator.launcher.slurm_command import step_name, step_prefix

log = logging.getLogger("trtllm-orch")

RECORD_FILE = "slurm.json"  # in the state dir: tells `down` to look for steps by name
STEP_GONE_TIMEOUT_S = 15.0  # how long we wait for squeue to stop listing a cancelled step
SRUN_CANCEL_WAIT_S = 5.0  # srun, SIGTERMed, cancels its step; then SIGKILL
SRUN_UNREACHABLE_WAIT_S = 1.0  # the same on a node Slurm cannot reach: no confirmation will come
POLL_S = 0.2
# A step still listed this long after its KILL is asked (sstat) whether anything of it runs.
ORPHAN_CHECK_S = 2.0
SSTAT_TIMEOUT_S = 3.0


class SlurmUnreachable(Exception):
    """slurmctld did not answer (or the command failed): no news about the nodes."""


class SlurmClient:
    """The Slurm commands the daemon runs, async. Tests replace it with a fake."""

    def __init__(self, job_id: str):
        self.job_id = job_id

    async def steps(self, job_id: str | None = None) -> list[Step]:
        res = await run_async(steps_argv(job_id))
        if res.code != 0:
            raise SlurmUnreachable(f"squeue: {res.line()}")
        return parse_steps(res.out)

    async def signal(self, step_ids: list[str], sig: str) -> Result:
        return await run_async(scancel_argv(step_ids, sig))

    async def step_runs(self, step_id: str) -> bool | None:
        """Whether anything of the step runs on its nodes (see slurm_cli.parse_sstat)."""
        # Short: a node that does not answer makes sstat wait its MessageTimeout, and the
        # answer would be "unknown" anyway.
        return parse_sstat(await run_async(sstat_argv(step_id), SSTAT_TIMEOUT_S), step_id)

    async def job(self) -> JobInfo | None:
        """The allocation as Slurm sees it now; None once Slurm no longer knows it."""
        res = await run_async(job_argv(self.job_id))
        if res.code != 0:
            if "Invalid job id" in res.err:
                return None
            raise SlurmUnreachable(f"scontrol show job: {res.line()}")
        return parse_job(res.out)

    async def node_states(self, nodes: tuple[str, ...]) -> dict[str, NodeState]:
        res = await run_async(sinfo_argv(nodes))
        if res.code != 0:
            raise SlurmUnreachable(f"sinfo: {res.line()}")
        return parse_sinfo_nodes(res.out)


class SlurmGroup(ProcessGroup):
    """A ProcessGroup whose local process is `srun`: the same spawn, log pump and exit
    watch; its own launch checks, stop and (no) rank watch, as the ranks are remote."""

    # srun dies with the daemon (its steps are cancelled through Slurm and relaunched by
    # the next daemon): live restore covers local groups only.
    outlives_daemon = False

    def __init__(self, plan: InstancePlan, state_dir: str, client: SlurmClient, ops: OsOps,
                 log_file: RotatingLog, on_trouble: Trouble, on_back: Callable[[], None],
                 recorded: asyncio.Event | None = None):
        super().__init__(plan, state_dir, ops, None, None, log_file, on_trouble)  # type: ignore[arg-type]
        self.step_name = step_name(state_dir, plan.instance_id)
        self._client = client
        self._on_back = on_back
        self._recorded = recorded
        # Set while Slurm says a node of ours cannot run it: the instance goes to FAILED
        # instead of retrying, and a launch is refused with this reason.
        self.unavailable: str | None = None

    @property
    def where(self) -> str:
        return ",".join(self.plan.nodes)

    # --- what the node watch says ------------------------------------------------------
    def node_trouble(self, problem: str | None) -> None:
        """Slurm's verdict on our node(s): a reason while they cannot run us, None when they can."""
        if problem == self.unavailable:
            return
        was, self.unavailable = self.unavailable, problem
        if problem:
            self.log.note(problem)
            self._on_trouble(problem)  # out of rotation now; the instance stops us and goes FAILED
        elif was:
            self.log.note(f"Slurm reports {self.where} usable again")
            self._on_back()

    # --- launch ----------------------------------------------------------------------
    async def launch(self, cmd: LaunchCommand) -> None:
        if self._recorded is not None:
            await self._recorded.wait()  # `down` must be able to find the step before it exists
        if self.unavailable:
            raise LaunchFailed(self.unavailable)
        # A step of an earlier launch still holds the ports there (its node was unreachable
        # when we stopped it): it goes first.
        left = await self._cancel_steps("KILL", STEP_GONE_TIMEOUT_S)
        if left:
            raise LaunchFailed(f"step {', '.join(left)} of an earlier launch still runs on {self.where}: "
                               "Slurm has not ended it yet")
        await self._spawn(cmd)

    def _exit_reason(self, pid: int, code: int) -> str:
        # srun ends when the step ends: mpirun exited (a rank died and Open MPI tore the
        # job down), or Slurm ended the step. The ranks are on another host: this is the
        # event-driven part of exit detection; probes and the canary do the rest.
        return f"srun (pid {pid}, step {self.step_name} on {self.where}) exited with code {code}"

    async def watch_all(self) -> None:
        """Nothing to watch locally beyond srun: the ranks live on the node."""

    # --- stop ------------------------------------------------------------------------
    async def stop(self, grace_s: float, failed: bool = False) -> None:
        self._stopping = True
        t0 = time.monotonic()
        if failed:
            grace_s = min(grace_s, FAILED_GROUP_GRACE_S)
        reachable = self.unavailable is None
        iid = self.plan.instance_id
        if reachable:
            # SIGTERM to every process of the step through slurmd: mpirun passes it on to
            # its ranks, which finish what they are doing within the grace.
            with contextlib.suppress(SlurmUnreachable):
                log.debug("instance=%s slurm stop: TERM to step(s) %s", iid, await self._signal_steps("TERM"))
            await self._wait_srun(grace_s)
        if self.running:
            # srun cancels its step on SIGTERM, through slurmstepd directly (this works when
            # only the node's slurmd is gone); it waits up to KillWait for the step to end,
            # which slurmctld never confirms for a node it cannot reach.
            log.debug("instance=%s slurm stop: srun runs on after %gs: SIGTERM", iid, grace_s)
            self._ops.killpg(self.mpirun.pid, signal.SIGTERM)  # type: ignore[union-attr]  # running: it is set
            await self._wait_srun(SRUN_CANCEL_WAIT_S if reachable else SRUN_UNREACHABLE_WAIT_S)
        if self.running:
            log.debug("instance=%s slurm stop: srun ignored SIGTERM: SIGKILL", iid)
            self._ops.killpg(self.mpirun.pid, signal.SIGKILL)  # type: ignore[union-attr]
            await self._wait_srun(5.0)
        left: list[str] = []
        if reachable:
            log.debug("instance=%s slurm stop: KILL to the step until squeue lists it no more", iid)
            left = await self._cancel_steps("KILL", STEP_GONE_TIMEOUT_S)
        if left:
            log.warning("instance=%s step(s) %s still listed by squeue %.0fs after stop", self.plan.instance_id,
                        ", ".join(left), STEP_GONE_TIMEOUT_S)
        elif not reachable:
            self.log.note(f"{self.where} unreachable: its step is left to Slurm and cancelled before the next launch")
        if self.mpirun is not None:
            self.log.note(f"srun exited with code {self.mpirun.returncode}")
        await self._end_tasks()
        self.mpirun, self.pids, self.command = None, [], None
        log.debug("instance=%s slurm stop: %.3fs (grace %gs)", iid, time.monotonic() - t0, grace_s)

    async def _wait_srun(self, timeout_s: float) -> None:
        if self.mpirun is not None and self.mpirun.returncode is None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.mpirun.wait(), timeout_s)

    async def _our_steps(self) -> list[str]:
        steps = await self._client.steps(self._client.job_id)
        return [s.step_id for s in steps if s.name == self.step_name]

    async def _signal_steps(self, sig: str) -> list[str]:
        ids = await self._our_steps()
        if ids:
            await self._client.signal(ids, sig)
        return ids

    async def _cancel_steps(self, sig: str, timeout_s: float) -> list[str]:
        """Signal our steps until squeue lists none; the ones still listed after `timeout_s`
        (orphaned records, which hold nothing, are not waited for)."""
        seen: list[str] = []

        async def listed() -> list[str]:
            seen[:] = await self._our_steps()
            return seen

        try:
            _, left = await cancel_steps(self._client, listed, sig, timeout_s, self.log.note)
        except SlurmUnreachable as exc:
            self.log.note(f"cannot list steps: {exc}")
            return seen  # what it listed last still stands
        return left


class SlurmLauncher:
    """The allocation: makes the groups, watches their nodes, records how to find the steps."""

    def __init__(self, job_id: str, nodes: tuple[str, ...], state_dir: Path, poll_s: Callable[[], float],
                 client: SlurmClient | None = None):
        self.job_id = job_id
        self.nodes = nodes
        self.state_dir = state_dir
        self._poll_s = poll_s  # read every round: a reload may change it
        self.client = client or SlurmClient(job_id)
        self.groups: list[SlurmGroup] = []
        self.recorded = asyncio.Event()
        self._verdicts: dict[str, str | None] = {}
        self._unreachable_logged = False
        self._job_nodes: tuple[str, ...] = nodes  # the allocation's node list at the last poll

    def make_group(self, plan: InstancePlan, ops: OsOps, log_file: RotatingLog, on_trouble: Trouble,
                   on_back: Callable[[], None]) -> SlurmGroup:
        group = SlurmGroup(plan, str(self.state_dir), self.client, ops, log_file, on_trouble, on_back,
                           self.recorded)
        self.groups.append(group)
        return group

    async def run(self) -> None:
        """Owned by the daemon (a background task): record, then watch the nodes until cancelled."""
        await asyncio.to_thread(write_record, self.state_dir, self.job_id)
        self.recorded.set()
        while True:
            await self.check_nodes()
            await asyncio.sleep(self._poll_s())

    async def check_nodes(self) -> dict[str, str | None]:
        """One look at the allocation; tells every group its nodes' verdict."""
        try:
            job = await self.client.job()
            states = await self.client.node_states(self.nodes) if job is not None else {}
        except SlurmUnreachable as exc:
            # No news is not bad news: a busy slurmctld does not mean our nodes are down.
            if not self._unreachable_logged:
                log.warning("slurm: %s; node states unknown until it answers", exc)
                self._unreachable_logged = True
            return self._verdicts
        self._unreachable_logged = False
        if job is not None and job.nodes != self._job_nodes:
            self._job_nodes = job.nodes
            log.warning("slurm: %s", node_list_decision(self.job_id, self.nodes, job.nodes))
        verdicts = {node: node_verdict(node, self.job_id, job, states.get(node)) for node in self.nodes}
        for node, verdict in verdicts.items():
            if verdict != self._verdicts.get(node):
                if verdict:
                    log.warning("slurm: %s", verdict)
                elif node in self._verdicts:
                    log.info("slurm: node %s is usable again", node)
        self._verdicts = verdicts
        for group in self.groups:
            problems = [verdicts[n] for n in group.plan.nodes if verdicts.get(n)]
            group.node_trouble(problems[0] if problems else None)
        return verdicts


def node_list_decision(job_id: str, planned: tuple[str, ...], now: tuple[str, ...]) -> str:
    """What the daemon does when the allocation's node list changed between two polls."""
    gone = [n for n in planned if n not in now]
    new = [n for n in now if n not in planned]
    parts = [f"allocation {job_id} now holds {','.join(now) or 'no node'} (planned on {','.join(planned)})"]
    if gone:
        # --no-kill: a node Slurm declared DOWN leaves the job, and Slurm never gives it back.
        parts.append(f"the groups on {','.join(gone)} stay FAILED for the rest of the allocation")
    else:
        parts.append("every planned node is in it")
    if new:
        parts.append(f"{','.join(new)} is not used until `down` and `up` plan again")
    return "; ".join(parts)


def node_verdict(node: str, job_id: str, job: JobInfo | None, state: NodeState | None) -> str | None:
    """Why `node` cannot run our groups now, in Slurm's words; None when it can."""
    if job is None:
        return f"allocation {job_id} is gone (Slurm no longer knows the job)"
    if job.state != "RUNNING":
        return f"allocation {job_id} ended: JobState={job.state}"
    if node not in job.nodes:
        why = state.trouble() if state is not None else None
        return f"node {node} left allocation {job_id}" + (f" ({why})" if why else "")
    return state.trouble() if state is not None else None


async def cancel_steps(client: SlurmClient, listed: Callable[[], Awaitable[list[str]]], sig: str, timeout_s: float,
                       note: Callable[[str], None]) -> tuple[list[str], list[str]]:
    """Signal the steps `listed()` names until squeue lists none of them. Returns (signalled,
    still listed after `timeout_s`), orphaned records in neither. SlurmUnreachable from
    `listed` goes to the caller.

    A step still listed ORPHAN_CHECK_S after its signal, whose node's slurmd answers that
    no such step runs there (sstat), is an orphaned record: its slurmstepd died with
    everything else on a node that was killed or rebooted before Slurm noticed.
    slurmctld keeps such a record until the job ends or the node goes DOWN, and no user
    command removes it (scancel reaches no slurmstepd); nothing of it holds a port, a
    GPU or a CPU. It is said once and not waited for.
    """
    deadline = time.monotonic() + timeout_s
    signalled: dict[str, float] = {}  # step -> when it was signalled, or last asked with sstat
    orphans: set[str] = set()
    while True:
        ids = [i for i in await listed() if i not in orphans]
        if not ids:
            return [i for i in signalled if i not in orphans], []
        now = time.monotonic()
        fresh = [i for i in ids if i not in signalled]
        if fresh:
            await client.signal(fresh, sig)
            signalled.update(dict.fromkeys(fresh, now))
        for i in ids:
            if now - signalled[i] >= ORPHAN_CHECK_S:
                signalled[i] = now
                if await client.step_runs(i) is False:
                    orphans.add(i)
                    note(f"step {i}: Slurm still lists it, but its node's slurmd knows no such step (nothing "
                         "of it runs: an orphaned record, which Slurm keeps until the job ends or the node "
                         "goes DOWN); not waited for")
        if now >= deadline:
            return [i for i in signalled if i not in orphans], [i for i in ids if i not in orphans]
        await asyncio.sleep(POLL_S)


# --- finding steps by name: `down` and the next `up`, after a killed daemon ----------------
def write_record(state_dir: Path, job_id: str) -> None:
    path = state_dir / RECORD_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"job_id": job_id, "step_prefix": step_prefix(str(state_dir))}))
    tmp.replace(path)


def read_record(state_dir: Path) -> dict | None:
    try:
        return json.loads((state_dir / RECORD_FILE).read_text())
    except (OSError, ValueError):
        return None


async def sweep_steps(state_dir: Path, timeout_s: float = STEP_GONE_TIMEOUT_S,
                      client: SlurmClient | None = None) -> tuple[list[str], list[str]]:
    """Cancel every step named for this state dir, in any job of ours.

    Returns (cancelled, still listed after `timeout_s`). Without a record of a Slurm run
    in the state dir it asks Slurm nothing. The record goes once no step is left.
    """
    record = read_record(state_dir)
    if record is None:
        return [], []
    prefix = step_prefix(str(state_dir))
    client = client or SlurmClient(record.get("job_id", ""))
    announced: set[str] = set()

    async def listed() -> list[str]:
        ours = [s.step_id for s in await client.steps() if s.name.startswith(prefix)]
        fresh = [i for i in ours if i not in announced]
        if fresh:
            log.warning("cancelling step(s) left by a previous daemon: %s", ", ".join(fresh))
            announced.update(fresh)
        return ours

    try:
        cancelled, left = await cancel_steps(client, listed, "KILL", timeout_s, lambda line: log.warning("%s", line))
    except SlurmUnreachable as exc:
        log.warning("cannot ask Slurm for the run's steps: %s", exc)
        return sorted(announced), [f"(unknown: {exc})"]
    if not left:
        (state_dir / RECORD_FILE).unlink(missing_ok=True)
    return cancelled, left
