"""Issue 11 end to end: errors classified, stall detection, the hold (no failed
request while the only instance restarts), on the TRT-LLM twin through the real CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from tests.harness import REPO
from tests.test_e2e_faults import Load, alive, post, rank_proc

pytestmark = pytest.mark.e2e

GEN = "/v2/models/ensemble/generate"


def twin_repo(tmp_path, name: str, **values) -> str:
    out = tmp_path / name
    pairs = ",".join(f"{k}:{v}" for k, v in values.items())
    subprocess.run([sys.executable, str(REPO / "demo" / "fill_template.py"), "--repo", str(out), pairs],
                   check=True, capture_output=True)
    return str(out)


def body(text: str = "hello", max_tokens: int = 2) -> bytes:
    return json.dumps({"text_input": text, "max_tokens": max_tokens, "bad_words": "", "stop_words": ""}).encode()


def metric(port: int, name: str, **labels) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_queue_full_is_retried_on_the_other_instance_without_blame(orch_run, tmp_path):
    # One engine slot and a queue of one per instance: two requests fill an instance.
    # The engine's queue limit alone: Triton's own queue policy (max_queue_size > 0) would
    # also refuse bursts and hold requests itself, so the engine might never fill.
    repo = twin_repo(tmp_path, "q", twin_engine_max_batch_size=1, twin_engine_max_queue_size=1,
                     twin_decode_ms=50)
    run = orch_run(gpus="0-1", tp=1, assume_gpus=2, model_repo=repo,
                   extra=("--lb-policy", "round-robin", "--outlier-failures", "1")).start()
    inst0 = run.status()["instances"][0]
    direct = f"http://127.0.0.1:{inst0['ports']['http']}{GEN}"
    # Fill instance 0 behind the proxy's back: the proxy cannot know it is full.
    fillers = [threading.Thread(target=post, args=(direct, body("fill", 60))) for _ in range(2)]
    for t in fillers:
        t.start()
    deadline = time.monotonic() + 10
    while metric(inst0["ports"]["metrics"], "twin_executor_queued_requests") < 1:
        assert time.monotonic() < deadline, "instance 0 never filled"
        time.sleep(0.05)
    code, text = post(direct, body("one too many"))
    # TRT-LLM's INTERNAL error naming the queue; through the ensemble Triton answers 400.
    assert code in (400, 500) and b"Maximum queue size of 1 has been reached" in text, (code, text)
    results = [post(run.url(GEN), body(f"q{i}")) for i in range(4)]  # round robin: 2 land on instance 0
    assert [c for c, _ in results] == [200] * 4, results
    retries = metric(run.metrics_port, "trtllm_orch_proxy_retries_total", instance="0", reason="queue_full")
    assert retries >= 1
    status = run.status()
    # outlier-failures=1: a single blamed failure would have ejected it.
    assert [i["state"] for i in status["instances"]] == ["READY", "READY"]
    assert status["instances"][0]["passive"]["consecutive_failures"] == 0
    assert status["instances"][0]["restarts"] == 0
    for t in fillers:
        t.join(30)


def test_a_4xx_does_not_count_against_the_instance(orch_run):
    run = orch_run(gpus="0-1", tp=1, assume_gpus=2, extra=("--outlier-failures", "2")).start()
    for _ in range(6):
        code, _ = post(run.url(GEN), json.dumps({"max_tokens": 2}).encode())  # no text_input
        assert 400 <= code < 500, code
    status = run.status()
    assert [i["state"] for i in status["instances"]] == ["READY", "READY"]
    assert all(i["passive"]["consecutive_failures"] == 0 for i in status["instances"])
    assert "ejected" not in run.daemon_log()


def test_a_stalled_engine_is_restarted(orch_run):
    # Rank 1's server stopped: the group's engine freezes while /ready stays 200. Probes
    # cannot see it and the periodic canary is off, so only the engine monitor can.
    run = orch_run(extra=("--stall-after-s", "1", "--canary-interval-s", "0", "--canary-deadline-s", "2",
                          "--probe-interval-s", "0.5")).start()
    before = {i["id"]: i["pids"] for i in run.status()["instances"]}
    stopped = rank_proc(run, "0", 1)
    with Load(run, threads=4) as load:
        time.sleep(0.5)
        os.kill(stopped.pid, signal.SIGSTOP)
        status = run.wait_for(lambda s: s["instances"][0]["restarts"] >= 1
                              and s["instances"][0]["state"] == "READY", 60, "instance 0 restarted")
        ok_at_restart = load.ok
        time.sleep(1.0)
    assert not alive(stopped)
    assert "iteration_counter stuck" in status["instances"][0]["last_failure"]
    assert status["instances"][1]["pids"] == before["1"] and status["instances"][1]["restarts"] == 0
    assert load.ok > ok_at_restart
    assert not load.failures, load.failures[:5]


@pytest.mark.parametrize("front", ["aiohttp", "compiled"])
def test_one_instance_kill_under_load_fails_no_request(orch_run, front):
    """With the compiled front too: a request that finds the only instance dead goes to aiohttp,
    which holds it until the restarted instance is ready."""
    run = orch_run(gpus="0-1", tp=2, assume_gpus=2, extra=("--front", front)).start()
    victim = rank_proc(run, "0", 1)
    with Load(run, threads=4) as load:
        time.sleep(1.0)
        os.kill(victim.pid, signal.SIGKILL)
        run.wait_for(lambda s: s["instances"][0]["restarts"] >= 1 and s["instances"][0]["state"] == "READY",
                     60, "the only instance restarted")
        ok_at_restart = load.ok
        time.sleep(1.0)
    assert load.ok > ok_at_restart > 0
    assert not load.failures, f"{len(load.failures)} failed of {load.ok + len(load.failures)}: {load.failures[:5]}"


def test_a_hold_past_its_deadline_is_503_with_retry_after(orch_run, tmp_path):
    repo = twin_repo(tmp_path, "slow", twin_engine_load_time_s=5)
    run = orch_run(gpus="0-1", tp=2, assume_gpus=2, model_repo=repo, extra=("--hold-s", "0.5")).start(timeout=120)
    os.kill(rank_proc(run, "0", 1).pid, signal.SIGKILL)
    run.wait_for(lambda s: s["instances"][0]["state"] != "READY", 30, "instance 0 out of rotation")
    started = time.monotonic()
    req = urllib.request.Request(run.url(GEN), data=body(), headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    waited = time.monotonic() - started
    assert err.value.code == 503 and err.value.headers.get("Retry-After")
    assert 0.4 <= waited < 4.0, waited
