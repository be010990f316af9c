"""The plan: which GPUs and ports each instance gets. Pure: no processes, no sockets."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import UsageError

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

    @property
    def tp(self) -> int:
        return len(self.gpus)

    @property
    def cuda_visible_devices(self) -> str:
        return ",".join(map(str, self.gpus))


@dataclass(frozen=True)
class Plan:
    instances: tuple[InstancePlan, ...]


def make_plan(gpus: tuple[int, ...], tp: int, base_port: int, bind_address: str,
              reserved_ports: tuple[int, ...] = ()) -> Plan:
    """Split GPUs, in the order given, into groups of `tp`; one instance per group.

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
    instances = []
    port = base_port
    for index in range(len(gpus) // tp):
        picked: list[int] = []
        while len(picked) < PORTS_PER_INSTANCE:
            if port > 65535:
                raise UsageError("--base-port", base_port, f"not enough ports above it for "
                                 f"{len(gpus) // tp} instance(s)")
            if port not in reserved_ports:
                picked.append(port)
            port += 1
        instances.append(InstancePlan(str(index), tuple(gpus[index * tp:(index + 1) * tp]),
                                      Ports(*picked), bind_address))
    return Plan(tuple(instances))
