"""Placement by topology: recorded machines' topologies (tests/data/topo-*.json), the
grouping search, the plan's link facts and warnings, and the NVML reader against a fake NVML."""

import itertools
import json
import random
from pathlib import Path

import pytest

from orchestrator import cli
from orchestrator.errors import UsageError
from orchestrator.plan import make_plan
from orchestrator.topology import (GpuTopo, RankAffinity, Topology, format_ids, group_gpus, group_link, link_rank,
                                   load_topology, parse_ids, rank_affinity, read_topology)

pytestmark = pytest.mark.unit

DATA = Path(__file__).parent / "data"
PCIE8 = DATA / "topo-pcie8-2socket.json"  # 2 sockets; per socket two PCIe switches of two GPUs
HGX8 = DATA / "topo-hgx8-nvswitch.json"  # every pair NV18 through NVSwitch; GPUs 0-3 socket 0
PAIRS4 = DATA / "topo-4gpu-nvlink-pairs.json"  # NVLink bridges 0-2 and 1-3; PCIe switches {0,1}, {2,3}
H200X2 = DATA / "topo-h200x2-nvlink.json"  # recorded on the lent 2 x H200 machine


def topo(path):
    return load_topology(str(path))


@pytest.mark.parametrize("path", sorted(DATA.glob("topo-*.json")))
def test_fixtures_load_and_round_trip(path):
    t = topo(path)
    assert Topology.from_dict(json.loads(json.dumps(t.to_dict()))) == t
    assert all(g.cpus and g.numa_nodes and g.socket is not None for g in t.gpus)


# --- grouping on recorded machines --------------------------------------------------------
@pytest.mark.parametrize("path,gpus,tp,groups", [
    # PCIe box: switch mates pair up whatever order --gpus gives; TP4 stays within a socket.
    (PCIE8, tuple(range(8)), 2, ((0, 1), (2, 3), (4, 5), (6, 7))),
    (PCIE8, (0, 4, 1, 5), 2, ((0, 1), (4, 5))),
    (PCIE8, (0, 2, 4, 6, 1, 3, 5, 7), 2, ((0, 1), (2, 3), (4, 5), (6, 7))),
    (PCIE8, (0, 4, 1, 5, 2, 6, 3, 7), 4, ((0, 1, 2, 3), (4, 5, 6, 7))),
    (PCIE8, (1, 2, 5, 6), 2, ((1, 2), (5, 6))),  # no switch mates: same socket (NODE) beats SYS
    # HGX: every link NV18, so the sockets decide, then the order given.
    (HGX8, tuple(range(8)), 2, ((0, 1), (2, 3), (4, 5), (6, 7))),
    (HGX8, (0, 4, 1, 5), 2, ((0, 1), (4, 5))),
    (HGX8, (3, 2, 1, 0), 2, ((3, 2), (1, 0))),
    (HGX8, tuple(range(8)), 4, ((0, 1, 2, 3), (4, 5, 6, 7))),
    # NVLink pairs 0-2 and 1-3: the bridge beats the shared PCIe switch.
    (PAIRS4, (0, 1, 2, 3), 2, ((0, 2), (1, 3))),
    (PAIRS4, (0, 1, 2), 1, ((0,), (1,), (2,))),
    (H200X2, (0, 1), 2, ((0, 1),)),
    (H200X2, (1, 0), 1, ((1,), (0,))),
])
def test_group_gpus_on_recorded_machines(path, gpus, tp, groups):
    assert group_gpus(topo(path), gpus, tp) == groups


