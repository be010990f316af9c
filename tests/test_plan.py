"""GPU spec parser, plan and mpirun command builder: pure logic, every error path."""

import pytest

from orchestrator.errors import UsageError
from orchestrator.gpus import parse_gpu_spec
from orchestrator.launcher.command import build_launch, rank_args, shm_prefix, shm_scope
from orchestrator.launcher.mpi import MpiFlavour, parse_version_text
from orchestrator.plan import make_plan

pytestmark = pytest.mark.unit

EIGHT = tuple(range(8))


@pytest.mark.parametrize("spec,expected", [
    ("all", EIGHT), ("0-3", (0, 1, 2, 3)), ("0,2,4,6", (0, 2, 4, 6)), ("0-3,6-7", (0, 1, 2, 3, 6, 7)),
    ("3,1,2,0", (3, 1, 2, 0)), (" 5 ", (5,)), ("4-4", (4,)),
])
def test_gpu_spec_forms(spec, expected):
    assert parse_gpu_spec(spec, EIGHT) == expected


@pytest.mark.parametrize("spec,available,needle", [
    ("", EIGHT, "empty GPU list"),
    ("0,,1", EIGHT, "empty item"),
    ("0-3,2", EIGHT, "duplicate GPU id(s) 2"),
    ("1,1", EIGHT, "duplicate GPU id(s) 1"),
    ("0-9", EIGHT, "GPU 8,9 not on this host (it has GPUs 0-7)"),
    ("4", (0, 1, 2, 3), "GPU 4 not on this host (it has GPUs 0-3)"),
    ("3-1", EIGHT, "runs backwards"),
    ("a-b", EIGHT, "cannot read"),
    ("-1", EIGHT, "cannot read"),
    ("all", (), "no GPUs"),
    ("0", (), "it has no GPUs"),
])
def test_gpu_spec_errors_name_field_and_value(spec, available, needle):
    with pytest.raises(UsageError) as err:
        parse_gpu_spec(spec, available)
    msg = str(err.value)
    assert msg.startswith("--gpus=") and needle in msg and "\n" not in msg
    assert err.value.exit_code == 2


def test_plan_groups_in_given_order_and_ports_do_not_overlap():
    plan = make_plan((0, 2, 1, 3), 2, 8000, "127.0.0.1")
    assert [i.gpus for i in plan.instances] == [(0, 2), (1, 3)]
    assert [i.ports.all() for i in plan.instances] == [(8000, 8001, 8002), (8003, 8004, 8005)]
    assert [i.cuda_visible_devices for i in plan.instances] == ["0,2", "1,3"]


def test_plan_skips_load_balancer_ports():
    plan = make_plan(EIGHT, 2, 8078, "127.0.0.1", reserved_ports=(8080, 8081))
    ports = [p for i in plan.instances for p in i.ports.all()]
    assert 8080 not in ports and 8081 not in ports and len(set(ports)) == len(ports) == 12


@pytest.mark.parametrize("gpus,tp,needle", [
    ((0, 1, 2, 3), 3, "--tp=3: does not divide the 4 GPU(s)"),
    ((0, 1, 2, 3), 0, "--tp=0: must be at least 1"),
    ((), 1, "--gpus"),
])
def test_plan_errors(gpus, tp, needle):
    with pytest.raises(UsageError, match=None) as err:
        make_plan(gpus, tp, 8000, "127.0.0.1")
    assert needle in str(err.value)


def test_plan_runs_out_of_ports():
    with pytest.raises(UsageError) as err:
        make_plan(EIGHT, 1, 65530, "127.0.0.1")
    assert "--base-port=65530" in str(err.value)


OMPI = MpiFlavour("openmpi", "5.0.11", "/usr/bin/mpirun")
HYDRA = MpiFlavour("mpich", "4.1", "/usr/bin/mpiexec")


def launch(flavour=OMPI, as_root=True, wrapper=()):
    plan = make_plan((2, 3), 2, 9000, "127.0.0.1")
    return build_launch(plan.instances[0], mpi=flavour, tritonserver="/opt/ts", model_repo="/m",
                        llm_models=("tensorrt_llm", "draft"), extra_args=("--log-verbose=1",),
                        state_dir="/run/x", group_dir="/run/x/instances/0", as_root=as_root,
                        rank_wrapper=wrapper)


def app_contexts(argv):
    contexts, current = [], []
    for arg in argv:
        if arg == ":":
            contexts.append(current)
            current = []
        else:
            current.append(arg)
    contexts.append(current)
    return contexts


