"""What the allocation we run in holds: its nodes, their addresses, GPUs and CPUs.

Asked once, when planning (blocking calls: `up` and `plan` run this before any event
loop; a reload runs it in a worker thread).
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable, Mapping

from orchestrator.cluster_plan import NodeInfo
from orchestrator.errors import UsageError
from orchestrator.launcher.slurm_cli import JobInfo, Result, job_argv, nodes_argv, parse_fields, parse_job, run_sync
from orchestrator.launcher.slurm_command import STEP_PREFIX

Run = Callable[..., Result]


def resolve_launcher(choice: str, environ: Mapping[str, str]) -> str:
    """'local' or 'slurm'. auto: Slurm inside an allocation (SLURM_JOB_ID set), else local."""
    job = environ.get("SLURM_JOB_ID", "")
    if choice == "slurm" and not job:
        raise UsageError("--launcher", "slurm", "not inside a Slurm allocation (SLURM_JOB_ID is not set): "
                         "run it from sbatch or salloc, or use --launcher local")
    if choice == "auto":
        return "slurm" if job else "local"
    return choice


def load_job(job_id: str, run: Run = run_sync) -> JobInfo:
    res = run(job_argv(job_id))
    job = parse_job(res.out) if res.code == 0 else None
    if job is None:
        raise UsageError("SLURM_JOB_ID", job_id, f"Slurm does not know this job ({res.line()})")
    if job.state != "RUNNING":
        raise UsageError("SLURM_JOB_ID", job_id, f"the allocation is {job.state}, not RUNNING")
    return job


def node_addresses(nodes: tuple[str, ...], run: Run = run_sync,
                   resolve: Callable[[str], str] = socket.gethostbyname) -> dict[str, str]:
    """Each node's NodeAddr as Slurm knows it (what slurmctld reaches it by), as an IP."""
    res = run(nodes_argv(nodes))
    if res.code != 0:
        raise UsageError("SLURM_JOB_ID", ",".join(nodes), f"scontrol show node failed: {res.line()}")
    out = {}
    for line in res.out.splitlines():
        fields = parse_fields(line)
        name, addr = fields.get("NodeName", ""), fields.get("NodeAddr", "")
        if name in nodes:
            out[name] = _as_ip(addr or name, resolve, name)
    missing = [n for n in nodes if n not in out]
    if missing:
        raise UsageError("SLURM_JOB_ID", ",".join(nodes), f"scontrol shows no NodeAddr for {','.join(missing)}")
    return out


def _as_ip(addr: str, resolve: Callable[[str], str], node: str) -> str:
    try:
        return str(ipaddress.ip_address(addr))
    except ValueError:
        pass
    try:
        return resolve(addr)
    except OSError as exc:
        raise UsageError("--bind-interface", "", f"cannot resolve {node}'s NodeAddr {addr!r} ({exc}): "
                         "name the cluster network with --bind-interface IFACE") from None


def probe_interface(job_id: str, nodes: tuple[str, ...], iface: str, scope: str,
                    run: Run = run_sync) -> dict[str, str]:
    """The IPv4 address of `iface` on every node, from one short step across them all."""
    script = 'echo "$SLURMD_NODENAME $(ip -o -4 addr show dev "$0" 2>&1 | head -n 1)"'
    res = run(["srun", f"--jobid={job_id}", f"--job-name={STEP_PREFIX}{scope}.probe", "--overlap",
               f"--nodes={len(nodes)}", "--ntasks-per-node=1", f"--nodelist={','.join(nodes)}",
               "/bin/sh", "-c", script, iface], timeout_s=60.0)
    found = parse_probe(res.out)
    missing = [n for n in nodes if n not in found]
    if res.code != 0 and not found:
        raise UsageError("--bind-interface", iface, f"could not look it up on the nodes: {res.line()}")
    if missing:
        raise UsageError("--bind-interface", iface, f"no IPv4 address on {','.join(missing)}")
    return found


def parse_probe(text: str) -> dict[str, str]:
    """'node1 3: cl0    inet 10.0.0.1/24 brd ...' lines -> node -> address."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"(\S+) .*\binet (\d+\.\d+\.\d+\.\d+)/", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def choose_addresses(nodes: tuple[str, ...], bind_address: str, node_addrs: Callable[[], dict[str, str]],
                     iface_addrs: Callable[[], dict[str, str]] | None) -> dict[str, str]:
    """Where each node's instances bind (and the load balancer connects).

    --bind-interface: that interface's address on each node. --bind-address: that
    address, which only one node can have. Neither (loopback, the local default, which
    no other host can reach): each node's Slurm NodeAddr.
    """
    if iface_addrs is not None:
        return iface_addrs()
    if not _is_loopback(bind_address):
        if len(nodes) > 1:
            raise UsageError("--bind-address", bind_address, f"one address cannot be on {len(nodes)} nodes: "
                             "use --bind-interface IFACE, or leave it unset for each node's Slurm NodeAddr")
        return {nodes[0]: bind_address}
    return node_addrs()


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return addr == "localhost"


def allocation_nodes(job: JobInfo, addresses: dict[str, str], assume_gpus: int | None) -> tuple[NodeInfo, ...]:
    """The job's nodes with what it holds there. --assume-gpus N declares N GPUs on every node."""
    out = []
    for name in job.nodes:
        held = job.per_node.get(name)
        if assume_gpus is not None:
            gpus: tuple[int, ...] = tuple(range(assume_gpus))
        elif held is not None:
            # GRES without device files have a count but no indices: number them from 0.
            gpus = held.gpus or tuple(range(held.gpu_count))
        else:
            gpus = ()
        cpus = len(held.cpus) if held is not None and held.cpus else 1
        out.append(NodeInfo(name, addresses[name], gpus, cpus))
    return tuple(out)
