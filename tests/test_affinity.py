"""CPU and memory affinity: the per-rank wrapper built from a recorded topology, the choice
of numactl/taskset, and the /proc check scripts/gpu-acceptance uses on a running instance."""

import os
import subprocess
from pathlib import Path

import pytest

from orchestrator.launcher import affinity as aff_mod
from orchestrator.launcher.affinity import (Pinner, RankCheck, check_rank_affinity, choose_pinner, plan_affinity,
                                            process_allowed, rank_of)
from orchestrator.launcher.command import build_launch
from orchestrator.launcher.mpi import MpiFlavour
from orchestrator.plan import make_plan
from orchestrator.topology import RankAffinity, format_ids, load_topology
from tests.test_plan import app_contexts as contexts

pytestmark = pytest.mark.unit

DATA = Path(__file__).parent / "data"
PCIE8 = load_topology(str(DATA / "topo-pcie8-2socket.json"))
NUMACTL = Pinner("numactl", "/usr/bin/numactl")
TASKSET = Pinner("taskset", "/usr/bin/taskset")
SETPRIV = ("/usr/bin/setpriv", "--pdeathsig", "KILL", "--")
ALL_HOST = (frozenset(range(128)), frozenset({0, 1}))


def launch_from_pcie8(gpus, pinner, monkeypatch, allowed=ALL_HOST):
    monkeypatch.setattr(aff_mod, "process_allowed", lambda *a, **k: allowed)
    affinity, _, _ = plan_affinity(PCIE8, gpus, "auto", host_checks=False)
    plan = make_plan(gpus, 2, 9000, "127.0.0.1", topology=PCIE8, placement="ordered", affinity=affinity)
    return [build_launch(inst, mpi=MpiFlavour("openmpi", "5.0", "/usr/bin/mpirun"), tritonserver="/opt/ts",
                         model_repo="/m", llm_models=("tensorrt_llm",), extra_args=(), state_dir="/run/x",
                         group_dir=f"/run/x/instances/{inst.instance_id}", as_root=True, rank_wrapper=SETPRIV,
                         pinner=pinner) for inst in plan.instances]


def test_each_rank_runs_on_its_gpus_socket_under_bind_to_none(monkeypatch):
    cmds = launch_from_pcie8((0, 4, 5, 1), NUMACTL, monkeypatch)
    want = {0: ("0-31,64-95", "0"), 1: ("0-31,64-95", "0"), 4: ("32-63,96-127", "1"), 5: ("32-63,96-127", "1")}
    for cmd, gpus in zip(cmds, ((0, 4), (5, 1))):
        head = contexts(cmd.argv)[0]
        assert head[head.index("--bind-to") + 1] == "none"  # mpirun binds nothing; the wrapper does
        for ctx, gpu in zip(contexts(cmd.argv), gpus):
            rank = ctx[ctx.index("-n"):]
            cpus, node = want[gpu]
            assert rank == ["-n", "1", *SETPRIV, "/usr/bin/numactl", f"--physcpubind={cpus}", f"--membind={node}",
                            "--", "/opt/ts", *rank[11:]]
            assert rank[11].startswith("--model-repository=")


def test_taskset_pins_cpus_only(monkeypatch):
    cmd = launch_from_pcie8((4, 5), TASKSET, monkeypatch)[0]
    for ctx in contexts(cmd.argv):
        rank = ctx[ctx.index("-n"):]
        assert rank[2:10] == [*SETPRIV, "/usr/bin/taskset", "-c", "32-63,96-127", "/opt/ts"]


def test_no_pinner_or_affinity_off_leaves_command_as_before(monkeypatch):
    plain = launch_from_pcie8((0, 1), None, monkeypatch)[0]
    assert not any("numactl" in a or "taskset" in a for a in plain.argv)
    assert plan_affinity(PCIE8, (0, 1), "off") == ({}, None, [])
    assert plan_affinity(None, (0, 1), "auto") == ({}, None, [])


def test_container_cpuset_narrows_the_binding(monkeypatch):
    # This process may use CPUs 8-15 and node 0 only: GPU 4's CPUs are all outside, so it floats.
    monkeypatch.setattr(aff_mod, "process_allowed", lambda *a, **k: (frozenset(range(8, 16)), frozenset({0})))
    ran = []
    affinity, pinner, notes = plan_affinity(PCIE8, (0, 4), "auto", which=lambda n: f"/usr/bin/{n}",
                                            run=ok(ran))
    assert affinity == {0: RankAffinity(0, tuple(range(8, 16)), (0,))} and pinner == NUMACTL
    assert notes == ["GPU 4: no local CPUs known that this process may use; its rank floats over all CPUs"]
    assert ran == [["/usr/bin/numactl", "--physcpubind=8-15", "--membind=0", "--", "/usr/bin/true"]]
    plan = make_plan((0, 4), 2, 9000, "127.0.0.1", topology=PCIE8, affinity=affinity)
    assert [a.cpus for a in plan.instances[0].affinity] == [tuple(range(8, 16)), ()]
    assert NUMACTL.argv(plan.instances[0].affinity[1]) == ()


def ok(record):
    return lambda argv, **k: record.append(argv) or subprocess.CompletedProcess(argv, 0)


def completed(rc, err=""):
    return lambda argv, **k: subprocess.CompletedProcess(argv, rc if "numactl" in argv[0] else 0, "", err)