def test_leader_mode_command_openmpi_root():
    cmd = launch()
    ctx = app_contexts(cmd.argv)
    assert len(ctx) == 2
    head = ctx[0][:ctx[0].index("-n")]
    assert head[0] == "/usr/bin/mpirun" and "--allow-run-as-root" in head
    assert ["--bind-to", "none"] == head[head.index("--bind-to"):head.index("--bind-to") + 2]
    for name in ("CUDA_VISIBLE_DEVICES", "TRTLLM_ORCH_STATE_DIR", "TRTLLM_ORCH_INSTANCE"):
        assert name in head[head.index("-x"):]
    assert cmd.env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert cmd.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    rank0 = ctx[0][ctx[0].index("-n"):]
    rank1 = ctx[1]
    assert rank0[:3] == ["-n", "1", "/opt/ts"] and rank1[:3] == ["-n", "1", "/opt/ts"]
    assert "--http-port=9000" in rank0 and "--grpc-port=9001" in rank0 and "--metrics-port=9002" in rank0
    for flag in ("--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1"):
        assert flag in rank0
    assert not any(a.startswith(("--http-port", "--grpc-port", "--metrics-port")) for a in rank1)
    for flag in ("--allow-http=false", "--allow-grpc=false", "--allow-metrics=false",
                 "--model-control-mode=explicit", "--load-model=tensorrt_llm", "--load-model=draft"):
        assert flag in rank1
    for rank in (rank0, rank1):
        assert "--disable-auto-complete-config" in rank and "--log-verbose=1" in rank
    scope = shm_scope(cmd.env["TRTLLM_ORCH_STATE_DIR"])  # two daemons never share a prefix
    assert f"--backend-config=python,shm-region-prefix-name={shm_prefix('0', 0, scope)}" in rank0
    assert f"--backend-config=python,shm-region-prefix-name={shm_prefix('0', 1, scope)}" in rank1


def test_shm_prefixes_unique_across_instances_and_ranks():
    prefixes = {shm_prefix(str(i), r) for i in range(8) for r in range(8)}
    assert len(prefixes) == 64


def test_not_root_has_no_allow_run_as_root():
    assert "--allow-run-as-root" not in launch(as_root=False).argv


def test_rank_wrapper_goes_before_each_rank():
    ctx = app_contexts(launch(wrapper=("/usr/bin/setpriv", "--pdeathsig", "KILL", "--")).argv)
    for c in ctx:
        i = c.index("-n")
        assert c[i + 2:i + 7] == ["/usr/bin/setpriv", "--pdeathsig", "KILL", "--", "/opt/ts"]


def test_hydra_forwards_environment():
    argv = launch(HYDRA).argv
    assert "-genvall" in argv and "--allow-run-as-root" not in argv and "-x" not in argv


def test_tp1_is_single_context_with_ports():
    plan = make_plan((0,), 1, 8000, "127.0.0.1")
    args = rank_args(plan.instances[0], 0, "/m", ("tensorrt_llm",), ())
    assert "--http-port=8000" in args and "--allow-http=false" not in args


@pytest.mark.parametrize("text,name", [
    ("mpirun (Open MPI) 4.1.6\n\nReport bugs to http://www.open-mpi.org/community/help/", "openmpi"),
    ("mpirun (Open MPI) 5.0.11\n", "openmpi"),
    ("HYDRA build details:\n    Version:                                 4.1.2\n", "mpich"),
])
def test_mpi_flavour_detection(text, name):
    assert parse_version_text(text, "/x/mpirun").name == name


def test_unknown_mpi_is_clear_error():
    from orchestrator.errors import EnvironmentProblem
    with pytest.raises(EnvironmentProblem, match="unknown MPI launcher"):
        parse_version_text("Intel(R) MPI Library for Linux* OS, Version 2021", "/x/mpirun")


def _h200x2_plan(tp=2):
    from pathlib import Path
    from orchestrator.topology import load_topology
    topo = load_topology(str(Path(__file__).parent / "data" / "topo-h200x2-nvlink.json"))
    return make_plan((0, 1), tp, 9000, "127.0.0.1", topology=topo, placement="ordered")


def test_ranks_make_no_pools_on_the_other_gpus_of_their_group():
    # Each rank sees the whole group; without this it held a CUDA context on every GPU of
    # it (tritonserver's default 64 MiB pool per device), which slowed a restart's release.
    inst = _h200x2_plan().instances[0]
    r0 = rank_args(inst, 0, "/m", ("tensorrt_llm",), ())
    r1 = rank_args(inst, 1, "/m", ("tensorrt_llm",), ())
    assert [a for a in r0 if "pool-byte-size" in a] == ["--cuda-memory-pool-byte-size=1:0"]
    assert [a for a in r1 if "pool-byte-size" in a] == ["--cuda-memory-pool-byte-size=0:0",
                                                         "--pinned-memory-pool-byte-size=0"]


def test_pool_flags_not_added_without_nvml_or_for_tp1_and_user_overrides_win():
    assumed = make_plan((0, 1), 2, 9000, "127.0.0.1").instances[0]  # --assume-gpus: no topology
    assert not any("pool-byte-size" in a for a in rank_args(assumed, 1, "/m", (), ()))
    for inst in _h200x2_plan(tp=1).instances:
        assert not any("pool-byte-size" in a for a in rank_args(inst, 0, "/m", (), ()))
    inst = _h200x2_plan().instances[0]
    extra = ("--cuda-memory-pool-byte-size=0:1024", "--pinned-memory-pool-byte-size", "4096")
    r1 = rank_args(inst, 1, "/m", (), extra)
    assert [a for a in r1 if "pool-byte-size" in a] == list(extra[:2])