def test_plan_shows_link_and_warns_only_when_gpu_traffic_crosses_sockets():
    pcie = topo(PCIE8)
    ordered = make_plan((0, 4, 1, 5), 2, 8000, "127.0.0.1", topology=pcie, placement="ordered")
    assert ordered.placement == "ordered" and [i.gpus for i in ordered.instances] == [(0, 4), (1, 5)]
    first = ordered.instances[0]
    assert (first.link, first.link_text, first.sockets, first.crosses_sockets) == \
        ("SYS", "SYS: across CPU sockets", (0, 1), True)
    assert first.warnings() == ("GPUs 0,4 span CPU sockets 0,1: every collective crosses the inter-socket "
                                "link (SYS)",)
    placed = make_plan((0, 4, 1, 5), 2, 8000, "127.0.0.1", topology=pcie, placement="topology")
    assert placed.placement == "topology"
    assert [(i.gpus, i.link, i.warnings()) for i in placed.instances] == [((0, 1), "PIX", ()), ((4, 5), "PIX", ())]
    assert placed.instances[0].link_text == "PIX: one PCIe switch"
    # TP8 on the PCIe box crosses sockets over PCIe: warned. On HGX over NVSwitch: not.
    assert make_plan(tuple(range(8)), 8, 8000, "127.0.0.1", topology=pcie).instances[0].warnings()
    hgx8 = make_plan(tuple(range(8)), 8, 8000, "127.0.0.1", topology=topo(HGX8)).instances[0]
    assert (hgx8.link_text, hgx8.crosses_sockets, hgx8.warnings()) == ("NV18 via NVSwitch", True, ())
    pairs = make_plan((0, 1, 2, 3), 2, 8000, "127.0.0.1", topology=topo(PAIRS4), placement="topology")
    assert [(i.gpus, i.link_text) for i in pairs.instances] == \
        [((0, 2), "NV12 via NVLink"), ((1, 3), "NV12 via NVLink")]


def test_plan_without_topology_is_ordered_and_says_nothing():
    plan = make_plan((2, 0, 3, 1), 2, 8000, "127.0.0.1", placement="topology")
    assert plan.placement == "ordered" and [i.gpus for i in plan.instances] == [(2, 0), (3, 1)]
    assert all((i.link, i.sockets, i.affinity, i.warnings()) == ("", (), (), ()) for i in plan.instances)


def test_plan_carries_per_rank_affinity_in_rank_order():
    t = topo(PCIE8)
    affinity = {g: rank_affinity(t.gpu(g), frozenset(range(128)), frozenset({0, 1})) for g in (0, 1, 4)}
    plan = make_plan((0, 1, 4, 5), 2, 8000, "127.0.0.1", topology=t, placement="topology", affinity=affinity)
    first, second = plan.instances
    assert [(a.gpu, a.cpu_list, a.mem_list) for a in first.affinity] == [(0, "0-31,64-95", "0"), (1, "0-31,64-95", "0")]
    # GPU 5 has no entry: its rank floats (empty CPUs), GPU 4's rank is still pinned.
    assert [(a.gpu, a.cpus) for a in second.affinity] == [(4, t.gpu(4).cpus), (5, ())]


def test_grouping_errors_name_field_and_value():
    with pytest.raises(UsageError, match=r"^--gpus='0,9': GPU 9 not in the topology$"):
        group_gpus(topo(PAIRS4), (0, 9), 2)
    with pytest.raises(UsageError, match="^--tp=3"):
        group_gpus(topo(PAIRS4), (0, 1, 2, 3), 3)


# --- the search is exact -----------------------------------------------------------------
def partitions(items, tp):
    if not items:
        yield ()
        return
    first, rest = items[0], items[1:]
    for others in itertools.combinations(rest, tp - 1):
        left = tuple(i for i in rest if i not in others)
        for tail in partitions(left, tp):
            yield ((first, *others), *tail)


def random_topology(rng, n):
    labels = ["NV4", "NV12", "PIX", "PXB", "PHB", "NODE", "SYS", "?"]
    links = [["X"] * n for _ in range(n)]
    for a, b in itertools.combinations(range(n), 2):
        links[a][b] = links[b][a] = rng.choice(labels)
    gpus = tuple(GpuTopo(i, socket=rng.randint(0, 1), numa_nodes=(rng.randint(0, 1),)) for i in range(n))
    return Topology(gpus, tuple(map(tuple, links)))


@pytest.mark.parametrize("seed", range(40))
def test_search_finds_the_partition_with_the_fewest_slow_links(seed):
    rng = random.Random(seed)
    n, tp = rng.choice([(4, 2), (6, 2), (6, 3), (8, 2), (8, 4)])
    t = random_topology(rng, n)
    gpus = tuple(rng.sample(range(n), n))

    def profile(groups):  # pair counts per link level, slowest level first
        ranks = [link_rank(t.link(a, b))[0] for g in groups for a, b in itertools.combinations(g, 2)]
        return tuple(sorted(ranks, reverse=True))

    chosen = group_gpus(t, gpus, tp)
    assert sorted(g for grp in chosen for g in grp) == list(range(n)) and all(len(g) == tp for g in chosen)
    assert profile(chosen) == min(profile(p) for p in partitions(gpus, tp))
    worst = max(link_rank(group_link(t, g)) for g in chosen)
    assert worst == min(max(link_rank(group_link(t, g)) for g in p) for p in partitions(gpus, tp))


