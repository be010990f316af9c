"""Build the one mpirun command (leader mode) that runs an instance's TP group.

Mirrors `launch_triton_server.py`, with what it gets wrong fixed:
- only rank 0 serves HTTP/gRPC/metrics, on loopback; ranks != 0 bind nothing
  (`--allow-*=false`), so models whose worker ranks return from init cannot
  collide on the ports;
- Python-backend shared-memory prefixes are unique per instance and rank, so two
  instances on one host never share /dev/shm regions;
- every rank sees exactly its group's GPUs and carries a tag in its environment
  so `down` can find it even after it was orphaned.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

from orchestrator.errors import EnvironmentProblem, UsageError
from orchestrator.plan import InstancePlan
from orchestrator.launcher.affinity import Pinner
from orchestrator.launcher.mpi import MpiFlavour

DEFAULT_TRITONSERVER = "/opt/tritonserver/bin/tritonserver"
# Environment tags: every process of a run carries them, which is how a sweep
# finds ranks and stubs that outlived their mpirun (see process_tree.py).
ENV_STATE_DIR = "TRTLLM_ORCH_STATE_DIR"
ENV_INSTANCE = "TRTLLM_ORCH_INSTANCE"
ENV_GROUP_DIR = "TRTLLM_ORCH_GROUP_DIR"


@dataclass(frozen=True)
class LaunchCommand:
    argv: tuple[str, ...]
    env: dict[str, str]  # variables we add to (or override in) the daemon's environment
    # The job's private TMPDIR (see build_launch), emptied before each launch and
    # removed after each stop; "" where the job's temp files are not on this host.
    scratch: str = ""

    def shell_text(self) -> str:
        import shlex
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return prefix + " " + shlex.join(self.argv)


def find_tritonserver(explicit: str) -> str:
    if explicit:
        if not (os.path.isfile(explicit) and os.access(explicit, os.X_OK)):
            raise UsageError("--tritonserver", explicit, "not an executable file")
        return os.path.abspath(explicit)
    found = shutil.which("tritonserver")
    if found:
        return found
    if os.access(DEFAULT_TRITONSERVER, os.X_OK):
        return DEFAULT_TRITONSERVER
    raise EnvironmentProblem("tritonserver not found on PATH or at /opt/tritonserver/bin: "
                             "pass --tritonserver PATH (scripts/setup-triton prepares one)")


def shm_scope(state_dir: str) -> str:
    """A short tag of the state dir, so two daemons on one host never share a shm prefix."""
    import hashlib
    return hashlib.sha1(state_dir.encode()).hexdigest()[:8]


def shm_prefix(instance_id: str, rank: int, scope: str = "") -> str:
    # Unique per instance and rank, and per daemon through `scope`: a stopped instance
    # unlinks every region with its prefix (instance._clean_shm), and without the scope
    # that also deleted the live regions of another daemon's instance with the same id
    # (its starting stubs then failed: "Unable to initialize shared memory key").
    # Still matches reaper's "orch_i*_r*_*" glob.
    return f"orch_i{instance_id}_r{rank}_" + (f"{scope}_" if scope else "")


CUDA_POOL_FLAG = "--cuda-memory-pool-byte-size"
PINNED_POOL_FLAG = "--pinned-memory-pool-byte-size"


def _flag_values(extra: tuple[str, ...], flag: str) -> list[str]:
    """Values given to `flag` in the user's tritonserver args (`--f=v` or `--f v`)."""
    values = []
    for i, arg in enumerate(extra):
        if arg.startswith(flag + "="):
            values.append(arg[len(flag) + 1:])
        elif arg == flag and i + 1 < len(extra):
            values.append(extra[i + 1])
    return values


