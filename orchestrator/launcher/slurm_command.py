"""The `srun` command that runs one TP group as a job step of the allocation.

Two ways, chosen per group (`--slurm-mpi`):
- mpirun inside the step (a group on one node): the step is one task on the group's
  node that runs exactly today's leader-mode mpirun command. mpirun must not see the
  allocation, or it launches ranks on other nodes through Slurm (Open MPI's ras/plm
  `slurm` components read SLURM_NODELIST); `local_only_env` turns that off.
- `srun --mpi=pmix` (a group across nodes): Slurm starts every rank itself, one task
  per GPU, and each task picks its tritonserver arguments by its rank ($SLURM_PROCID).

The command Slurm runs is `/bin/sh -c '...'`, one string: srun reads a bare `:`
among its arguments as the separator of a heterogeneous step, and mpirun's MPMD
syntax is full of them. `env VAR=...` inside the step sets the group's GPUs last,
after any CUDA_VISIBLE_DEVICES Slurm's GRES plugin put there.
"""

from __future__ import annotations

import shlex

from orchestrator.plan import InstancePlan
from orchestrator.launcher.command import ENV_GROUP_DIR, LaunchCommand, shm_scope

STEP_PREFIX = "trtllm-orch."

# Open MPI 5 (PRRTE) and 4 (ORTE), and MPICH's Hydra: launch on this node only, by fork.
# Names a flavour does not know are ignored by it. (Hydra's are untested here.)
LOCAL_ONLY_ENV = {
    "PRTE_MCA_ras": "^slurm", "PRTE_MCA_plm": "^slurm",
    "OMPI_MCA_ras": "^slurm", "OMPI_MCA_plm": "^slurm",
    "HYDRA_LAUNCHER": "fork", "HYDRA_RMK": "user",
}


def step_prefix(state_dir: str) -> str:
    """Every step of one state dir starts with this: `down` finds them by it after a SIGKILL."""
    return f"{STEP_PREFIX}{shm_scope(state_dir)}."


def step_name(state_dir: str, instance_id: str) -> str:
    return f"{step_prefix(state_dir)}i{instance_id}"


def _srun_head(srun: str, job_id: str, name: str, inst: InstancePlan, cpus: int,
               srun_args: tuple[str, ...]) -> list[str]:
    # --overlap: our steps share the allocation with the daemon's own step (sbatch's
    # batch step, an interactive srun) and with each other; the plan already keeps GPUs
    # and ports apart. --export=ALL: ranks need the daemon's environment (PATH,
    # LD_LIBRARY_PATH, PYTHONPATH of the Triton install) and its tags.
    return [srun, f"--jobid={job_id}", f"--job-name={name}", f"--nodes={len(inst.nodes)}",
            f"--nodelist={','.join(inst.nodes)}", "--overlap", f"--cpus-per-task={cpus}",
            "--kill-on-bad-exit=1", "--export=ALL", *srun_args]


def node_env(env: dict[str, str]) -> dict[str, str]:
    """A local launch's environment less what names this host only: our per-group
    TMPDIR is a directory here (on a node, srun_mpirun makes one of its own)."""
    return {k: v for k, v in env.items() if k != "TMPDIR"}


def _node_scratch(name: str) -> str:
    # The node's side of command.build_launch's per-group TMPDIR: the step's mpirun is
    # SIGKILLed with a failed group and leaves Open MPI's session dir behind. One dir
    # per step name, emptied before every launch: at most one stale dir per instance.
    d = shlex.quote(name)
    return f'd="${{TMPDIR:-/tmp}}/"{d} && rm -rf "$d" && mkdir -m 700 "$d" && export TMPDIR="$d" && '


def _node_group_dir(env: dict[str, str]) -> str:
    # The group's directory (the twin's rank sockets, its NCCL rendezvous file) is a path
    # in the daemon's state dir, which a node does not have unless the state dir is on a
    # shared filesystem: the step makes it there.
    d = env.get(ENV_GROUP_DIR)
    return f"mkdir -p -m 700 {shlex.quote(d)} && " if d else ""


def srun_mpirun(cmd: LaunchCommand, inst: InstancePlan, *, srun: str, job_id: str, name: str, cpus: int,
                srun_args: tuple[str, ...] = ()) -> LaunchCommand:
    """Today's mpirun command (`cmd`), run as a one-task step on the group's node."""
    own = node_env(cmd.env)
    env = {**own, **LOCAL_ONLY_ENV}
    inner = ["env", *(f"{k}={v}" for k, v in sorted(env.items())), *cmd.argv]
    # Stated in full, so what sbatch put in the environment (SLURM_NTASKS_PER_NODE,
    # SLURM_MPI_TYPE, ...: srun reads them as defaults) cannot reshape the step.
    argv = [*_srun_head(srun, job_id, name, inst, cpus, srun_args), "--ntasks=1", "--ntasks-per-node=1",
            "--mpi=none", "/bin/sh", "-c",
            _node_group_dir(own) + _node_scratch(name) + "exec " + shlex.join(inner)]
    return LaunchCommand(tuple(argv), own)


def srun_pmix(env: dict[str, str], rank_argvs: list[list[str]], inst: InstancePlan, *, srun: str,
              job_id: str, name: str, cpus: int, srun_args: tuple[str, ...] = ()) -> LaunchCommand:
    """One task per rank across the group's nodes; rank r runs `rank_argvs[r]`.

    Each task learns its rank from Slurm ($SLURM_PROCID, = $PMIX_RANK), not from mpirun:
    the twin's `mpi_layout` reads PMIX_RANK / SLURM_PROCID, SLURM_STEP_NUM_TASKS and
    SLURM_LOCALID. A task that dies (a signal, a non-zero exit) ends the whole step
    (--kill-on-bad-exit=1), so srun exits and the daemon sees the group fail, as with mpirun.
    """
    cases = " ".join(f"{r}) exec {shlex.join(['env', *(f'{k}={v}' for k, v in sorted(env.items())), *argv])};;"
                     for r, argv in enumerate(rank_argvs))
    script = (_node_group_dir(env) +
              f'case "$SLURM_PROCID" in {cases} *) echo "no rank $SLURM_PROCID" >&2; exit 2;; esac')
    argv = [*_srun_head(srun, job_id, name, inst, cpus, srun_args), f"--ntasks={inst.tp}",
            f"--ntasks-per-node={inst.gpus_per_node}", "--mpi=pmix", "/bin/sh", "-c", script]
    return LaunchCommand(tuple(argv), env)
