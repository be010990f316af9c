"""Live restore with `--proxy nginx`: the managed NGINX lives apart from the daemon, as the
data-plane workers do. A daemon killed, or detached for an upgrade, leaves it serving; the
next `up` adopts it instead of stopping it (real nginx, real tritonserver ranks under mpirun,
the TRT-LLM twin).

Before, the next `up` refused to start ("--listen: address in use ... (nginx)": the port
check knew the master as a leftover, not its workers, which hold the sockets too); with the
check mended it would have stopped NGINX and started another, refusing connections between.
"""

from __future__ import annotations

import os
import signal
import time
import urllib.request

import psutil
import pytest

from tests.test_e2e_faults import Load
from tests.test_e2e_live_restore import (Loop, Streams, engine_pids, grpc_client, kill_and_up_under_load, kill_daemon,
                                         openai_client, worker_pids)
from tests.test_e2e_proxy import generate

pytestmark = pytest.mark.e2e


def nginx_of(status: dict) -> dict:
    (proxy,) = status["proxies"]
    assert proxy["kind"] == "nginx"
    return proxy


def side_worker_pids(status: dict) -> list[int]:
    """NGINX mode's side workers (controlplane/side_workers.py)."""
    return sorted(w["pid"] for w in nginx_of(status)["side"]["workers"])


def master_and_workers(master: int) -> list[int]:
    """The master and its workers, while it runs."""
    try:
        proc = psutil.Process(master)
        return [master, *(c.pid for c in proc.children(recursive=True))]
    except psutil.Error:
        return []


def health_client(run) -> Loop:
    """What a load balancer in front polls: /v2/health/ready must stay 200 throughout."""
    def once() -> None:
        with urllib.request.urlopen(run.url("/v2/health/ready"), timeout=10) as resp:
            assert resp.status == 200
        time.sleep(0.02)
    return Loop(once)


def gone(pids: list[int]) -> bool:
    return not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)


def test_kill_9_of_the_daemon_leaves_nginx_serving_and_the_next_up_adopts_it(orch_run):
    run = orch_run(gpus="0-1", tp=1, assume_gpus=2, proxy="nginx", extra=("--proxy-workers", "2")).start()
    before = run.status()
    master, engines, side_workers = nginx_of(before)["pid"], engine_pids(before), side_worker_pids(before)
    assert len(side_workers) == 2  # as many as NGINX's workers
    clients = [Streams(run, tokens=8), grpc_client(run), health_client(run), openai_client(run)]
    load, adopted_in = kill_and_up_under_load(run, clients)  # the same ports again
    after = run.status()
    proxy = nginx_of(after)
    streams, grpc_loop, health, openai_loop = clients
    assert load.failures == [], load.failures[:5]
    assert streams.cut == [] and grpc_loop.failures == [], (streams.cut[:3], grpc_loop.failures[:3])
    # /v1/ too: its side workers live apart from the daemon (before, the daemon served it: 503 while away)
    assert openai_loop.failures == [] and openai_loop.ok, openai_loop.failures[:3]
    assert side_worker_pids(after) == side_workers
    # the new daemon's ready set is empty until its probes pass: NGINX's health answer keeps the last one's
    assert health.failures == [], health.failures[:3]
    assert streams.done and grpc_loop.ok and health.ok
    assert proxy["pid"] == master and proxy["adopted"] and proxy["state"] == "running"
    assert proxy["reloads"] == 0  # the config rendered again is the same: no reload closed a connection
    text = run.cli("status", "--state-dir", str(run.state_dir), check=True).stdout
    assert f"nginx running  pid {master}  restarts 0  (adopted: started by the daemon before this one)" in text
    assert "side workers running  2/2 workers" in text
    assert engine_pids(after) == engines
    assert "nginx: adopting master pid" in run.daemon_log()
    print(f"nginx adopted, instances ready {adopted_in:.2f} s after the new up; {load.ok} HTTP, {streams.done} "
          f"streams, {grpc_loop.ok} gRPC, {openai_loop.ok} OpenAI, 0 failed")
    # (after `down`, the fixture finds no process of the run left: nginx's included, harness.nginx_processes)


def test_a_detached_daemon_leaves_nginx_and_an_adopted_master_that_dies_is_replaced(orch_run):
    """SIGUSR2 (an upgrade under systemd) detaches and leaves NGINX serving; the next daemon
    adopts it. That master is not its child and its listening sockets are not the daemon's:
    when it dies its orphaned workers are retired, the addresses bound again and a new
    master started on them."""
    run = orch_run(gpus="0-1", tp=1, assume_gpus=2, proxy="nginx").start()
    master, side_workers = nginx_of(run.status())["pid"], side_worker_pids(run.status())
    os.kill(run.status()["daemon"]["pid"], signal.SIGUSR2)
    run.proc.wait(timeout=30)
    assert run.proc.returncode == 75  # detached: Restart= starts the next daemon
    assert psutil.pid_exists(master) and all(psutil.pid_exists(p) for p in side_workers)
    run.start()
    assert nginx_of(run.status())["pid"] == master and side_worker_pids(run.status()) == side_workers
    old = master_and_workers(master)
    with Load(run, threads=2) as across:
        time.sleep(0.5)
        os.kill(master, signal.SIGKILL)
        st = run.wait_for(lambda s: nginx_of(s)["state"] == "running" and nginx_of(s)["pid"] not in (None, master),
                          30, "a new nginx master")
        time.sleep(0.5)
    # The port refuses between the orphans closing their sockets and the new bind (and what waited
    # in their accept queue is reset): the price of a master whose sockets are not the daemon's.
    print(f"adopted master killed: {across.ok} HTTP ok, {len(across.failures)} failed: {across.failures[:3]}")
    assert across.ok
    proxy = nginx_of(st)
    assert not proxy["adopted"] and proxy["restarts"] >= 1
    with Load(run, threads=1) as load:
        time.sleep(1.0)
    assert load.ok and load.failures == [], load.failures[:5]
    deadline = time.monotonic() + 10  # the dead master's orphaned workers are retired (told to quit)
    while not gone(old) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(old), [p for p in old if psutil.pid_exists(p)]


def test_up_in_another_mode_after_a_kill_takes_over_none_of_the_other_data_plane(orch_run):
    """kill -9 of an embedded daemon, then `up --proxy nginx` on the same state dir and ports: the
    embedded workers, which hold the public socket, are swept, not adopted as side workers (they
    would have handed NGINX's port to the side workers), and NGINX serves. And back: NGINX and its
    side workers swept, not kept beside the new embedded workers."""
    run = orch_run(gpus="0-1", tp=1, assume_gpus=2, extra=("--proxy-workers", "2")).start()
    embedded = worker_pids(run.status())
    kill_daemon(run)
    run.args[run.args.index("--proxy") + 1] = "nginx"
    run.start()
    st = run.status()
    assert nginx_of(st)["state"] == "running" and not set(side_worker_pids(st)) & set(embedded)
    assert gone(embedded), embedded
    assert generate(run)[0] == 200
    assert "data plane: not adopted: its workers are embedded workers" in run.daemon_log()
    nginx = [nginx_of(st)["pid"], *side_worker_pids(st)]
    kill_daemon(run)
    run.args[run.args.index("--proxy") + 1] = "embedded"
    run.start()
    st = run.status()
    assert st["proxies"][0]["kind"] == "embedded" and gone(nginx), nginx
    assert generate(run)[0] == 200
