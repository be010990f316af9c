"""Live restore: what a previous daemon left running that this one takes over.

A daemon that dies (kill -9, a watchdog timeout, an upgrade) leaves its engines and
its data-plane workers running: they are in sessions of their own and die with no
parent (launcher/process_tree.py). The next daemon on the same state directory reads
state.json, which the dead one kept current, and adopts each piece that is provably
the same thing it would start now:

  an instance group   its mpirun alive with the recorded start time (a recycled pid is
                      not it), tagged with this state dir and instance id, launched with
                      the command this config builds now (model repository, tritonserver
                      arguments, GPUs, ports: all in the command text), every rank alive;
  a data-plane worker alive with the recorded start time, tagged as this state dir's
                      data plane, serving the same public addresses;
  an NGINX master     (--proxy nginx) alive with the recorded start time, running with
                      this state dir's nginx prefix, serving the same public addresses.

What does not match is stopped by the usual sweep and started fresh (a changed config,
a half-dead group with a rank gone). Decisions are logged one line each. A state file
that cannot be read adopts nothing: the sweep by environment tag still finds and stops
everything, as before live restore.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from orchestrator.launcher.adopted import still_running
from orchestrator.launcher.command import ENV_INSTANCE, ENV_STATE_DIR, LaunchCommand
from orchestrator.plan import InstancePlan

log = logging.getLogger("trtllm-orch")
ENV_ROLE = "TRTLLM_ORCH_ROLE"


@dataclass(frozen=True)
class Adoptable:
    instance_id: str
    mpirun_pid: int
    create_time: float
    started_by: str
    pids: frozenset[int]  # every live process of the group: the sweep leaves them
    # Why it must be replaced once adopted ('' when it runs this config's launch command): a
    # group launched with another command on the same GPUs and ports serves until a rolling
    # restart relaunches it, one instance at a time, instead of all of them at once.
    stale: str = ""


@dataclass(frozen=True)
class AdoptableWorker:
    slot: int
    pid: int
    create_time: float
    version: str


@dataclass(frozen=True)
class AdoptableNginx:
    pid: int
    create_time: float
    http_port: int  # the ports it serves (a ':0' address was bound by its daemon)
    grpc_port: int | None
    side_port: int  # where its config sends /v1/ and its backup (the side workers'; 0: none)


@dataclass
class Prior:
    """What the previous daemon left that this one adopts."""

    instances: dict[str, Adoptable] = field(default_factory=dict)
    workers: list[AdoptableWorker] = field(default_factory=list)
    nginx: AdoptableNginx | None = None
    notes: list[str] = field(default_factory=list)
    # instance id -> its restarts under the daemons before, adopted or not: `status` counts the
    # service's, not this daemon's (a watchdog's restart of the daemon showed every count at 0)
    restarts: dict[str, int] = field(default_factory=dict)

    def keep_pids(self) -> set[int]:
        keep = {w.pid for w in self.workers}
        if self.nginx is not None:
            keep.add(self.nginx.pid)  # its workers are not swept (nothing tags them)
        for group in self.instances.values():
            keep |= group.pids
        return keep


def find_prior(state: dict[str, Any] | None, plans: Iterable[InstancePlan],
               build_command: Callable[[InstancePlan], LaunchCommand], state_dir: str,
               listen: dict[str, str], local_launcher: bool = True, proxy: str = "embedded") -> Prior:
    """What in `state` (state.json of the previous daemon) this daemon may adopt. proxy: this
    config's --proxy: the data plane of another mode is not adopted (its processes are swept)."""
    prior = Prior()
    if state is None:
        return prior
    if not isinstance(state, dict) or not isinstance(state.get("instances", {}), dict):
        prior.notes.append("state.json unreadable: adopting nothing (its processes are swept by tag)")
        return prior
    by_id = {p.instance_id: p for p in plans}
    for iid, record in state.get("instances", {}).items():
        if isinstance(record, dict) and type(record.get("restarts")) is int and iid in by_id:
            prior.restarts[iid] = max(0, record["restarts"])
    if not local_launcher:
        if state.get("instances"):
            prior.notes.append("Slurm groups are relaunched, not adopted (srun died with the daemon)")
        return prior
    for iid, record in state.get("instances", {}).items():
        why = _instance_mismatch(iid, record, by_id.get(iid), build_command, state_dir)
        if isinstance(why, Adoptable):
            prior.instances[iid] = why
            prior.notes.append(f"instance {iid}: adopting mpirun pid {why.mpirun_pid} "
                               f"(started by trtllm-orch {why.started_by or '?'})"
                               + (f"; {why.stale}: replaced by a rolling restart once adopted" if why.stale else ""))
        elif why:
            prior.notes.append(f"instance {iid}: not adopted: {why}")
    prior.workers, worker_notes = _workers(state.get("dataplane"), state_dir, listen, workers_kind_for(proxy))
    prior.notes += worker_notes
    if proxy == "nginx":  # else a master left serving the port is swept, not kept beside the new data plane
        prior.nginx, nginx_notes = _nginx(state.get("dataplane"), state_dir, listen)
        prior.notes += nginx_notes
    return prior


