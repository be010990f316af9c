"""The plan across the nodes of a Slurm allocation. Pure: no processes, no sockets.

A TP group stays inside one node whenever it fits: its ranks then talk over NVLink,
never the network. Only a `--tp` larger than a node's GPUs makes a group span nodes,
and then it takes whole nodes (a half-used node would strand GPUs no group can use).
Ports are numbered as on one host (instance i: base+3i ..), so an instance's ports
do not depend on which node it landed on.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.errors import UsageError
from orchestrator.gpus import parse_gpu_spec
from orchestrator.plan import InstancePlan, Plan, instance_ports


@dataclass(frozen=True)
class NodeInfo:
    name: str
    address: str  # where its instances bind, and where the load balancer reaches them
    gpus: tuple[int, ...]  # the GPU indices the allocation holds there
    cpus: int = 1  # CPUs the allocation holds there (each step gets its share)


def select_gpus(nodes: tuple[NodeInfo, ...], spec: str) -> dict[str, tuple[int, ...]]:
    """`--gpus` applies to every node: '0-1' means GPUs 0 and 1 of each node."""
    picked = {}
    for node in nodes:
        if not node.gpus:
            raise UsageError("--gpus", spec, f"the allocation holds no GPUs on {node.name}: allocate them "
                             "(sbatch --gres=gpu:N) or declare them with --assume-gpus N")
        try:
            picked[node.name] = parse_gpu_spec(spec, node.gpus)
        except UsageError as exc:
            raise UsageError("--gpus", spec, exc.why.replace("this host", f"{node.name} of the allocation")) from None
    return picked


def make_cluster_plan(nodes: tuple[NodeInfo, ...], gpu_spec: str, tp: int, base_port: int,
                      reserved_ports: tuple[int, ...] = ()) -> Plan:
    if tp < 1:
        raise UsageError("--tp", tp, "must be at least 1")
    if not nodes:
        raise UsageError("--launcher", "slurm", "the allocation has no nodes")
    picked = select_gpus(nodes, gpu_spec)
    total = sum(len(ids) for ids in picked.values())
    if tp > total:
        per_node = sorted({len(ids) for ids in picked.values()})
        shape = f"{len(nodes)} node(s) x {per_node[0]}" if len(per_node) == 1 else f"{len(nodes)} node(s)"
        raise UsageError("--tp", tp, f"needs {tp} GPUs per group; the allocation has {total} ({shape} selected)")
    groups: list[tuple[tuple[str, ...], tuple[int, ...]]] = []  # (nodes, GPUs on each node)
    if all(tp <= len(ids) for ids in picked.values()):
        for node in nodes:
            ids = picked[node.name]
            if len(ids) % tp:
                raise UsageError("--tp", tp, f"does not divide the {len(ids)} GPU(s) selected on {node.name} "
                                 f"({','.join(map(str, ids))}) into whole groups")
            groups += [((node.name,), ids[i:i + tp]) for i in range(0, len(ids), tp)]
    else:
        groups = _whole_node_groups(nodes, picked, tp)
    address = {n.name: n.address for n in nodes}
    ports = instance_ports(len(groups), base_port, reserved_ports)
    return Plan(tuple(InstancePlan(str(i), ids * len(names), ports[i], address[names[0]], nodes=names)
                      for i, (names, ids) in enumerate(groups)))


def _whole_node_groups(nodes: tuple[NodeInfo, ...], picked: dict[str, tuple[int, ...]],
                       tp: int) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
    sizes = {len(ids) for ids in picked.values()}
    if len(sizes) != 1:
        raise UsageError("--tp", tp, "a group larger than a node takes whole nodes, but the nodes hold "
                         "different numbers of GPUs (" + ", ".join(f"{n}: {len(i)}" for n, i in picked.items()) + ")")
    per_node = sizes.pop()
    if tp % per_node:
        raise UsageError("--tp", tp, f"a group larger than a node takes whole nodes: must be a multiple of "
                         f"the {per_node} GPU(s) selected per node")
    span = tp // per_node
    if len(nodes) % span:
        raise UsageError("--tp", tp, f"takes {span} whole nodes per group; the allocation's {len(nodes)} "
                         "nodes do not divide into such groups")
    if len({picked[n.name] for n in nodes}) != 1:
        raise UsageError("--gpus", ",".join(map(str, picked[nodes[0].name])), "a group across nodes needs "
                         "the same GPU indices on each of them")
    return [(tuple(n.name for n in nodes[i:i + span]), picked[nodes[i].name])
            for i in range(0, len(nodes), span)]


def step_cpus(plan: Plan, nodes: tuple[NodeInfo, ...]) -> dict[str, int]:
    """CPUs per task of each instance's step: the node's CPUs shared by the ranks placed there.

    Without it every step gets Slurm's default of one CPU, and where the cluster confines
    steps to their CPUs (task/cgroup) all ranks and Python stubs of a group share one core.
    """
    cpus = {n.name: n.cpus for n in nodes}
    ranks_on: dict[str, int] = {}
    for inst in plan.instances:
        for name in inst.nodes:
            ranks_on[name] = ranks_on.get(name, 0) + (1 if len(inst.nodes) == 1 else inst.gpus_per_node)
    out = {}
    for inst in plan.instances:
        share = min(max(1, cpus[name] // ranks_on[name]) for name in inst.nodes)
        out[inst.instance_id] = share
    return out
