"""How the host's GPUs are wired, and TP groups chosen by it.

Two halves, kept apart so the grouping can be tested on machines we do not have:
- `Topology` holds per-GPU facts (local CPUs, NUMA nodes, CPU socket, NVSwitch) and the
  pairwise link between GPUs, labelled as `nvidia-smi topo -m` labels them. It is read
  from NVML by `read_topology` (the only function here that touches the host), and
  saved to / loaded from JSON (`python -m orchestrator.topology` records this host).
- `group_gpus` and `rank_affinity` are pure functions of a Topology.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from functools import lru_cache
from itertools import combinations
from pathlib import Path
from typing import Any

from orchestrator.errors import UsageError

# PCIe distances from near to far, as nvidia-smi names them: one PCIe switch, several
# switches, the CPU's host bridge, host bridges of one NUMA node, across sockets.
PCIE_LEVELS = ("PIX", "PXB", "PHB", "NODE", "SYS")
UNKNOWN = "?"
LINK_TEXT = {"PIX": "one PCIe switch", "PXB": "PCIe switches", "PHB": "PCIe host bridge",
             "NODE": "same NUMA node, across host bridges", "SYS": "across CPU sockets",
             UNKNOWN: "unknown link"}


def link_rank(label: str) -> tuple[int, int]:
    """Sort key, best first: NVLink (more links first), then PCIe near to far, then unknown."""
    if label.startswith("NV") and label[2:].isdigit():
        return (0, -int(label[2:]))
    if label in PCIE_LEVELS:
        return (1 + PCIE_LEVELS.index(label), 0)
    return (1 + len(PCIE_LEVELS), 0)


def _check_label(label: str) -> str:
    if label != UNKNOWN and link_rank(label)[0] == 1 + len(PCIE_LEVELS):
        raise ValueError(f"unknown link label {label!r} (NV<n>, {', '.join(PCIE_LEVELS)} or ?)")
    return label


def format_ids(ids) -> str:
    """(0,1,2,3,8) -> '0-3,8': the list form numactl, taskset and /proc use."""
    out: list[str] = []
    items = sorted(set(ids))
    start = prev = None
    for i in items + [None]:
        if prev is not None and i == prev + 1:
            prev = i
            continue
        if start is not None:
            out.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = i
    return ",".join(out)


def parse_ids(text: str) -> tuple[int, ...]:
    """'0-3,8' -> (0,1,2,3,8); '' -> ()."""
    out: list[int] = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(sorted(set(out)))


@dataclass(frozen=True)
class GpuTopo:
    index: int
    pci_bus_id: str = ""
    cpus: tuple[int, ...] = ()  # CPUs local to the GPU (NVML's ideal affinity); () unknown
    numa_nodes: tuple[int, ...] = ()  # memory nodes local to it; () unknown
    socket: int | None = None  # CPU package of those CPUs
    nvswitch: bool = False  # its NVLinks go to NVSwitches (HGX), not to one peer
    name: str = ""


@dataclass(frozen=True)
class Topology:
    gpus: tuple[GpuTopo, ...]
    links: tuple[tuple[str, ...], ...]  # links[a][b] for positions in `gpus`; "X" on the diagonal
    source: str = ""

    def __post_init__(self) -> None:
        n = len(self.gpus)
        if len(self.links) != n or any(len(row) != n for row in self.links):
            raise ValueError(f"links must be a {n}x{n} matrix, one row and column per GPU")
        for a in range(n):
            for b in range(n):
                if a != b:
                    _check_label(self.links[a][b])
                    if self.links[a][b] != self.links[b][a]:
                        raise ValueError(f"links between GPU {self.gpus[a].index} and "
                                         f"{self.gpus[b].index} differ by direction")

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(g.index for g in self.gpus)

    def gpu(self, index: int) -> GpuTopo:
        return self.gpus[self._position(index)]

    def link(self, a: int, b: int) -> str:
        return self.links[self._position(a)][self._position(b)]

    def _position(self, index: int) -> int:
        for pos, g in enumerate(self.gpus):
            if g.index == index:
                return pos
        raise KeyError(index)

    # --- JSON: the same shape `python -m orchestrator.topology` records ----------------
    def to_dict(self) -> dict[str, Any]:
        gpus = [{"index": g.index, "name": g.name, "pci_bus_id": g.pci_bus_id, "cpus": format_ids(g.cpus),
                 "numa_nodes": list(g.numa_nodes), "socket": g.socket, "nvswitch": g.nvswitch}
                for g in self.gpus]
        return {"source": self.source, "gpus": gpus, "links": [list(row) for row in self.links]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Topology":
        gpus = tuple(GpuTopo(index=int(g["index"]), pci_bus_id=g.get("pci_bus_id", ""),
                             cpus=parse_ids(g.get("cpus", "")), numa_nodes=tuple(g.get("numa_nodes", ())),
                             socket=g.get("socket"), nvswitch=bool(g.get("nvswitch", False)),
                             name=g.get("name", ""))
                     for g in data["gpus"])
        return cls(gpus, tuple(tuple(row) for row in data["links"]), data.get("source", ""))


def load_topology(path: str) -> Topology:
    """A recorded topology (--topology FILE); UsageError naming the file when it is unreadable."""
    try:
        return Topology.from_dict(json.loads(Path(path).read_text()))
    except FileNotFoundError:
        raise UsageError("--topology", path, "file not found") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError("--topology", path, f"not a topology JSON: {exc}") from None


# --- grouping (pure) -------------------------------------------------------------------
def group_link(topology: Topology, group: tuple[int, ...]) -> str:
    """The group's slowest link: the one its collectives wait for. '' for one GPU."""
    labels = [topology.link(a, b) for a, b in combinations(group, 2)]
    return max(labels, key=link_rank) if labels else ""


