"""The plan across a Slurm allocation's nodes, and bad input under Slurm: pure logic, every error path.

The real cluster is in tests/test_slurm_e2e.py; here nothing starts and nothing asks Slurm.
"""

from __future__ import annotations

import pytest

from orchestrator import cli
from orchestrator.cluster_plan import NodeInfo, make_cluster_plan, step_cpus
from orchestrator.config import Settings
from orchestrator.errors import UsageError
from orchestrator.launcher.slurm_alloc import allocation_nodes, choose_addresses, resolve_launcher
from orchestrator.launcher.slurm_cli import JobInfo, NodeAllocation

pytestmark = pytest.mark.unit


def nodes(count: int, gpus: int, cpus: int = 8) -> tuple[NodeInfo, ...]:
    return tuple(NodeInfo(f"n{i + 1}", f"10.0.0.{i + 1}", tuple(range(gpus)), cpus) for i in range(count))


def test_two_nodes_of_two_gpus_tp2_gives_one_group_per_node():
    plan = make_cluster_plan(nodes(2, 2), "all", 2, 8000)
    assert [(i.nodes, i.gpus, i.bind_address) for i in plan.instances] == [
        (("n1",), (0, 1), "10.0.0.1"), (("n2",), (0, 1), "10.0.0.2")]
    assert [i.ports.all() for i in plan.instances] == [(8000, 8001, 8002), (8003, 8004, 8005)]
    assert [i.cuda_visible_devices for i in plan.instances] == ["0,1", "0,1"]


def test_groups_fill_a_node_before_the_next_and_skip_balancer_ports():
    plan = make_cluster_plan(nodes(2, 4), "all", 2, 8078, reserved_ports=(8080, 8081))
    assert [(i.instance_id, i.nodes[0], i.gpus) for i in plan.instances] == [
        ("0", "n1", (0, 1)), ("1", "n1", (2, 3)), ("2", "n2", (0, 1)), ("3", "n2", (2, 3))]
    ports = [p for i in plan.instances for p in i.ports.all()]
    assert 8080 not in ports and 8081 not in ports and len(set(ports)) == 12


def test_gpu_spec_applies_to_every_node_in_its_order():
    plan = make_cluster_plan(nodes(2, 4), "3,1", 2, 8000)
    assert [(i.nodes, i.gpus) for i in plan.instances] == [(("n1",), (3, 1)), (("n2",), (3, 1))]


def test_tp_larger_than_a_node_takes_whole_nodes():
    plan = make_cluster_plan(nodes(4, 2), "all", 4, 8000)
    assert [(i.nodes, i.tp, i.gpus_per_node, i.cuda_visible_devices, i.bind_address) for i in plan.instances] == [
        (("n1", "n2"), 4, 2, "0,1", "10.0.0.1"), (("n3", "n4"), 4, 2, "0,1", "10.0.0.3")]


def test_a_local_plan_is_unchanged_by_the_nodes_field():
    from orchestrator.plan import make_plan
    inst = make_plan((0, 1, 2, 3), 4, 8000, "127.0.0.1").instances[0]
    assert inst.nodes == () and inst.gpus_per_node == 4 and inst.cuda_visible_devices == "0,1,2,3"


@pytest.mark.parametrize("alloc,spec,tp,field,needle", [
    (nodes(2, 2), "0-3", 2, "--gpus", "GPU 2,3 not on n1 of the allocation (it has GPUs 0-1)"),
    (nodes(2, 2), "all", 8, "--tp", "needs 8 GPUs per group; the allocation has 4 (2 node(s) x 2 selected)"),
    (nodes(2, 2), "0", 4, "--tp", "needs 4 GPUs per group; the allocation has 2 (2 node(s) x 1 selected)"),
    (nodes(2, 4), "all", 3, "--tp", "does not divide the 4 GPU(s) selected on n1 (0,1,2,3) into whole groups"),
    (nodes(2, 2), "all", 3, "--tp", "must be a multiple of the 2 GPU(s) selected per node"),
    (nodes(3, 2), "all", 4, "--tp", "takes 2 whole nodes per group; the allocation's 3 nodes do not divide"),
    (nodes(2, 0), "all", 1, "--gpus", "the allocation holds no GPUs on n1"),
    (nodes(2, 2), "all", 0, "--tp", "must be at least 1"),
    (nodes(2, 2), "1,1", 1, "--gpus", "duplicate GPU id(s) 1"),
])
def test_bad_plans_are_one_line_naming_field_and_value(alloc, spec, tp, field, needle):
    with pytest.raises(UsageError) as err:
        make_cluster_plan(alloc, spec, tp, 8000)
    msg = str(err.value)
    assert msg.startswith(f"{field}=") and needle in msg and "\n" not in msg, msg
    assert err.value.exit_code == 2


def test_nodes_with_different_gpu_counts_cannot_share_a_group():
    mixed = (NodeInfo("n1", "a", (0, 1)), NodeInfo("n2", "b", (0, 1, 2, 3)))
    assert len(make_cluster_plan(mixed, "all", 2, 8000).instances) == 3  # within nodes: fine
    with pytest.raises(UsageError, match="different numbers of GPUs"):
        make_cluster_plan(mixed, "all", 4, 8000)


