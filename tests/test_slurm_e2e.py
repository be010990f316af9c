"""Issue 16 end to end on a real Slurm: slurmctld and two slurmd "nodes", each slurmd in its
own network namespace with its own address (scripts/setup-slurm), the real CLI, real
tritonserver ranks under mpirun inside job steps.

The daemon runs in the root namespace, as on a login node inside `salloc`; its endpoint
is 127.0.0.1 and the instances are at node1 10.213.0.11 and node2 10.213.0.12 (the
nodes' `cl0`, picked with --bind-interface).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.harness import REPO, tagged
from tests.slurm_cluster import (ADDRESSES, SlurmCluster, assert_nodes_clean, cannot_run_here, ns_processes,
                                 ranks_on, wait_until)

pytestmark = pytest.mark.e2e

GEN = json.dumps({"text_input": "hello", "max_tokens": 2, "bad_words": "", "stop_words": ""}).encode()
# Probes and the node watch at test speed; the rest as shipped.
FAST = ("--bind-interface", "cl0", "--slurm-poll-s", "0.5", "--probe-interval-s", "0.5",
        "--stop-grace-s", "3", "--canary-interval-s", "0")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = cannot_run_here()
    if reason:
        pytest.skip(reason)
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        c.start()
    except RuntimeError as exc:
        if not all(os.path.exists(f"/usr/sbin/{d}") for d in ("slurmctld", "slurmd", "munged")):
            pytest.skip(f"Slurm could not be installed here: {exc}")
        raise
    yield c
    c.stop()


@pytest.fixture
def allocation(cluster):
    job = cluster.allocate()
    yield job
    cluster.release(job)
    wait_until(lambda: not cluster.steps(), 30, "steps gone after scancel")


def slurm_run(orch_run, cluster, job: str, *extra: str):
    # TMPDIR reaches the steps (--export=ALL): their per-step scratch dirs, with what the
    # SIGKILLed mpiruns leave in them, stay in the cluster's folder, not in /tmp.
    tmpdir = cluster.root / "tmp"
    tmpdir.mkdir(exist_ok=True)
    return orch_run(gpus="all", tp=2, assume_gpus=None, extra=(*FAST, *extra),
                    env_extra={**cluster.env, "SLURM_JOB_ID": job, "TMPDIR": str(tmpdir)})


def instances(status: dict) -> dict[str, dict]:
    return {i["id"]: i for i in status["instances"]}


def served(address: str, port: int) -> int:
    """Successful ensemble inferences an instance counted (its own Prometheus metrics)."""
    with urllib.request.urlopen(f"http://{address}:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(int(float(line.split()[-1])) for line in text.splitlines()
               if line.startswith("nv_inference_request_success{") and 'model="ensemble"' in line)


def generate(url: str) -> int:
    req = urllib.request.Request(url, data=GEN, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


class Load:
    """Non-streaming requests back to back through the endpoint; every answer counted."""

    def __init__(self, url: str):
        self.url, self.codes, self._stop = url, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.codes.append(generate(self.url))

    def __enter__(self) -> "Load":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)

    def failed(self) -> list[int]:
        return [c for c in self.codes if c != 200]


def test_two_nodes_one_group_each_heal_node_failure_and_down(orch_run, cluster, allocation):
    run = slurm_run(orch_run, cluster, allocation).start(timeout=120)
    insts = instances(run.status())
    # One TP2 group per node, bound to that node's cluster address, its ranks in its namespace.
    assert {iid: (i["nodes"], i["bind_address"], i["gpus"]) for iid, i in insts.items()} == {
        "0": (["node1"], ADDRESSES["node1"], [0, 1]), "1": (["node2"], ADDRESSES["node2"], [0, 1])}
    assert len(ranks_on("node1", "0")) == 2 and len(ranks_on("node2", "1")) == 2
    assert not ranks_on("node1", "1") and not ranks_on("node2", "0")
    steps = {name.rsplit(".", 1)[1]: node for _, name, node in cluster.steps()}
    assert steps == {"i0": "node1", "i1": "node2"}

    # Requests through the one endpoint reach both nodes.
    before = {iid: served(i["bind_address"], i["ports"]["metrics"]) for iid, i in insts.items()}
    assert [generate(run.url("/v2/models/ensemble/generate")) for _ in range(12)] == [200] * 12
    after = {iid: served(i["bind_address"], i["ports"]["metrics"]) for iid, i in insts.items()}
    assert all(after[iid] > before[iid] for iid in insts), (before, after)

    # kill -9 of a rank on node 2: healed on node 2, node 1 untouched.
    node1_ranks = {p.pid for p in ranks_on("node1", "0")}
    node1_srun = insts["0"]["pids"]
    ranks_on("node2", "1")[-1].send_signal(signal.SIGKILL)
    st = run.wait_for(lambda s: instances(s)["1"]["restarts"] >= 1 and instances(s)["1"]["state"] == "READY",
                      60, "instance 1 relaunched")
    assert instances(st)["1"]["nodes"] == ["node2"] and len(ranks_on("node2", "1")) == 2
    assert instances(st)["0"]["restarts"] == 0 and instances(st)["0"]["pids"] == node1_srun
    assert {p.pid for p in ranks_on("node1", "0")} == node1_ranks

    # Node 2's slurmd stops: Slurm calls node2 NOT_RESPONDING, its group goes FAILED with
    # that reason while node 1 serves every non-streaming request.
    with Load(run.url("/v2/models/ensemble/generate")) as load:
        t0 = time.monotonic()
        cluster.slurmd("node2", "stop")
        st = run.wait_for(lambda s: instances(s)["1"]["state"] == "FAILED", 60, "instance 1 FAILED")
        failed_after = time.monotonic() - t0
        # Bring it back before Slurm's SlurmdTimeout would call it DOWN and take it from the job.
        cluster.slurmd("node2", "start")
        time.sleep(1.0)
    reason = instances(st)["1"]["reason"]
    assert reason.startswith("Slurm: node2 is ") and "NOT_RESPONDING" in reason, reason
    assert instances(st)["0"]["state"] == "READY" and instances(st)["0"]["restarts"] == 0
    assert load.codes and not load.failed(), f"{len(load.failed())} of {len(load.codes)} requests failed"
    print(f"node2 FAILED {failed_after:.1f}s after its slurmd stopped; {len(load.codes)} requests, 0 failed")

    # Slurm returns the node: the group comes back there by itself.
    st = run.wait_for(lambda s: instances(s)["1"]["state"] == "READY", 60, "instance 1 back on node2")
    assert len(ranks_on("node2", "1")) == 2

    # down: no step left, nothing of the run in either namespace.
    out = run.down()
    assert out.returncode == 0, out.stderr
    assert cluster.steps() == []
    assert_nodes_clean()
    assert tagged(run.state_dir) == []


@pytest.fixture
def exclusive_allocation(cluster):
    """Every CPU of both nodes: under srun --mpi=pmix each rank is a task with a CPU of its own
    (the default allocation holds one CPU per node)."""
    job = cluster.allocate(2, 2, "--exclusive")
    yield job
    cluster.release(job)
    wait_until(lambda: not cluster.steps(), 30, "steps gone after scancel")


def rank_env(proc) -> dict[str, str]:
    env = proc.environ()
    return {k: env.get(k, "") for k in ("PMIX_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "TRTLLM_ORCH_INSTANCE")}


def test_pmix_steps_start_every_rank_by_slurm_heal_a_killed_rank_and_down(orch_run, cluster,
                                                                          exclusive_allocation):
    """--slurm-mpi pmix, --tp 2 on 2 nodes x 2 GPUs: one group per node, each a step of
    `srun --mpi=pmix` whose 2 tasks are the ranks themselves (no mpirun anywhere)."""
    t0 = time.monotonic()
    run = slurm_run(orch_run, cluster, exclusive_allocation, "--slurm-mpi", "pmix").start(timeout=120)
    ready_s = time.monotonic() - t0
    insts = instances(run.status())
    assert {iid: (i["nodes"], i["bind_address"], i["gpus"]) for iid, i in insts.items()} == {
        "0": (["node1"], ADDRESSES["node1"], [0, 1]), "1": (["node2"], ADDRESSES["node2"], [0, 1])}
    steps = {name.rsplit(".", 1)[1]: node for _, name, node in cluster.steps()}
    assert steps == {"i0": "node1", "i1": "node2"}
    # Each rank is a Slurm task with its PMIx rank, started by slurmstepd: no mpirun, no OMPI rank.
    for node, iid in (("node1", "0"), ("node2", "1")):
        ranks = ranks_on(node, iid)
        envs = sorted((rank_env(p) for p in ranks), key=lambda e: e["PMIX_RANK"])
        assert [(e["PMIX_RANK"], e["SLURM_PROCID"], e["OMPI_COMM_WORLD_RANK"]) for e in envs] == \
            [("0", "0", ""), ("1", "1", "")], envs
        assert {p.parent().name() for p in ranks} == {"slurmstepd"}
        assert not [p for p in ns_processes(node) if p.name() in ("mpirun", "prterun", "prted", "orted")]
    assert not ranks_on("node1", "1") and not ranks_on("node2", "0")

    # Requests through the one endpoint reach both groups.
    before = {iid: served(i["bind_address"], i["ports"]["metrics"]) for iid, i in insts.items()}
    assert [generate(run.url("/v2/models/ensemble/generate")) for _ in range(12)] == [200] * 12
    after = {iid: served(i["bind_address"], i["ports"]["metrics"]) for iid, i in insts.items()}
    assert all(after[iid] > before[iid] for iid in insts), (before, after)

    # kill -9 of node 2's worker rank (it serves nothing: only the step's end tells): Slurm
    # ends the step (--kill-on-bad-exit), srun exits, the group restarts on node 2.
    node1_ranks = {p.pid for p in ranks_on("node1", "0")}
    worker = next(p for p in ranks_on("node2", "1") if rank_env(p)["PMIX_RANK"] == "1")
    t_kill = time.monotonic()
    worker.send_signal(signal.SIGKILL)
    st = run.wait_for(lambda s: instances(s)["1"]["restarts"] >= 1 and instances(s)["1"]["state"] == "READY",
                      60, "instance 1 relaunched")
    healed_s = time.monotonic() - t_kill
    assert instances(st)["1"]["nodes"] == ["node2"] and len(ranks_on("node2", "1")) == 2
    assert worker.pid not in {p.pid for p in ranks_on("node2", "1")}
    assert instances(st)["0"]["restarts"] == 0 and {p.pid for p in ranks_on("node1", "0")} == node1_ranks
    assert [generate(run.url("/v2/models/ensemble/generate")) for _ in range(4)] == [200] * 4

    out = run.down()
    assert out.returncode == 0, out.stderr
    assert cluster.steps() == []
    assert_nodes_clean()
    assert tagged(run.state_dir) == []
    print(f"pmix: READY {ready_s:.1f}s after up; killed worker rank healed in {healed_s:.1f}s")


def test_down_after_a_sigkilled_daemon_finds_the_steps_by_name(orch_run, cluster, allocation):
    run = slurm_run(orch_run, cluster, allocation).start(timeout=120)
    srun_pids = [p for i in run.status()["instances"] for p in i["pids"]]
    daemon = run.proc.pid
    # The daemon's host is gone: srun with it (both of srun's processes, no signal handling),
    # so the steps run on with nobody to cancel them.
    for pid in srun_pids:
        os.killpg(pid, signal.SIGKILL)
    os.kill(daemon, signal.SIGKILL)
    run.proc.wait(10)
    assert len(cluster.steps()) == 2 and len(ranks_on("node1") + ranks_on("node2")) == 4

    out = run.cli("down", "--state-dir", str(run.state_dir), timeout=120)
    assert out.returncode == 0, out.stderr
    assert "cancelled 2 Slurm job step(s) left by a killed daemon" in out.stdout
    assert cluster.steps() == []
    assert_nodes_clean()
    assert tagged(run.state_dir) == []


@pytest.mark.parametrize("flags,field,needle", [
    (("--gpus", "0-3"), "--gpus='0-3'", "GPU 2,3 not on node1 of the allocation (it has GPUs 0-1)"),
    (("--tp", "8"), "--tp=8", "needs 8 GPUs per group; the allocation has 4 (2 node(s) x 2 selected)"),
    (("--tp", "3"), "--tp=3", "a group larger than a node takes whole nodes: must be a multiple of the 2 GPU(s) "
                              "selected per node"),
])
def test_more_gpus_than_the_allocation_has_is_exit_2_and_starts_nothing(cluster, allocation, tmp_path,
                                                                       flags, field, needle):
    state = tmp_path / "state"
    out = subprocess.run([sys.executable, "-m", "orchestrator", "up", "--model-repo", str(REPO / "demo" / "model_repo"),
                          "--state-dir", str(state), *flags], capture_output=True, text=True, timeout=60, cwd=REPO,
                         env={**os.environ, **cluster.env, "SLURM_JOB_ID": allocation})
    assert out.returncode == 2, out.stderr
    assert out.stderr == f"trtllm-orch: error: {field}: {needle}\n"
    assert cluster.steps() == [] and not state.exists()
    assert_nodes_clean()


def test_launcher_slurm_outside_an_allocation_is_exit_2(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "SLURM_JOB_ID"}
    out = subprocess.run([sys.executable, "-m", "orchestrator", "up", "--launcher", "slurm", "--model-repo",
                          str(REPO / "demo" / "model_repo"), "--state-dir", str(tmp_path / "s")],
                         capture_output=True, text=True, timeout=60, cwd=REPO, env=env)
    assert out.returncode == 2
    assert out.stderr.startswith("trtllm-orch: error: --launcher='slurm': not inside a Slurm allocation")
    assert out.stderr.count("\n") == 1 and not (tmp_path / "s").exists()



def test_a_group_across_nodes_starts_under_pmix_and_the_twin_refuses_it_in_one_line(orch_run, cluster,
                                                                                  exclusive_allocation):
    """--tp 4 on 2 nodes x 2 GPUs: one group across both nodes, started by `srun --mpi=pmix`
    (auto). The launch works (4 tasks, ranks 0-1 on node1, 2-3 on node2); the twin cannot
    couple ranks of two nodes (Unix sockets in its group dir) and says so in one line instead
    of having rank 0 wait for its peers forever; a failed task ends the step, and the group
    is never READY."""
    run = slurm_run(orch_run, cluster, exclusive_allocation)
    run.args[run.args.index("--tp") + 1] = "4"
    t0 = time.monotonic()
    run.start(wait_ready=False)
    needle = "twin: this TP group's 4 ranks are on 2 nodes (SLURM_STEP_NUM_NODES)"
    log_path = run.state_dir / "instances" / "0" / "instance.log"
    wait_until(lambda: log_path.exists() and needle in log_path.read_text(errors="replace"), 60, "the twin's line")
    refused_s = time.monotonic() - t0
    log_text = log_path.read_text(errors="replace")
    assert "--mpi=pmix" in log_text and "--nodes=2" in log_text and "--ntasks=4" in log_text
    # Slurm ends the step at the first failed task (--kill-on-bad-exit): no rank waits on.
    wait_until(lambda: "Terminating StepId" in log_path.read_text(errors="replace"), 30, "step terminated")
    inst = instances(run.status())["0"]
    assert inst["nodes"] == ["node1", "node2"] and inst["state"] != "READY"
    # A rank SIGTERMed while its models still load leaves Python stubs that escape this
    # cluster's proctrack/linuxproc (orphans are not in the step's process tree) and keep
    # the step listed until they notice (about 60 s); `down` says so and is run again.
    deadline = time.monotonic() + 120
    while (out := run.down()).returncode != 0 and time.monotonic() < deadline:
        assert "Slurm still lists job step(s)" in out.stderr, out.stderr
        time.sleep(5)
    assert out.returncode == 0, out.stderr
    # A step whose tasks are gone but whose end slurmctld has not yet recorded is not
    # waited for by `down` (its node's slurmd knows no such step: launcher/slurm.py); the
    # record goes once slurmctld hears of the end.
    wait_until(lambda: cluster.steps() == [], 60, "Slurm lists no step of the run")
    assert_nodes_clean()
    assert tagged(run.state_dir) == []
    print(f"pmix across nodes: the twin refused in {refused_s:.1f}s after up")