def _instance_mismatch(iid: str, record: Any, plan: InstancePlan | None,
                       build_command: Callable[[InstancePlan], LaunchCommand], state_dir: str) -> Adoptable | str:
    """An Adoptable, or why not ('' when there is nothing to say: no process recorded)."""
    if not isinstance(record, dict) or not record.get("mpirun_pid"):
        return ""
    pid, created = record.get("mpirun_pid"), record.get("mpirun_create_time")
    if not isinstance(pid, int) or not isinstance(created, (int, float)):
        return "its record in state.json is incomplete"
    if not still_running(pid, created):
        return f"mpirun pid {pid} is gone"
    if plan is None:
        return "not in this config's plan"
    stale = ""
    launch = record.get("launch")
    if launch != build_command(plan).shell_text():
        stale = "its launch command differs from this config's (changed model repository, arguments or GPUs)"
        if not isinstance(launch, str) or not _same_place(launch, plan):
            return stale + ", on other GPUs or ports"
    if not _tagged(pid, state_dir, iid):
        return f"pid {pid} does not carry this run's environment tag"
    group = _group_processes(pid, state_dir, iid)
    ranks = sum(1 for p in group if _name(p) == "tritonserver")
    if ranks != plan.tp:
        return f"half-dead: {ranks} of {plan.tp} tritonserver ranks alive"
    return Adoptable(iid, pid, float(created), str(record.get("started_by") or ""),
                     frozenset(p.pid for p in group) | {pid}, stale)


def _same_place(launch: str, plan: InstancePlan) -> bool:
    """Whether a recorded launch command ran on this plan's GPUs and ports: only such a group
    can serve on while the others start (it holds nothing another instance needs)."""
    words = set(launch.split())
    p = plan.ports
    return {f"CUDA_VISIBLE_DEVICES={plan.cuda_visible_devices}", f"--http-port={p.http}",
            f"--grpc-port={p.grpc}", f"--metrics-port={p.metrics}"} <= words


def workers_kind_for(proxy: str) -> str:
    """The data-plane workers a `--proxy` mode runs: the embedded data plane's, which serve the
    public sockets, or the side workers beside NGINX (controlplane/side_workers.py). A daemon
    started in another mode must not adopt the other kind: side workers would take the public
    sockets over from embedded ones."""
    return "embedded" if proxy == "embedded" else "side"


def _workers(record: Any, state_dir: str, listen: dict[str, str],
             kind: str) -> tuple[list[AdoptableWorker], list[str]]:
    if not isinstance(record, dict) or not record.get("workers"):
        return [], []
    if not same_addresses(record.get("listen"), listen):
        return [], [f"data plane: not adopted: it serves {record.get('listen')}, this config {listen}"]
    was = record.get("workers_kind", "embedded")  # a daemon before the side workers ran only those
    if was != kind:
        return [], [f"data plane: not adopted: its workers are {was} workers, this config runs {kind} ones"]
    out, notes = [], []
    for w in record["workers"]:
        try:
            worker = AdoptableWorker(int(w["slot"]), int(w["pid"]), float(w["create_time"]), str(w.get("version", "")))
        except (KeyError, TypeError, ValueError):
            notes.append("data plane: a worker's record is incomplete: not adopted")
            continue
        if still_running(worker.pid, worker.create_time) and _env(worker.pid).get(ENV_ROLE) == "dataplane" \
                and _env(worker.pid).get(ENV_STATE_DIR) == state_dir:
            out.append(worker)
    if out:
        notes.append(f"data plane: adopting {len(out)} worker(s): pids {', '.join(str(w.pid) for w in out)}")
    return out, notes


def same_addresses(recorded: Any, listen: dict[str, str]) -> bool:
    """Whether a data plane recorded as serving `recorded` serves this config's addresses. An
    address a daemon before it did not record counts as '' (openai_listen, recorded since the
    side workers: an upgrade adopts the data plane of the release before)."""
    return isinstance(recorded, dict) and {k: recorded.get(k, "") for k in listen} == listen


def _nginx(record: Any, state_dir: str, listen: dict[str, str]) -> tuple[AdoptableNginx | None, list[str]]:
    if not isinstance(record, dict) or not isinstance(record.get("nginx"), dict):
        return None, []
    if not same_addresses(record.get("listen"), listen):
        return None, [f"nginx: not adopted: it serves {record.get('listen')}, this config {listen}"]
    r = record["nginx"]
    try:
        grpc = r.get("grpc_port")
        found = AdoptableNginx(int(r["pid"]), float(r["create_time"]), int(r["http_port"]),
                               int(grpc) if grpc is not None else None,
                               # openai_port: a daemon's before the side workers, its own /v1/ listener
                               int(r.get("side_port") or r.get("openai_port") or 0))
    except (KeyError, TypeError, ValueError):
        return None, ["nginx: its record is incomplete: not adopted"]
    prefix = str(Path(state_dir) / "nginx")
    if not still_running(found.pid, found.create_time):
        return None, [f"nginx: master pid {found.pid} is gone"]
    if r.get("prefix") != prefix or not _runs_with(found.pid, prefix):
        return None, [f"nginx: pid {found.pid} is not this state dir's nginx master"]
    return found, [f"nginx: adopting master pid {found.pid}"]


def _runs_with(pid: int, prefix: str) -> bool:
    """An nginx master started with `prefix` (its title keeps the command line: `nginx: master
    process /usr/sbin/nginx -p PREFIX ...`)."""
    try:
        proc = psutil.Process(pid)
        words = " ".join(proc.cmdline()).split()
        return "nginx" in proc.name() and "master" in words and prefix in words
    except psutil.Error:
        return False


def _env(pid: int) -> dict[str, str]:
    try:
        return psutil.Process(pid).environ()
    except (psutil.Error, OSError):
        return {}


def _tagged(pid: int, state_dir: str, iid: str) -> bool:
    env = _env(pid)
    return env.get(ENV_STATE_DIR) == state_dir and env.get(ENV_INSTANCE) == iid


def _group_processes(root: int, state_dir: str, iid: str) -> list[psutil.Process]:
    from orchestrator.launcher.process_tree import process_tree, tagged_processes
    procs = {p.pid: p for p in tagged_processes(state_dir, iid)}
    for p in process_tree(root):
        procs.setdefault(p.pid, p)
    return list(procs.values())


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.Error:
        return ""