def describe_link(topology: Topology, group: tuple[int, ...]) -> str:
    label = group_link(topology, group)
    if not label:
        return ""
    if label.startswith("NV"):
        return f"{label} via " + ("NVSwitch" if all(topology.gpu(g).nvswitch for g in group) else "NVLink")
    return f"{label}: {LINK_TEXT[label]}"


def group_sockets(topology: Topology, group: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(sorted({s for s in (topology.gpu(g).socket for g in group) if s is not None}))


def crosses_sockets(topology: Topology, group: tuple[int, ...]) -> bool:
    # Without socket facts, a SYS link is the same statement: traffic crosses the CPU interconnect.
    return len(group_sockets(topology, group)) > 1 or group_link(topology, group) == "SYS"


def group_gpus(topology: Topology, gpus: tuple[int, ...], tp: int) -> tuple[tuple[int, ...], ...]:
    """Split `gpus` into groups of `tp` whose links are as fast as can be.

    A partition's cost counts its intra-group GPU pairs per link level, compared from the
    slowest level down: one fewer cross-socket pair beats any number of NODE pairs, and so
    on down to NVLink pairs, then fewer NVLink links; last, pairs whose GPUs sit on other
    sockets or NUMA nodes (on an NVSwitch board every pair is NV18, but a group within one
    socket keeps its ranks' CPUs together). Exact: a search over partitions, memoised by
    the GPUs left, quick for the 8-16 GPUs of a node. Ties keep the order of `gpus`.
    """
    missing = [g for g in gpus if g not in topology.indices]
    if missing:
        raise UsageError("--gpus", ",".join(map(str, gpus)),
                         f"GPU {','.join(map(str, missing))} not in the topology")
    if tp < 1 or len(gpus) % tp:
        raise UsageError("--tp", tp, f"does not divide the {len(gpus)} GPU(s) selected into whole groups")
    if tp == 1 or len(gpus) == tp:
        return tuple(tuple(gpus[i:i + tp]) for i in range(0, len(gpus), tp))
    costs = {(a, b): _pair_cost(topology, gpus[a], gpus[b]) for a, b in combinations(range(len(gpus)), 2)}

    @lru_cache(maxsize=None)
    def best(left: tuple[int, ...]) -> tuple[int, tuple[tuple[int, ...], ...]]:
        if not left:
            return 0, ()
        first, rest = left[0], left[1:]
        found = None
        for others in combinations(rest, tp - 1):
            group = (first, *others)
            sub_cost, sub_groups = best(tuple(p for p in rest if p not in others))
            total = sub_cost + sum(costs[pair] for pair in combinations(group, 2))
            if found is None or total < found[0]:
                found = (total, (group, *sub_groups))
        assert found is not None
        return found

    return tuple(tuple(gpus[p] for p in group) for group in best(tuple(range(len(gpus))))[1])


# A pair's cost is a vector compared from its first digit, packed into one int so that
# a partition's cost is a plain sum: [unknown, SYS, NODE, PHB, PXB, PIX, NVLink] pair
# counts, NVLink links missing (of 36, NVML's most), other socket, other NUMA node. Each
# digit of a sum stays below 2**16 (at most 120 pairs in 16 GPUs, 36 links each).
_DIGIT = 1 << 16
_DIGITS = 2 + len(PCIE_LEVELS) + 3
_MAX_NVLINKS = 36


def _pair_cost(topology: Topology, a: int, b: int) -> int:
    ga, gb = topology.gpu(a), topology.gpu(b)
    level, fewer_links = link_rank(topology.link(a, b))
    digits = [0] * _DIGITS
    digits[1 + len(PCIE_LEVELS) - level] = 1  # the slowest level is the first digit
    if level == 0:
        digits[-3] = _MAX_NVLINKS + fewer_links  # fewer_links is -n for NVn
    digits[-2] = int(None not in (ga.socket, gb.socket) and ga.socket != gb.socket)
    digits[-1] = int(bool(ga.numa_nodes and gb.numa_nodes and not set(ga.numa_nodes) & set(gb.numa_nodes)))
    value = 0
    for digit in digits:
        value = value * _DIGIT + digit
    return value


@dataclass(frozen=True)
class RankAffinity:
    """Where one rank may run: the CPUs and memory nodes local to its GPU."""
    gpu: int
    cpus: tuple[int, ...]
    mems: tuple[int, ...] = ()  # () leaves memory placement to the kernel

    @property
    def cpu_list(self) -> str:
        return format_ids(self.cpus)

    @property
    def mem_list(self) -> str:
        return format_ids(self.mems)


def rank_affinity(gpu: GpuTopo, allowed_cpus: frozenset[int],
                  allowed_mems: frozenset[int]) -> RankAffinity | None:
    """The GPU's local CPUs and memory nodes that this process may use (a container's cpuset
    is often narrower than the host: numactl refuses CPUs outside it). None when nothing
    local is allowed, so the rank floats as before rather than failing to start."""
    cpus = tuple(sorted(set(gpu.cpus) & allowed_cpus))
    if not cpus:
        return None
    return RankAffinity(gpu.index, cpus, tuple(sorted(set(gpu.numa_nodes) & allowed_mems)))


# --- reading the host (NVML) ---------------------------------------------------------------
def host_topology() -> tuple[Topology | None, str]:
    """This host's topology, or None and a note saying why not. Placement and pinning are
    optimisations: once the GPU inventory was read, a topology NVML cannot give (a driver
    without the calls, a sandbox) must not stop `up`, so any failure here becomes a note."""
    try:
        return read_topology(), ""
    except Exception as exc:  # NVMLError, ImportError, OSError from sysfs: all mean "not known"
        return None, (f"GPU topology unreadable ({type(exc).__name__}: {exc}): GPUs grouped in --gpus order, "
                      "ranks not pinned")


def read_topology(nvml: Any = None, sys_root: str = "/sys") -> Topology:
    """This host's topology from NVML (and sysfs for the CPU socket).

    A call the driver does not support (containers, gVisor, older GPUs) leaves that fact
    unknown instead of failing: placement then falls back to NUMA/socket facts or order.
    Raises whatever nvmlInit raises when NVML is unusable.
    """
    if nvml is None:
        import pynvml
        nvml = pynvml
    nvml.nvmlInit()
    try:
        return _read(nvml, Path(sys_root))
    finally:
        nvml.nvmlShutdown()


def _try(fn, *args, default=None):
    try:
        return fn(*args)
    except Exception:  # NVMLError_NotSupported & co: the fact stays unknown
        return default


def _bits(words) -> tuple[int, ...]:
    return tuple(w * 64 + bit for w, word in enumerate(words) for bit in range(64) if int(word) >> bit & 1)


def _pci_key(info) -> tuple[int, int, int]:
    return (int(info.domain), int(info.bus), int(info.device))


def _read(nvml: Any, sys_root: Path) -> Topology:
    count = nvml.nvmlDeviceGetCount()
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    # Room for CPU numbers beyond os.cpu_count() (offline CPUs, sparse numbering): 4096 at least.
    cpu_words = max(64, ((os.cpu_count() or 1) + 63) // 64)
    keys, gpus, peer_links, switch_links = [], [], [], []
    for i, h in enumerate(handles):
        pci = nvml.nvmlDeviceGetPciInfo(h)
        keys.append(_pci_key(pci))
        bus_id = f"{pci.domain:04x}:{pci.bus:02x}:{pci.device:02x}.0"
        cpus = _bits(_try(nvml.nvmlDeviceGetCpuAffinity, h, cpu_words, default=()))
        nodes = _bits(_try(nvml.nvmlDeviceGetMemoryAffinity, h, 1, nvml.NVML_AFFINITY_SCOPE_NODE, default=()))
        if not nodes:
            nodes = _sysfs_numa_node(sys_root, bus_id)
        remotes, to_switch = [], 0
        for link in range(nvml.NVML_NVLINK_MAX_LINKS):
            if _try(nvml.nvmlDeviceGetNvLinkState, h, link) != nvml.NVML_FEATURE_ENABLED:
                continue
            if _try(nvml.nvmlDeviceGetNvLinkRemoteDeviceType, h, link) == nvml.NVML_NVLINK_DEVICE_TYPE_SWITCH:
                to_switch += 1
            else:
                remote = _try(nvml.nvmlDeviceGetNvLinkRemotePciInfo, h, link)
                if remote is not None:
                    remotes.append(_pci_key(remote))
        peer_links.append(remotes)
        switch_links.append(to_switch)
        name = _try(nvml.nvmlDeviceGetName, h, default="")
        gpus.append(GpuTopo(i, bus_id, cpus, nodes, _sysfs_socket(sys_root, cpus), to_switch > 0,
                            name.decode() if isinstance(name, bytes) else name))
    links = [["X"] * count for _ in range(count)]
    for a, b in combinations(range(count), 2):
        links[a][b] = links[b][a] = _pair_label(nvml, handles, gpus, keys, peer_links, switch_links, a, b)
    return Topology(tuple(gpus), tuple(tuple(r) for r in links), f"NVML on {os.uname().nodename}")


# NVML's common-ancestor levels, named as nvidia-smi names them (INTERNAL: two GPUs on one board).
_ANCESTOR = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


def _pair_label(nvml, handles, gpus, keys, peer_links, switch_links, a: int, b: int) -> str:
    direct = max(peer_links[a].count(keys[b]), peer_links[b].count(keys[a]))
    if direct:
        return f"NV{direct}"
    # Through NVSwitches: NVML's P2P answer when it has one (without the fabric manager
    # the switches carry nothing, and it says so), else both GPUs having switch links.
    p2p = _try(nvml.nvmlDeviceGetP2PStatus, handles[a], handles[b], nvml.NVML_P2P_CAPS_INDEX_NVLINK)
    if p2p == nvml.NVML_P2P_STATUS_OK or (p2p is None and switch_links[a] and switch_links[b]):
        links = min(switch_links[a], switch_links[b]) or \
            min(len(peer_links[a]) + switch_links[a], len(peer_links[b]) + switch_links[b])
        return f"NV{max(1, links)}"
    level = _try(nvml.nvmlDeviceGetTopologyCommonAncestor, handles[a], handles[b])
    if level in _ANCESTOR:
        return _ANCESTOR[level]
    ga, gb = gpus[a], gpus[b]  # no PCIe answer: what the CPU side tells us
    if ga.socket is not None and gb.socket is not None and ga.socket != gb.socket:
        return "SYS"
    if ga.numa_nodes and gb.numa_nodes:
        return "NODE" if set(ga.numa_nodes) & set(gb.numa_nodes) else "SYS"
    return UNKNOWN


def _sysfs_numa_node(sys_root: Path, bus_id: str) -> tuple[int, ...]:
    try:
        node = int((sys_root / "bus/pci/devices" / bus_id / "numa_node").read_text())
    except (OSError, ValueError):
        return ()
    return (node,) if node >= 0 else ()  # -1: the platform does not say


def _sysfs_socket(sys_root: Path, cpus: tuple[int, ...]) -> int | None:
    if not cpus:
        return None
    try:
        return int((sys_root / f"devices/system/cpu/cpu{cpus[0]}/topology/physical_package_id").read_text())
    except (OSError, ValueError):
        return None


def main() -> int:
    """Record this host's topology as JSON, for `--topology FILE` and the tests' fixtures."""
    try:
        topology = read_topology()
    except Exception as exc:  # one line, as every other error of ours, not a traceback
        print(f"orchestrator.topology: NVML unusable ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    json.dump(topology.to_dict(), sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
