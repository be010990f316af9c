"""Reading Slurm's output and writing its commands: pure, on output captured from Slurm 22.05."""

from __future__ import annotations

import shlex

import pytest

from orchestrator.launcher.command import LaunchCommand
from orchestrator.launcher.slurm import node_verdict
from orchestrator.launcher.slurm_alloc import parse_probe
from orchestrator.launcher.slurm_cli import (JobInfo, NodeState, Result, expand_hostlist, parse_fields,
                                             parse_gpu_gres, parse_job, parse_sinfo_nodes, parse_sstat, parse_steps)
from orchestrator.launcher.slurm_command import LOCAL_ONLY_ENV, srun_mpirun, srun_pmix, step_name, step_prefix
from orchestrator.plan import InstancePlan, Ports

pytestmark = pytest.mark.unit

JOB = ("JobId=2 JobName=orchtest UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901758 Nice=0 "
       "JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0 BatchFlag=0 Reboot=0 ExitCode=0:0 "
       "Partition=orch AllocNode:Sid=localhost:2012 ReqNodeList=(null) ExcNodeList=(null) NodeList=node[1-2] "
       "BatchHost=node1 NumNodes=2 NumCPUs=2 NumTasks=2 CPUs/Task=1 ReqB:S:C:T=0:0:*:* "
       "TRES=cpu=2,node=2,billing=2 Socks/Node=* NtasksPerN:B:S:C=0:0:*:* CoreSpec=* JOB_GRES=gpu:4   "
       "Nodes=node[1-2] CPU_IDs=0 Mem=0 GRES=gpu:2(IDX:0-1) MinCPUsNode=1 MinMemoryNode=0 "
       "Features=(null) Power= TresPerNode=gres:gpu:2 \n")

NODE = ("NodeName=node1 Arch=x86_64 CoresPerSocket=1  CPUAlloc=1 CPUEfctv=4 CPUTot=4 Gres=gpu:2 "
        "NodeAddr=10.213.0.11 NodeHostName=node1 Version=22.05.8 OS=Linux 6.18.44-fc-v595 #1 SMP PREEMPT_DYNAMIC @0  "
        "RealMemory=2000 State=DOWN+NOT_RESPONDING ThreadsPerCore=1 Reason=Not responding [root@2026-11-22T01:23:49] "
        "Comment=(null)")


@pytest.mark.parametrize("text,expected", [
    ("node[1-2]", ("node1", "node2")),
    ("node[1-3,7],gpu-a[01-02]", ("node1", "node2", "node3", "node7", "gpu-a01", "gpu-a02")),
    ("login1,node5", ("login1", "node5")),
    ("rack[09-10]-gpu", ("rack09-gpu", "rack10-gpu")),
    ("", ()),
])
def test_hostlists_expand_like_scontrol_show_hostnames(text, expected):
    assert expand_hostlist(text) == expected


def test_fields_keep_values_with_spaces_and_equals_signs():
    fields = parse_fields(NODE)
    assert fields["NodeAddr"] == "10.213.0.11"
    assert fields["OS"] == "Linux 6.18.44-fc-v595 #1 SMP PREEMPT_DYNAMIC @0"
    assert fields["Reason"] == "Not responding [root@2026-11-22T01:23:49]"
    assert fields["State"] == "DOWN+NOT_RESPONDING"
    assert parse_fields(JOB)["TRES"] == "cpu=2,node=2,billing=2" and parse_fields(JOB)["Power"] == ""


def test_job_with_per_node_detail():
    job = parse_job(JOB)
    assert job.job_id == "2" and job.state == "RUNNING" and job.nodes == ("node1", "node2")
    assert job.per_node["node2"].gpus == (0, 1) and job.per_node["node2"].cpus == (0,)
    assert parse_job("") is None


@pytest.mark.parametrize("gres,expected", [
    ("gpu:2(IDX:0-1)", ((0, 1), 2)),
    ("gpu:h100:4(IDX:0,2-3,5)", ((0, 2, 3, 5), 4)),
    ("gpu:a100:1(IDX:0),gpu:v100:1(IDX:3)", ((0, 3), 2)),
    ("gpu:2", ((), 2)),
    ("gpu:2(IDX:N/A)", ((), 2)),
    ("nic:1(IDX:0)", ((), 0)),
    ("", ((), 0)),
])
def test_gpu_gres(gres, expected):
    assert parse_gpu_gres(gres) == expected


