"""Issue 2 end to end: real mpirun + tritonserver ranks through the public CLI."""

import ipaddress
import json
import os
import signal
import socket
import time
import urllib.request

import psutil
import pytest

from tests.harness import tagged

pytestmark = pytest.mark.e2e

GEN = json.dumps({"text_input": "hello", "max_tokens": 3, "bad_words": "", "stop_words": ""}).encode()


def post(url: str, body: bytes = GEN, timeout: float = 30) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.status, json.loads(resp.read())


def get_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def environ(pid: int) -> dict[str, str]:
    return psutil.Process(pid).environ()


def running(pid: int) -> bool:
    """Exists and is not a zombie (init here does not reap orphans at once)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    mapped = getattr(addr, "ipv4_mapped", None)  # gRPC listens on ::ffff:127.0.0.1
    return (mapped or addr).is_loopback


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def test_up_two_tp2_instances_then_down_leaves_nothing(orch_run):
    run = orch_run().start()
    status = run.status()
    assert [i["id"] for i in status["instances"]] == ["0", "1"]
    assert [i["gpus"] for i in status["instances"]] == [[0, 1], [2, 3]]

    daemon = psutil.Process(status["daemon"]["pid"])
    mpiruns = [c for c in daemon.children() if c.name() in ("mpirun", "prterun", "mpiexec")]
    assert len(mpiruns) == 2, [c.name() for c in daemon.children()]
    ranks = [p for p in tagged(run.state_dir) if p.name() == "tritonserver"]
    assert len(ranks) == 4
    by_instance = {}
    for rank in ranks:
        env = environ(rank.pid)
        by_instance.setdefault(env["TRTLLM_ORCH_INSTANCE"], set()).add(env["CUDA_VISIBLE_DEVICES"])
    assert by_instance == {"0": {"0,1"}, "1": {"2,3"}}

    all_ports = []
    for inst in status["instances"]:
        ports = inst["ports"]
        all_ports += [ports["http"], ports["grpc"], ports["metrics"]]
        base = f"http://127.0.0.1:{ports['http']}"
        assert get_status(base + "/v2/health/ready") == 200
        code, body = post(base + "/v2/models/ensemble/generate")
        assert code == 200 and body["text_output"]
    # Only loopback: no instance port listens anywhere else.
    listeners = [c for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN
                 and c.laddr.port in all_ports]
    assert listeners and all(is_loopback(c.laddr.ip) for c in listeners), listeners
    # Ranks != 0 bind nothing at all.
    rank_pids = {p.pid for p in ranks}
    assert {c.pid for c in listeners} <= rank_pids
    assert len({c.pid for c in listeners}) == 2

    out = run.down()
    assert out.returncode == 0, out.stderr
    assert run.proc.wait(timeout=30) == 0
    assert tagged(run.state_dir) == []
    assert not any(running(p.pid) for p in mpiruns)
    assert all(port_free(p) for p in all_ports + [run.listen_port, run.grpc_port])
    assert not (run.state_dir / "state.json").exists()


# Installed for one test as sitecustomize: the `up` process sleeps in an exit handler, after it
# has released its lock (as a daemon does whose loop waits on executor threads at exit).
LINGER_AT_EXIT = """
import atexit, os, sys, time
def _linger():
    if sys.argv[1:2] == ["up"]:
        time.sleep(float(os.environ["TEST_DAEMON_LINGER_S"]))
