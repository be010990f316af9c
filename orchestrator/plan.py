"""The plan: which GPUs and ports each instance gets. Pure: no processes, no sockets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from orchestrator.errors import UsageError
from orchestrator.topology import (RankAffinity, Topology, crosses_sockets, describe_link, group_gpus, group_link,
                                   group_sockets)

PORTS_PER_INSTANCE = 3  # http, grpc, metrics


@dataclass(frozen=True)
class Ports:
    http: int
    grpc: int
    metrics: int

    def all(self) -> tuple[int, int, int]:
        return (self.http, self.grpc, self.metrics)


@dataclass(frozen=True)
class InstancePlan:
    instance_id: str
    gpus: tuple[int, ...]
    ports: Ports
    bind_address: str
    # What the topology says about the group ("" / () when it is not known, e.g. --assume-gpus):
    link: str = ""  # its slowest GPU-to-GPU link, as nvidia-smi topo -m names it (NV18, PIX, SYS)
    link_text: str = ""  # the same for people: "NV18 via NVSwitch", "SYS: across CPU sockets"
    sockets: tuple[int, ...] = ()  # CPU sockets its GPUs hang off
    crosses_sockets: bool = False  # its GPUs hang off more than one socket (warnings() says when it matters)
    affinity: tuple[RankAffinity, ...] = ()  # per rank; () leaves ranks floating over all CPUs
    # Under Slurm: the node(s) it runs on, each with the same `gpus_per_node` GPUs (a group
    # larger than a node takes whole nodes). () for the local launcher: this host.
    nodes: tuple[str, ...] = ()

    @property
    def tp(self) -> int:
        return len(self.gpus)

    @property
    def cuda_visible_devices(self) -> str:
        # Per node: a group across N nodes lists each node's GPUs once per node.
        return ",".join(map(str, self.gpus[:self.gpus_per_node]))

    @property
    def gpus_per_node(self) -> int:
        return len(self.gpus) // max(1, len(self.nodes))

    def warnings(self) -> tuple[str, ...]:
        # Only when the GPU traffic itself crosses sockets: an NVLink/NVSwitch group spanning
        # both (TP8 on an HGX board) is the fastest there is, and its ranks are pinned apart.
        if not self.crosses_sockets or self.link.startswith("NV"):
            return ()
        where = f"CPU sockets {','.join(map(str, self.sockets))}" if len(self.sockets) > 1 else "CPU sockets"
        return (f"GPUs {self.cuda_visible_devices} span {where}: every collective crosses the "
                f"inter-socket link ({self.link})",)


@dataclass(frozen=True)
class Plan:
    instances: tuple[InstancePlan, ...]
    placement: str = "ordered"  # how the groups were chosen: "topology" or "ordered"


def make_plan(gpus: tuple[int, ...], tp: int, base_port: int, bind_address: str,
              reserved_ports: tuple[int, ...] = (), topology: Topology | None = None,
              placement: str = "ordered", affinity: Mapping[int, RankAffinity] | None = None) -> Plan:
    """Split GPUs into groups of `tp`; one instance per group.

    With a `topology` and placement "topology", groups follow the interconnect
    (topology.group_gpus); otherwise GPUs are taken in the order given. `affinity` maps a
    GPU to where its rank should run (GPUs without an entry leave their rank floating).
    Instance i gets ports base+3i (http), base+3i+1 (grpc), base+3i+2 (metrics);
    ports the load balancer listens on are skipped so nothing overlaps.
    """
    if tp < 1:
        raise UsageError("--tp", tp, "must be at least 1")
    if not gpus:
        raise UsageError("--gpus", "", "empty GPU list")
    if len(gpus) % tp:
        raise UsageError("--tp", tp, f"does not divide the {len(gpus)} GPU(s) selected "
                         f"({','.join(map(str, gpus))}) into whole groups")
    if topology is not None and placement == "topology":
        groups = group_gpus(topology, gpus, tp)
    else:
        placement = "ordered"
        groups = tuple(tuple(gpus[i:i + tp]) for i in range(0, len(gpus), tp))
    affinity = affinity or {}
    instances = []
    ports = instance_ports(len(gpus) // tp, base_port, reserved_ports)
    for index, picked in enumerate(ports):
        group = groups[index]
        facts: dict = {}
        if topology is not None:
            facts = dict(link=group_link(topology, group), link_text=describe_link(topology, group),
                         sockets=group_sockets(topology, group), crosses_sockets=crosses_sockets(topology, group))
        # A rank whose GPU has no entry gets an empty one (it floats); ranks keep their index.
        pinned = tuple(affinity.get(g, RankAffinity(g, ())) for g in group) if set(group) & set(affinity) else ()
        instances.append(InstancePlan(str(index), group, picked, bind_address, **facts, affinity=pinned))
    return Plan(tuple(instances), placement)


def instance_ports(count: int, base_port: int, reserved_ports: tuple[int, ...] = ()) -> list[Ports]:
    """Instance i gets base+3i .. base+3i+2, skipping the load balancer's own ports."""
    out = []
    port = base_port
    for _ in range(count):
        picked: list[int] = []
        while len(picked) < PORTS_PER_INSTANCE:
            if port > 65535:
                raise UsageError("--base-port", base_port, f"not enough ports above it for {count} instance(s)")
            if port not in reserved_ports:
                picked.append(port)
            port += 1
        out.append(Ports(*picked))
    return out