def test_sinfo_states_and_what_counts_as_down():
    text = ("node1|mixed|none|\nnode2|mixed+not_responding|Not responding|\nnode2|mixed+not_responding|x|\n"
            "node3|idle+drain|admin: bad fan|\nnode4|down+not_responding|Not responding [root@1]|\n")
    states = parse_sinfo_nodes(text)
    assert list(states) == ["node1", "node2", "node3", "node4"]  # a node in two partitions: once
    assert states["node1"].trouble() is None
    assert states["node3"].trouble() is None  # drain stops new jobs; ours keeps running there
    assert states["node2"].trouble() == "Slurm: node2 is MIXED+NOT_RESPONDING (Not responding)"
    assert states["node4"].trouble().startswith("Slurm: node4 is DOWN+NOT_RESPONDING")


def test_node_verdicts_name_slurms_reason():
    job = JobInfo("7", "RUNNING", ("n1", "n2"), {})
    ok, down = NodeState("n1", "allocated", ""), NodeState("n2", "down+not_responding", "Not responding")
    assert node_verdict("n1", "7", job, ok) is None
    assert node_verdict("n1", "7", job, None) is None  # sinfo did not mention it: no news
    assert node_verdict("n2", "7", job, down) == "Slurm: n2 is DOWN+NOT_RESPONDING (Not responding)"
    shrunk = JobInfo("7", "RUNNING", ("n1",), {})  # --no-kill: Slurm removed the failed node
    assert node_verdict("n2", "7", shrunk, down).startswith("node n2 left allocation 7 (Slurm: n2 is DOWN")
    assert node_verdict("n1", "7", JobInfo("7", "TIMEOUT", ("n1",), {}), ok) == "allocation 7 ended: JobState=TIMEOUT"
    assert node_verdict("n1", "7", None, ok) == "allocation 7 is gone (Slurm no longer knows the job)"


def test_steps_and_probe_output():
    assert [s.step_id for s in parse_steps("3.3|trtllm-orch.ab.i0|node1\n3.4|x|node2\n\n")] == ["3.3", "3.4"]
    probe = ("node2 3: cl0    inet 10.213.0.12/24 brd 10.213.0.255 scope global cl0\n"
             "node1 Device \"cl0\" does not exist.\n")
    assert parse_probe(probe) == {"node2": "10.213.0.12"}


def test_sstat_tells_a_running_step_from_an_orphaned_record_and_from_no_answer():
    assert parse_sstat(Result(0, "4.1|\n", ""), "4.1") is True  # its slurmstepd answered
    assert parse_sstat(Result(0, "", ""), "4.0") is False  # its slurmd answered: no such step there
    assert parse_sstat(Result(0, "", "sstat: error: slurm_job_step_stat: Socket timed out\n"), "4.0") is None
    assert parse_sstat(Result(124, "", "sstat did not answer within 20s"), "4.0") is None


INST = InstancePlan("1", (0, 1), Ports(8003, 8004, 8005), "10.0.0.2", nodes=("node2",))


def test_step_names_are_per_state_dir_and_instance():
    assert step_name("/run/a", "1").startswith(step_prefix("/run/a")) and step_name("/run/a", "1").endswith(".i1")
    assert step_prefix("/run/a") != step_prefix("/run/b")