def test_sixteen_gpus_are_quick():
    import time
    t = random_topology(random.Random(7), 16)
    start = time.monotonic()
    assert len(group_gpus(t, tuple(range(16)), 4)) == 4
    assert time.monotonic() - start < 5  # about 0.35 s on a shared CI core


# --- JSON and id lists -------------------------------------------------------------------------
@pytest.mark.parametrize("ids,text", [((), ""), ((3,), "3"), ((0, 1, 2, 3, 8), "0-3,8"),
                                      ((0, 2, 4), "0,2,4"), ((5, 6, 0, 1), "0-1,5-6")])
def test_id_lists(ids, text):
    assert format_ids(ids) == text and parse_ids(text) == tuple(sorted(ids))


@pytest.mark.parametrize("body,needle", [
    ('{"gpus": [{"index": 0}, {"index": 1}], "links": [["X", "NV2"]]}', "2x2 matrix"),
    ('{"gpus": [{"index": 0}, {"index": 1}], "links": [["X", "PIX"], ["SYS", "X"]]}', "differ by direction"),
    ('{"gpus": [{"index": 0}, {"index": 1}], "links": [["X", "QPI"], ["QPI", "X"]]}', "unknown link label 'QPI'"),
    ('{"links": []}', "not a topology JSON"),
    ("not json", "not a topology JSON"),
])
def test_bad_topology_file_is_one_line(tmp_path, body, needle):
    path = tmp_path / "t.json"
    path.write_text(body)
    with pytest.raises(UsageError) as err:
        load_topology(str(path))
    assert str(err.value).startswith(f"--topology={str(path)!r}: ") and needle in str(err.value)
    assert "\n" not in str(err.value) and err.value.exit_code == 2


def test_rank_affinity_keeps_only_what_this_process_may_use():
    gpu = GpuTopo(4, cpus=parse_ids("32-63,96-127"), numa_nodes=(1,), socket=1)
    assert rank_affinity(gpu, frozenset(range(128)), frozenset({0, 1})) == \
        RankAffinity(4, parse_ids("32-63,96-127"), (1,))
    narrowed = rank_affinity(gpu, frozenset(range(40, 50)), frozenset({0}))  # a container's cpuset
    assert (narrowed.cpu_list, narrowed.mems) == ("40-49", ())
    assert rank_affinity(gpu, frozenset(range(32)), frozenset({0, 1})) is None
    assert rank_affinity(GpuTopo(0), frozenset(range(8)), frozenset({0})) is None  # NVML said nothing