def test_each_step_gets_its_share_of_the_nodes_cpus():
    alloc = (NodeInfo("n1", "a", (0, 1, 2, 3), 16), NodeInfo("n2", "b", (0, 1, 2, 3), 1))
    plan = make_cluster_plan(alloc, "all", 2, 8000)
    assert step_cpus(plan, alloc) == {"0": 8, "1": 8, "2": 1, "3": 1}
    wide = make_cluster_plan(nodes(2, 4, cpus=16), "all", 8, 8000)
    assert step_cpus(wide, nodes(2, 4, cpus=16)) == {"0": 4}  # per task: 4 ranks share a node


def test_pmix_gives_every_rank_a_task_with_its_share_and_refuses_too_few_cpus():
    from orchestrator.launcher.slurm_prepare import pmix_task_cpus
    alloc = nodes(2, 2, cpus=4)
    plan = make_cluster_plan(alloc, "all", 2, 8000)
    assert pmix_task_cpus(plan, alloc) == ({"0": 2, "1": 2}, [])  # 2 tasks of 2 CPUs on each node
    one_cpu = nodes(2, 2, cpus=1)  # salloc's default: one CPU per node
    share, short = pmix_task_cpus(make_cluster_plan(one_cpu, "all", 2, 8000), one_cpu)
    assert short == ["n1 holds 1 CPU(s) of the allocation for 2 rank(s)",
                     "n2 holds 1 CPU(s) of the allocation for 2 rank(s)"]


def test_pmix_probe_names_the_missing_pmix_library():
    from orchestrator.launcher.slurm_cli import Result
    from orchestrator.launcher.slurm_prepare import pmix_problem
    err = ("srun: error:  mpi/pmix_v4: init: (null) [0]: mpi_pmix.c:195: pmi/pmix: can not load PMIx library\n"
           "srun: error: Invalid MPI type 'pmix', --mpi=list for acceptable types\n")
    problem = pmix_problem("7", "ab", run=lambda argv, timeout_s: Result(1, "", err))
    assert problem is not None and "cannot load the PMIx library" in problem and "libpmix-dev" in problem
    assert pmix_problem("7", "ab", run=lambda argv, timeout_s: Result(0, "", "")) is None


def test_launcher_auto_follows_the_allocation():
    assert resolve_launcher("auto", {}) == "local"
    assert resolve_launcher("auto", {"SLURM_JOB_ID": "7"}) == "slurm"
    assert resolve_launcher("local", {"SLURM_JOB_ID": "7"}) == "local"
    with pytest.raises(UsageError) as err:
        resolve_launcher("slurm", {})
    assert str(err.value).startswith("--launcher='slurm': not inside a Slurm allocation")


def test_addresses_come_from_the_interface_or_slurm_never_one_address_for_many_nodes():
    two = ("n1", "n2")
    by_slurm = {"n1": "10.0.0.1", "n2": "10.0.0.2"}
    assert choose_addresses(two, "127.0.0.1", lambda: by_slurm, None) == by_slurm
    iface = {"n1": "192.168.1.1", "n2": "192.168.1.2"}
    assert choose_addresses(two, "127.0.0.1", lambda: by_slurm, lambda: iface) == iface
    assert choose_addresses(("n1",), "10.9.9.9", lambda: by_slurm, None) == {"n1": "10.9.9.9"}
    with pytest.raises(UsageError) as err:
        choose_addresses(two, "10.9.9.9", lambda: by_slurm, None)
    assert str(err.value).startswith("--bind-address='10.9.9.9': one address cannot be on 2 nodes")


def test_allocation_gpus_from_gres_indices_counts_or_assume_gpus():
    job = JobInfo("7", "RUNNING", ("n1", "n2"), {
        "n1": NodeAllocation("n1", (0, 1, 2, 3), (2, 3), 2),  # GRES with device files: IDX
        "n2": NodeAllocation("n2", (0,), (), 2)})  # GRES with a count only
    addrs = {"n1": "a", "n2": "b"}
    got = allocation_nodes(job, addrs, None)
    assert [(n.name, n.gpus, n.cpus) for n in got] == [("n1", (2, 3), 4), ("n2", (0, 1), 1)]
    assert [n.gpus for n in allocation_nodes(job, addrs, 4)] == [(0, 1, 2, 3), (0, 1, 2, 3)]


@pytest.mark.parametrize("kwargs,needle", [
    (dict(launcher="k8s"), "--launcher='k8s': must be one of auto, local, slurm"),
    (dict(slurm_mpi="ucx"), "--slurm-mpi='ucx': must be one of auto, mpirun, pmix"),
    (dict(bind_interface="ib0", bind_address="10.0.0.1"), "--bind-interface='ib0': use either it or --bind-address"),
    (dict(bind_interface="eth0; rm"), "--bind-interface='eth0; rm': not an interface name"),
    (dict(slurm_poll_s=0), "--slurm-poll-s=0: must be positive"),
])
def test_bad_settings_name_field_and_value(kwargs, needle):
    with pytest.raises(UsageError) as err:
        Settings(**kwargs)
    assert str(err.value) == needle or str(err.value).startswith(needle)


@pytest.mark.parametrize("command", ["up", "plan"])
def test_launcher_slurm_outside_an_allocation_is_exit_2_one_line(command, monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    code = cli.main([command, "--launcher", "slurm", "--model-repo", str(tmp_path), "--assume-gpus", "2",
                     "--state-dir", str(tmp_path / "state")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("trtllm-orch: error: --launcher='slurm': not inside a Slurm")
    assert not (tmp_path / "state").exists()  # nothing started, not even the state dir
