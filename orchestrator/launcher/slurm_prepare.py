"""Planning under Slurm: the allocation's nodes, the plan across them, the srun commands.

Called by `cli.prepare` when the launcher resolves to Slurm. Each group's own command
(mpirun, tritonserver, their flags) is the one the local launcher builds: it comes
from the same `prepare` run for the local launcher on a stand-in one-node plan, so
both launchers start exactly the same ranks. Only the plan and the srun around it
differ.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable
from typing import Any

from orchestrator import config as cfg
from orchestrator.cluster_plan import make_cluster_plan, step_cpus
from orchestrator.errors import OrchError, UsageError
from orchestrator.launcher.command import find_tritonserver, rank_args, shm_scope
from orchestrator.launcher.slurm_alloc import (allocation_nodes, choose_addresses, load_job, node_addresses,
                          probe_interface)
from orchestrator.launcher.slurm_cli import run_sync
from orchestrator.launcher.slurm_command import STEP_PREFIX, node_env, srun_mpirun, srun_pmix, step_name


def pmix_problem(job_id: str, scope: str, run=run_sync) -> str | None:
    """Why `srun --mpi=pmix` cannot start a task here, or None. A real one-task step: a
    cluster may list the plugin (srun --mpi=list) without the PMIx library it loads."""
    res = run(["srun", f"--jobid={job_id}", f"--job-name={STEP_PREFIX}{scope}.probe", "--overlap",
               "--mpi=pmix", "--nodes=1", "--ntasks=1", "/bin/true"], timeout_s=60.0)
    if res.code == 0:
        return None
    if "can not load PMIx library" in res.err:
        # Slurm's plugin dlopens the unversioned libpmix.so, which Debian ships in the -dev
        # package; srun's last line ("Invalid MPI type 'pmix'") would hide that.
        return ("Slurm's mpi/pmix plugin cannot load the PMIx library (libpmix.so; Debian: "
                "apt-get install libpmix-dev, on every node, then restart slurmd)")
    return res.line()


def pmix_task_cpus(plan, nodes) -> tuple[dict[str, int], list[str]]:
    """CPUs per task of each group's pmix step, and the nodes that hold too few CPUs.

    Under srun --mpi=pmix every rank is a task of its own (step_cpus counts a one-node
    group as one mpirun task): a node's CPUs are shared by every rank placed there, and a
    node with fewer CPUs in the allocation than ranks cannot start the step at all."""
    cpus = {n.name: n.cpus for n in nodes}
    tasks: dict[str, int] = {}
    for inst in plan.instances:
        for name in inst.nodes:
            tasks[name] = tasks.get(name, 0) + inst.gpus_per_node
    short = [f"{name} holds {cpus[name]} CPU(s) of the allocation for {n} rank(s)"
             for name, n in tasks.items() if cpus[name] < n]
    share = {inst.instance_id: min(max(1, cpus[name] // tasks[name]) for name in inst.nodes)
             for inst in plan.instances}
    return share, short


def prepare_slurm(settings: cfg.Settings, *, for_launch: bool, prepare_local: Callable[..., Any],
                  environ=os.environ) -> Any:
    job_id = environ["SLURM_JOB_ID"]
    job = load_job(job_id)
    state_dir = settings.resolved_state_dir()
    scope = shm_scope(str(state_dir))
    iface = settings.bind_interface
    addresses = choose_addresses(
        job.nodes, settings.bind_address, lambda: node_addresses(job.nodes),
        (lambda: probe_interface(job_id, job.nodes, iface, scope)) if iface else None)
    nodes = allocation_nodes(job, addresses, settings.assume_gpus)
    reserved = tuple(cfg.parse_host_port(v, cfg.flag(n))[1]
                     for n, v in (("listen", settings.listen), ("grpc_listen", settings.grpc_listen),
                                  ("metrics_listen", settings.metrics_listen))
                     if v and settings.proxy != "none")
    plan = make_cluster_plan(nodes, settings.gpus, settings.tp, settings.base_port, reserved)
    spans = any(len(inst.nodes) > 1 for inst in plan.instances)
    mode = settings.slurm_mpi
    if mode == "auto":
        mode = "pmix" if spans else "mpirun"
    if spans and mode == "mpirun":
        raise UsageError("--slurm-mpi", settings.slurm_mpi, f"--tp {settings.tp} spans nodes: its ranks "
                         "must be started by srun --mpi=pmix")
    pmix_cpus, short = pmix_task_cpus(plan, nodes)
    if mode == "pmix" and short:
        raise UsageError("--slurm-mpi", settings.slurm_mpi, "srun --mpi=pmix runs one task per rank, each "
                         f"on a CPU of its own: {'; '.join(short)} (allocate with --exclusive, or "
                         "--ntasks-per-node / --cpus-per-task)")
    problem = pmix_problem(job_id, scope) if mode == "pmix" else None
    if problem:
        needs = f" (--tp {settings.tp} spans nodes and needs it)" if spans else ""
        raise UsageError("--slurm-mpi", settings.slurm_mpi, f"srun --mpi=pmix does not work here{needs}: {problem}")

    # The local launcher's command for a group: the same prepare() on a one-node stand-in.
    # Placement by topology and CPU pinning need the node's NVML: not from here.
    stand_in = dataclasses.replace(settings, launcher="local", gpus="all", tp=1, topology="",
                                   assume_gpus=max(1, max(len(n.gpus) for n in nodes)),
                                   placement="ordered", cpu_affinity="off", bind_interface="",
                                   bind_address="127.0.0.1")
    local = prepare_local(stand_in, for_launch=for_launch)
    srun = shutil.which("srun") or "srun"
    cpus = pmix_cpus if mode == "pmix" else step_cpus(plan, nodes)
    model_repo = os.path.abspath(settings.model_repo) if settings.model_repo else "<model-repo>"
    try:
        tritonserver = find_tritonserver(settings.tritonserver)
    except OrchError:  # `plan` without one still shows the commands (prepare_local checked `up`)
        tritonserver = settings.tritonserver or "tritonserver"

    def build_command(inst):
        name = step_name(str(state_dir), inst.instance_id)
        common = dict(srun=srun, job_id=job_id, name=name, cpus=cpus[inst.instance_id],
                      srun_args=settings.srun_arg)
        cmd = local.build_command(inst)
        if mode == "mpirun":
            return srun_mpirun(cmd, inst, **common)
        ranks = [[tritonserver, *rank_args(inst, r, model_repo, settings.tensorrt_llm_model,
                                                      settings.tritonserver_arg, scope)]
                 for r in range(inst.tp)]
        return srun_pmix(node_env(cmd.env), ranks, inst, **common)

    commands = {inst.instance_id: build_command(inst) for inst in plan.instances}
    notes = (f"Slurm allocation {job_id}: {len(nodes)} node(s) ({', '.join(n.name for n in nodes)}); "
             f"groups run as steps ({'mpirun inside each step' if mode == 'mpirun' else 'srun --mpi=pmix'})",)
    return dataclasses.replace(local, settings=settings, plan=plan, build_command=build_command,
                               commands=commands, gpus_from_nvml=False, notes=notes,
                               launcher=("slurm", job_id, tuple(n.name for n in nodes)))