def test_numactl_refused_falls_back_to_taskset_and_says_so():
    wanted = [RankAffinity(0, (0, 1), (0,))]
    pinner, note = choose_pinner(wanted, which=lambda n: f"/usr/bin/{n}",
                                 run=completed(1, "numactl: This system does not support NUMA policy\n"))
    assert pinner == TASKSET
    assert note == ("memory not bound to the GPU's NUMA node (`/usr/bin/numactl --physcpubind=0-1 --membind=0 "
                    "-- /usr/bin/true` failed: numactl: This system does not support NUMA policy): CPUs only, "
                    "with taskset")


def test_no_tool_means_no_pinning_and_a_note():
    wanted = [RankAffinity(0, (0, 1), (0,))]
    assert choose_pinner(wanted, which=lambda n: None) == \
        (None, "CPU affinity not applied: numactl not found; taskset not found")
    assert choose_pinner([], which=lambda n: pytest.fail("nothing to pin: nothing to look up")) == (None, "")
    affinity, pinner, notes = plan_affinity(PCIE8, (0,), "auto", which=lambda n: None)
    assert (affinity, pinner) == ({}, None) and notes[-1].startswith("CPU affinity not applied")


def test_each_distinct_binding_is_tried_once():
    ran = []
    wanted = [RankAffinity(g, (0, 1), (0,)) for g in range(4)] + [RankAffinity(4, (2, 3), (1,))]
    choose_pinner(wanted, which=lambda n: f"/bin/{n}", run=ok(ran))
    assert [a[1] for a in ran] == ["--physcpubind=0-1", "--physcpubind=2-3"]


def test_recorded_topology_is_shown_as_recorded():
    affinity, pinner, notes = plan_affinity(PCIE8, (6,), "auto", host_checks=False, which=lambda n: None)
    assert affinity[6].cpu_list == "32-63,96-127" and affinity[6].mems == (1,)
    assert pinner == Pinner("numactl", "numactl") and notes == []


# --- reading /proc: the check for scripts/gpu-acceptance -------------------------------------------
def fake_proc(tmp_path, procs, own="0-31"):
    def status(cpus, mems):
        return f"Name:\tx\nCpus_allowed:\tffffffff\nCpus_allowed_list:\t{cpus}\nMems_allowed_list:\t{mems}\n"
    (tmp_path / "self").mkdir()
    (tmp_path / "self" / "status").write_text(status(own, "0-1"))
    for pid, (argv, cpus, mems) in procs.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
        (tmp_path / str(pid) / "status").write_text(status(cpus, mems))
    return str(tmp_path)


PLAN_JSON = {"instances": [
    {"instance_id": "0", "affinity": [{"rank": 0, "gpu": 0, "cpus": "0-7", "mems": "0"},
                                      {"rank": 1, "gpu": 1, "cpus": "8-15", "mems": ""}]},
    {"instance_id": "1", "affinity": []},
]}


def test_check_reads_what_the_kernel_enforces(tmp_path):
    ts = "/opt/tritonserver/bin/tritonserver"
    proc = fake_proc(tmp_path, {
        100: (["/usr/bin/mpirun", "-n", "1", ts, "--id=instance0-rank0", ":", "-n", "1", ts, "--id=instance0-rank1"],
              "0-31", "0-1"),  # names the ranks, but is not one: skipped
        101: ([ts, "--id=instance0-rank0", "--http-port=8000"], "0-7", "0"),
        102: ([ts, "--id=instance0-rank1"], "8-15", "0-1"),  # memory not bound: any node passes
        103: ([ts, "--id=instance1-rank0"], "0-31", "0-1"),  # planned floating: this process's CPUs
        104: ([ts, "--id=instance1-rank1"], "0-3", "0-1"),  # pinned though the plan says float
    })
    checks = check_rank_affinity(PLAN_JSON, [100, 101, 102, 103, 104, 999], proc)
    assert [(c.instance, c.rank, c.pid, c.ok) for c in checks] == \
        [("0", 0, 101, True), ("0", 1, 102, True), ("1", 0, 103, True), ("1", 1, 104, False)]
    assert checks[3] == RankCheck("1", 1, 104, "0-31", "0-3", "", "0-1")


def test_check_catches_a_rank_that_was_not_pinned(tmp_path):
    proc = fake_proc(tmp_path, {7: (["tritonserver", "--id=instance0-rank0"], "0-31", "0-1")})
    [check] = check_rank_affinity(PLAN_JSON, [7], proc)
    assert not check.ok and (check.expected_cpus, check.actual_cpus) == ("0-7", "0-31")


def test_rank_of_reads_the_id_flag(tmp_path):
    wrapper = ["/usr/bin/numactl", "--physcpubind=0", "--", "ts", "--id=instance1-rank0"]
    proc = fake_proc(tmp_path, {5: (["ts", "--id=instance12-rank3"], "0", "0"), 6: (["ts", "--id=x"], "0", "0"),
                                7: (wrapper, "0", "0")})
    assert rank_of(5, proc) == ("12", 3) and rank_of(6, proc) is None and rank_of(404, proc) is None
    assert rank_of(7, proc) is None  # a wrapper that has not exec'ed tritonserver yet


def test_process_allowed_matches_the_kernel_for_this_process():
    cpus, mems = process_allowed()
    assert format_ids(cpus) == format_ids(os.sched_getaffinity(0)) and mems