def test_mpirun_inside_a_one_node_step():
    local = LaunchCommand(("/x/mpirun", "-n", "1", "ts", "--a", ":", "-n", "1", "ts", "--b"),
                          {"CUDA_VISIBLE_DEVICES": "0,1", "TRTLLM_ORCH_INSTANCE": "1"})
    cmd = srun_mpirun(local, INST, srun="/usr/bin/srun", job_id="7", name="trtllm-orch.ab.i1", cpus=3,
                      srun_args=("--container-image=img",))
    argv = list(cmd.argv)
    assert argv[0] == "/usr/bin/srun" and ":" not in argv  # srun would read a bare ':' as a het-step separator
    for flag in ("--jobid=7", "--job-name=trtllm-orch.ab.i1", "--nodes=1", "--nodelist=node2", "--ntasks=1",
                 "--ntasks-per-node=1", "--mpi=none",
                 "--overlap", "--cpus-per-task=3", "--export=ALL", "--container-image=img"):
        assert flag in argv
    assert argv[-3:-1] == ["/bin/sh", "-c"]
    scratch, _, launch = argv[-1].rpartition(" && ")
    assert 'export TMPDIR="$d"' in scratch and "trtllm-orch.ab.i1" in scratch  # Open MPI's session dir
    inner = shlex.split(launch)
    assert inner[:2] == ["exec", "env"]
    assert inner[inner.index("/x/mpirun"):] == list(local.argv)  # today's command, unchanged
    assert "CUDA_VISIBLE_DEVICES=0,1" in inner  # set inside the step, after Slurm's own
    assert all(f"{k}={v}" in inner for k, v in LOCAL_ONLY_ENV.items())  # mpirun stays on its node
    assert cmd.env == local.env  # srun itself carries the run's tags (the local sweep finds it)


def test_pmix_step_runs_each_rank_by_its_procid():
    wide = InstancePlan("0", (0, 1, 0, 1), Ports(8000, 8001, 8002), "10.0.0.1", nodes=("n1", "n2"))
    cmd = srun_pmix({"CUDA_VISIBLE_DEVICES": "0,1"},
                    [["ts", "--rank0"], ["ts", "--r1"], ["ts", "--r2"], ["ts", "--r3"]],
                    wide, srun="srun", job_id="7", name="n", cpus=2)
    argv = list(cmd.argv)
    assert {"--mpi=pmix", "--ntasks=4", "--ntasks-per-node=2", "--nodes=2", "--nodelist=n1,n2"} <= set(argv)
    script = argv[-1]
    assert script.startswith('case "$SLURM_PROCID" in 0) exec env CUDA_VISIBLE_DEVICES=0,1 ts --rank0;;')
    assert "3) exec env CUDA_VISIBLE_DEVICES=0,1 ts --r3;;" in script


def test_pmix_and_mpirun_steps_make_the_group_dir_on_their_node():
    env = {"CUDA_VISIBLE_DEVICES": "0,1", "TRTLLM_ORCH_GROUP_DIR": "/run/o/instances/1"}
    pmix = srun_pmix(env, [["ts", "--r0"], ["ts", "--r1"]], INST, srun="srun", job_id="7", name="n", cpus=2)
    mkdir, _, case = pmix.argv[-1].partition(" && ")
    assert mkdir == "mkdir -p -m 700 /run/o/instances/1" and case.startswith('case "$SLURM_PROCID" in 0) ')
    local = LaunchCommand(("/x/mpirun", "-n", "1", "ts"), env)
    inner = srun_mpirun(local, INST, srun="srun", job_id="7", name="n", cpus=2).argv[-1]
    assert inner.startswith("mkdir -p -m 700 /run/o/instances/1 && ")


SLURM_PMIX_TASK = {"PMIX_RANK": "1", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2",
                   "SLURM_LOCALID": "1", "SLURM_STEP_NUM_NODES": "1", "PMIX_NAMESPACE": "slurm.pmix.2.2"}


def test_twin_rank_layout_from_srun_pmix_and_from_mpirun_inside_a_step():
    from demo.twin.ranks import mpi_layout
    assert mpi_layout(SLURM_PMIX_TASK) == (1, 2, 1)
    # mpirun's rank 1 inside a one-task step also carries the step's SLURM_PROCID=0, SLURM_NTASKS=1.
    inside = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
              "PMIX_RANK": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0"}
    assert mpi_layout(inside) == (1, 2, 1)
    assert mpi_layout({}) == (0, 1, 0)


def test_twin_refuses_a_group_whose_ranks_slurm_put_on_several_nodes():
    from demo.twin.ranks import SpansNodes, mpi_layout
    with pytest.raises(SpansNodes, match=r"4 ranks are on 2 nodes .* use a --tp that fits a node"):
        mpi_layout({**SLURM_PMIX_TASK, "PMIX_RANK": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NUM_NODES": "2"})
    # mpirun's ranks inside a step that spans nodes (a daemon in `srun -N2 --pty`) are its own.
    assert mpi_layout({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "SLURM_STEP_NUM_NODES": "2"})[0] == 1