atexit.register(_linger)
"""


def test_down_returns_only_once_the_daemon_process_is_gone(orch_run, tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(LINGER_AT_EXIT)
    run = orch_run(gpus="0", tp=1, assume_gpus=1, env_extra={"TEST_DAEMON_LINGER_S": "3"})
    run.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), run.env.get("PYTHONPATH")]))
    run.start()
    daemon = run.status()["daemon"]["pid"]
    out = run.cli("down", "--state-dir", str(run.state_dir), timeout=60)
    assert out.returncode == 0, out.stderr
    assert not running(daemon)  # was still in its exit handler for 3 s after `down` returned
    assert run.proc.wait(timeout=10) == 0


def test_sigkill_daemon_then_down_leaves_no_orphan(orch_run):
    run = orch_run().start()
    status = run.status()
    pids = [p for inst in status["instances"] for p in inst["pids"]]
    assert len(pids) >= 6
    os.kill(status["daemon"]["pid"], signal.SIGKILL)
    run.proc.wait(timeout=10)
    out = run.down()
    assert out.returncode == 0, out.stderr
    # They outlive the daemon (live restore): `down`'s sweep must find and stop every one.
    time.sleep(0.2)
    alive = [p for p in pids if running(p)]
    assert alive == []
    assert tagged(run.state_dir) == []


def test_sigkill_daemon_next_up_adopts_and_starts_nothing_twice(orch_run):
    run = orch_run().start()
    old = {p for inst in run.status()["instances"] for p in inst["pids"]}
    os.kill(run.status()["daemon"]["pid"], signal.SIGKILL)
    run.proc.wait(timeout=10)
    assert all(running(p) for p in old)  # live restore: the engines outlive the daemon
    run.start()  # same state dir, same ports: adopts them
    new = {p for inst in run.status()["instances"] for p in inst["pids"]}
    assert old == new
    ranks = [p for p in tagged(run.state_dir) if p.name() == "tritonserver"]
    assert len(ranks) == 4  # 2 instances x TP2, none started twice


def test_second_up_on_same_state_dir_is_refused(orch_run):
    run = orch_run().start()
    out = run.cli("up", *run.args)
    assert out.returncode != 0
    assert "already runs" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert run.status()["ready"] == 2


def test_status_without_daemon_is_one_line_error(tmp_path):
    from tests.harness import Run  # noqa: F401
    import subprocess, sys
    out = subprocess.run([sys.executable, "-m", "orchestrator", "status", "--state-dir", str(tmp_path)],
                         capture_output=True, text=True)
    assert out.returncode == 1
    assert "no daemon" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def _plant_stale_open_mpi_session_dirs(tmpdir, count: int) -> None:
    """What a SIGKILLed mpirun leaves in TMPDIR (ompi.<pid> with PMIx rendezvous files),
    for each of the next `count` pids the kernel will hand out."""
    pid_max = int(open("/proc/sys/kernel/pid_max").read())
    last = int(open("/proc/sys/kernel/ns_last_pid").read())
    for i in range(1, count + 1):
        pid = last + i
        if pid >= pid_max:  # the kernel wraps to 300 (pids below are reserved)
            pid = 300 + pid - pid_max
        d = tmpdir / f"ompi.{pid}"
        d.mkdir(mode=0o700)
        for name in (f"pmix.vm.tool.prterun-vm-{pid}@0", f"pmix.vm.tool.{pid}", "pmix.vm.tool"):
            (d / name).write_text("stale\n")


def test_stale_open_mpi_session_dirs_in_tmp_do_not_stop_a_launch(orch_run, tmp_path):
    """A group runs under a TMPDIR of its own: the stale session dirs that SIGKILLed
    mpiruns leave in the host's TMPDIR (in the shared one, an mpirun that drew a
    recycled pid died at once: "PMIx server's listener thread failed to start") do
    not stop a launch nor a restart, and a stopped group leaves none behind."""
    host_tmp = tmp_path / "host-tmp"
    host_tmp.mkdir()
    _plant_stale_open_mpi_session_dirs(host_tmp, 1500)
    planted = {p.name for p in host_tmp.iterdir()}
    run = orch_run(env_extra={"TMPDIR": str(host_tmp)}).start()
    status = run.status()
    assert [i["restarts"] for i in status["instances"]] == [0, 0]

    # A failed group is SIGKILLed whole, mpirun included: the restart gets a clean TMPDIR.
    daemon = psutil.Process(status["daemon"]["pid"])
    mpirun = next(c for c in daemon.children() if c.environ().get("TRTLLM_ORCH_INSTANCE") == "0")
    scratch = run.state_dir / "instances" / "0" / "tmp"
    assert environ(mpirun.pid)["TMPDIR"] == str(scratch)
    assert (scratch / f"ompi.{mpirun.pid}").is_dir()
    rank1 = next(p for p in tagged(run.state_dir) if p.name() == "tritonserver"
                 and environ(p.pid)["TRTLLM_ORCH_INSTANCE"] == "0" and "--allow-http=false" in p.cmdline())
    rank1.kill()
    status = run.wait_for(lambda s: s["instances"][0]["restarts"] == 1 and s["ready"] == 2, timeout=90,
                          what="instance 0 restarted and ready")
    assert not (scratch / f"ompi.{mpirun.pid}").exists()
    code, body = post(run.url("/v2/models/ensemble/generate"))
    assert code == 200 and body["text_output"]

    out = run.down()
    assert out.returncode == 0, out.stderr
    assert {p.name for p in host_tmp.iterdir()} == planted
    assert not list(run.state_dir.glob("instances/*/tmp"))