# --- `plan` through the CLI, from a recorded topology (no NVML, no process) ---------------------
def run_plan(capsys, *args):
    code = cli.main(["plan", "--model-repo", "/m", "--mpirun", "/nonexistent/mpirun",
                     "--tritonserver", "/nonexistent/tritonserver", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_plan_json_from_recorded_topology(capsys):
    code, out, _ = run_plan(capsys, "--topology", str(PCIE8), "--gpus", "0,4,1,5", "--tp", "2", "--json")
    assert code == 0
    plan = json.loads(out)
    assert plan["placement"] == "topology"
    first = plan["instances"][0]
    assert (first["gpus"], first["link"], first["warnings"]) == ([0, 1], "PIX", [])
    assert first["affinity"] == [{"rank": 0, "gpu": 0, "cpus": "0-31,64-95", "mems": "0"},
                                 {"rank": 1, "gpu": 1, "cpus": "0-31,64-95", "mems": "0"}]
    argv = first["argv"]
    assert "--physcpubind=0-31,64-95" in argv and "--membind=0" in argv


def test_cli_plan_text_ordered_warns_and_affinity_off(capsys):
    code, out, _ = run_plan(capsys, "--topology", str(PCIE8), "--gpus", "3,4", "--tp", "2", "--placement", "ordered",
                            "--cpu-affinity", "off")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("instance 0: GPUs 3,4 (TP2, SYS: across CPU sockets)  http 127.0.0.1:8000")
    assert lines[1] == "  warning: GPUs 3,4 span CPU sockets 0,1: every collective crosses the inter-socket link (SYS)"
    assert "numactl" not in out and "rank 0:" not in out and "placement: ordered" in lines


def test_cli_plan_text_shows_each_rank(capsys):
    code, out, _ = run_plan(capsys, "--topology", str(HGX8), "--gpus", "4-7", "--tp", "2")
    assert code == 0
    assert "instance 0: GPUs 4,5 (TP2, NV18 via NVSwitch)" in out
    assert "  rank 1: GPU 5, CPUs 56-111,168-223, memory node 1" in out
    assert "warning" not in out


@pytest.mark.parametrize("args,needle", [
    (["--placement", "best"], "--placement='best': must be one of topology, ordered"),
    (["--cpu-affinity", "on"], "--cpu-affinity='on': must be one of auto, off"),
    (["--topology", str(HGX8), "--assume-gpus", "8"], "use either it or --assume-gpus"),
    (["--topology", "/nonexistent.json"], "--topology='/nonexistent.json': file not found"),
    (["--topology", str(PAIRS4), "--gpus", "0-5"], "GPU 4,5 not on this host (it has GPUs 0-3)"),
])
def test_cli_bad_placement_input_is_one_line_exit_2(capsys, args, needle):
    code, out, err = run_plan(capsys, *args)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1 and not out


def test_assume_gpus_keeps_ordered_plan(capsys):
    code, out, _ = run_plan(capsys, "--assume-gpus", "4", "--gpus", "2,0,3,1", "--tp", "2", "--json")
    plan = json.loads(out)
    assert code == 0 and plan["placement"] == "ordered" and plan["notes"] == []
    assert [(i["gpus"], i["link"], i["affinity"]) for i in plan["instances"]] == [([2, 0], "", []), ([3, 1], "", [])]
    assert not any("numactl" in a or "taskset" in a for i in plan["instances"] for a in i["argv"])


def test_placement_fields_need_down_and_up_on_reload():
    from orchestrator.config import Settings, reload_changes
    for field, value in (("placement", "ordered"), ("cpu_affinity", "off"), ("topology", str(HGX8))):
        with pytest.raises(UsageError, match="needs `trtllm-orch down` and `up`"):
            reload_changes(Settings(), Settings(**{field: value}))


# --- the NVML reader against a fake NVML ----------------------------------------------------------
class NotSupported(Exception):
    pass


class FakeNvml:
    """Just the NVML calls read_topology makes, answering from a description of a machine."""
    NVML_NVLINK_MAX_LINKS = 18
    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_DEVICE_TYPE_GPU = 0
    NVML_NVLINK_DEVICE_TYPE_SWITCH = 2
    NVML_P2P_CAPS_INDEX_NVLINK = 2
    NVML_P2P_STATUS_OK = 0
    NVML_AFFINITY_SCOPE_NODE = 0

    class Pci:
        def __init__(self, domain, bus, device=0):
            self.domain, self.bus, self.device = domain, bus, device

    def __init__(self, gpus, ancestor=None, p2p=None, supported=True):
        self.gpus = gpus  # dicts: bus, cpus (set), nodes (set), links: list of ("gpu", i) | ("switch",)
        self.ancestor = ancestor
        self.p2p = p2p
        self.supported = supported
        self.inits = 0

    def nvmlInit(self):
        self.inits += 1

    def nvmlShutdown(self):
        self.inits -= 1

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return b"Fake GPU"

    def nvmlDeviceGetPciInfo(self, h):
        return self.Pci(0, self.gpus[h]["bus"])

    def nvmlDeviceGetCpuAffinity(self, h, words):
        if not self.supported:
            raise NotSupported()
        out = [0] * words
        for cpu in self.gpus[h]["cpus"]:
            out[cpu // 64] |= 1 << (cpu % 64)
        return out

    def nvmlDeviceGetMemoryAffinity(self, h, words, scope):
        if not self.supported or self.gpus[h].get("nodes") is None:
            raise NotSupported()
        return [sum(1 << n for n in self.gpus[h]["nodes"])]

    def _link(self, h, link):
        links = self.gpus[h].get("links", [])
        if link >= len(links):
            raise NotSupported()
        return links[link]

    def nvmlDeviceGetNvLinkState(self, h, link):
        self._link(h, link)
        return self.NVML_FEATURE_ENABLED

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h, link):
        return self.NVML_NVLINK_DEVICE_TYPE_SWITCH if self._link(h, link)[0] == "switch" else 0

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        kind, *peer = self._link(h, link)
        return self.Pci(0, self.gpus[peer[0]]["bus"]) if kind == "gpu" else self.Pci(0, 0xFF)

    def nvmlDeviceGetP2PStatus(self, a, b, index):
        if self.p2p is None:
            raise NotSupported()
        return self.p2p(a, b)

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        if self.ancestor is None:
            raise NotSupported()
        return self.ancestor(a, b)


def fake_sys(tmp_path, sockets):
    for cpu, socket in sockets.items():
        d = tmp_path / f"devices/system/cpu/cpu{cpu}/topology"
        d.mkdir(parents=True)
        (d / "physical_package_id").write_text(f"{socket}\n")
    return str(tmp_path)


def test_reader_nvlink_bridges_and_pcie_levels(tmp_path):
    # The 4-GPU box: 12 bridge links 0<->2 and 1<->3; switches {0,1} and {2,3} under one CPU.
    links = {0: [("gpu", 2)] * 12, 1: [("gpu", 3)] * 12, 2: [("gpu", 0)] * 12, 3: [("gpu", 1)] * 12}
    gpus = [{"bus": 0x17 + i, "cpus": set(range(32)), "nodes": {0}, "links": links[i]} for i in range(4)]
    nvml = FakeNvml(gpus, ancestor=lambda a, b: 10 if a // 2 == b // 2 else 40,
                    p2p=lambda a, b: 0 if {a, b} in ({0, 2}, {1, 3}) else 1)
    t = read_topology(nvml, fake_sys(tmp_path, {0: 0}))
    assert nvml.inits == 0  # shut down again
    assert t.to_dict()["links"] == json.loads(PAIRS4.read_text())["links"]
    assert [(g.cpus, g.numa_nodes, g.socket, g.nvswitch) for g in t.gpus] == [(tuple(range(32)), (0,), 0, False)] * 4
    assert group_gpus(t, (0, 1, 2, 3), 2) == ((0, 2), (1, 3))


def test_reader_nvswitch_board_and_cpu_bits_above_64(tmp_path):
    cpus = [set(range(0, 56)) | set(range(112, 168)), set(range(56, 112)) | set(range(168, 224))]
    gpus = [{"bus": 0x18 + i, "cpus": cpus[i // 4], "nodes": {i // 4}, "links": [("switch",)] * 18} for i in range(8)]
    t = read_topology(FakeNvml(gpus, ancestor=lambda a, b: 50 if a // 4 != b // 4 else 40, p2p=lambda a, b: 0),
                      fake_sys(tmp_path, {0: 0, 56: 1}))
    expected = topo(HGX8)
    assert t.links == expected.links
    assert [(g.cpus, g.numa_nodes, g.socket, g.nvswitch) for g in t.gpus] == \
        [(g.cpus, g.numa_nodes, g.socket, g.nvswitch) for g in expected.gpus]


def test_reader_switch_without_fabric_manager_is_not_nvlink(tmp_path):
    # NVSwitch links up but NVML's P2P says NVLink is unusable (no fabric manager): PCIe it is.
    gpus = [{"bus": i, "cpus": {0}, "nodes": {0}, "links": [("switch",)] * 18} for i in range(2)]
    t = read_topology(FakeNvml(gpus, ancestor=lambda a, b: 40, p2p=lambda a, b: 4), fake_sys(tmp_path, {0: 0}))
    assert t.link(0, 1) == "NODE"


def test_reader_degrades_to_cpu_side_facts(tmp_path):
    # A driver answering none of the topology calls: sockets and NUMA nodes decide, else "?".
    gpus = [{"bus": i, "cpus": {i}, "nodes": {i // 2}} for i in range(4)]
    t = read_topology(FakeNvml(gpus), fake_sys(tmp_path, {0: 0, 1: 0, 2: 1, 3: 1}))
    assert [t.link(0, b) for b in (1, 2, 3)] == ["NODE", "SYS", "SYS"]
    bare = read_topology(FakeNvml(gpus, supported=False), str(tmp_path / "nosys"))
    assert bare.link(0, 1) == "?" and bare.gpu(0).cpus == () and bare.gpu(0).socket is None
    assert group_gpus(bare, (2, 0, 3, 1), 2) == ((2, 0), (3, 1))  # nothing known: the order given


def test_reader_numa_node_from_sysfs_when_nvml_has_none(tmp_path):
    gpus = [{"bus": 0x3D, "cpus": {0}, "nodes": None}]
    dev = tmp_path / "bus/pci/devices/0000:3d:00.0"
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text("1\n")
    assert read_topology(FakeNvml(gpus), str(tmp_path)).gpu(0).numa_nodes == (1,)
    (dev / "numa_node").write_text("-1\n")  # what the lent H200 VM says: unknown
    assert read_topology(FakeNvml(gpus), str(tmp_path)).gpu(0).numa_nodes == ()