def own_gpu_only_args(inst: InstancePlan, rank: int, extra: tuple[str, ...]) -> list[str]:
    """Keep each rank's tritonserver off the other GPUs of its group.

    Every rank sees all of its group's GPUs (CUDA_VISIBLE_DEVICES), and tritonserver by
    default makes a 64 MiB CUDA memory pool on every GPU it sees, so each rank held a CUDA
    context on every GPU of the group, and a restart waited for the driver to tear down
    tp x tp contexts (TP2 on 2 x H200: 0.28-0.37 s for NVML to stop listing the group).
    A 0-byte pool creates no context on that device (Triton's CudaMemoryManager skips
    it); the pinned host pool (cudaHostAlloc) makes a context on the current device,
    ordinal 0, which is the rank's own GPU only for rank 0, and worker ranks serve no
    requests, so theirs is 0. Only for a group of tp > 1 on GPUs from NVML (`link` is
    known; not with --assume-gpus). Overridable: a pool size the user passes through
    --tritonserver-arg for a device (or a pinned pool size) replaces ours.
    """
    per_node = inst.gpus_per_node
    if per_node < 2 or not inst.link:
        return []
    user_cuda = {v.split(":", 1)[0].strip() for v in _flag_values(extra, CUDA_POOL_FLAG)}
    own = rank % per_node
    out = [f"{CUDA_POOL_FLAG}={d}:0" for d in range(per_node) if d != own and str(d) not in user_cuda]
    if own != 0 and not _flag_values(extra, PINNED_POOL_FLAG):
        out.append(f"{PINNED_POOL_FLAG}=0")
    return out


def rank_args(inst: InstancePlan, rank: int, model_repo: str, llm_models: tuple[str, ...],
              extra: tuple[str, ...], shm_scope: str = "") -> list[str]:
    p = inst.ports
    prefix = shm_prefix(inst.instance_id, rank, shm_scope)
    common = [f"--model-repository={model_repo}", "--disable-auto-complete-config",
              f"--backend-config=python,shm-region-prefix-name={prefix}",
              f"--id=instance{inst.instance_id}-rank{rank}", *own_gpu_only_args(inst, rank, extra)]
    if rank == 0:
        addr = inst.bind_address
        serve = [f"--http-port={p.http}", f"--grpc-port={p.grpc}", f"--metrics-port={p.metrics}",
                 f"--http-address={addr}", f"--grpc-address={addr}", f"--metrics-address={addr}"]
        return common + serve + list(extra)
    worker = ["--model-control-mode=explicit", *(f"--load-model={m}" for m in llm_models),
              "--allow-http=false", "--allow-grpc=false", "--allow-metrics=false"]
    return common + worker + list(extra)


def build_launch(inst: InstancePlan, *, mpi: MpiFlavour, tritonserver: str, model_repo: str,
                 llm_models: tuple[str, ...], extra_args: tuple[str, ...], state_dir: str,
                 group_dir: str, as_root: bool, rank_wrapper: tuple[str, ...] = (),
                 pinner: Pinner | None = None) -> LaunchCommand:
    """The full argv and added environment for one instance.

    `rank_wrapper` (e.g. `setpriv --pdeathsig KILL --`) runs in front of each rank
    so a rank dies with its launcher instead of living on as an orphan. `pinner` then
    binds each rank to its GPU's CPUs and memory node (the plan's `affinity`); it
    comes second so the death signal is set before anything else runs.
    """
    env = {
        "CUDA_VISIBLE_DEVICES": inst.cuda_visible_devices,
        # NVML numbers GPUs by PCI bus; CUDA by default fastest-first. Make them agree,
        # so the ids in --gpus mean the same GPU to us, to NVML and to the ranks.
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        ENV_STATE_DIR: state_dir,
        ENV_INSTANCE: inst.instance_id,
        ENV_GROUP_DIR: group_dir,
        # Open MPI keeps its session dir (ompi.<mpirun pid>) under TMPDIR and removes
        # it only when mpirun exits by itself. A failed group's mpirun is SIGKILLed, so
        # in the shared /tmp those dirs piled up, and a later mpirun that drew a
        # recycled pid died at once ("The PMIx server's listener thread failed to
        # start"). A per-group TMPDIR that we empty ourselves cannot go stale.
        "TMPDIR": scratch_dir(group_dir),
    }
    argv = [mpi.path, *mpi.global_flags(tuple(env), as_root)]
    for rank in range(inst.tp):
        if rank:
            argv.append(":")
        pin = pinner.argv(inst.affinity[rank]) if pinner and inst.affinity else ()
        argv += ["-n", "1", *rank_wrapper, *pin, tritonserver,
                 *rank_args(inst, rank, model_repo, llm_models, extra_args, shm_scope(state_dir))]
    return LaunchCommand(tuple(argv), env, scratch=env["TMPDIR"])


def scratch_dir(group_dir: str) -> str:
    return os.path.join(group_dir, "tmp")


def find_rank_wrapper() -> tuple[str, ...]:
    """`setpriv --pdeathsig KILL --` when util-linux has it, else nothing."""
    setpriv = shutil.which("setpriv")
    if not setpriv:
        return ()
    return (setpriv, "--pdeathsig", "KILL", "--")
