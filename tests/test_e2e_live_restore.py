"""Issue 23 end to end: the daemon dies (kill -9) under load; engines and data-plane
workers go on serving; the next `up` on the same state directory adopts them (real
tritonserver ranks under mpirun, the TRT-LLM twin)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request

import psutil
import pytest

from tests.harness import free_port
from tests.test_e2e_faults import Load, alive

pytestmark = pytest.mark.e2e

STREAM = "/v2/models/ensemble/generate_stream"


class Streams(threading.Thread):
    """Closed-loop streamed generates (32 tokens at the twin's pace): each either
    completes (its final event came) or is counted as cut."""

    def __init__(self, run, tokens: int = 32) -> None:
        super().__init__(daemon=True)
        self.url = run.url(STREAM)
        self.body = json.dumps({"text_input": "a stream", "max_tokens": tokens, "stream": True,
                                "bad_words": "", "stop_words": ""}).encode()
        self.tokens = tokens
        self.done = 0
        self.cut: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                req = urllib.request.Request(self.url, data=self.body, headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=30) as resp:
                    events = sum(1 for line in resp if line.startswith(b"data:"))
                if events >= 1 and resp.status == 200:
                    self.done += 1
                else:
                    self.cut.append(f"{resp.status}: {events} events")
            except Exception as exc:  # noqa: BLE001: every way a stream can end badly counts
                self.cut.append(repr(exc))


class Loop(threading.Thread):
    """One client calling `once()` in a loop; every exception or wrong answer is a failure."""

    def __init__(self, once) -> None:
        super().__init__(daemon=True)
        self.once = once
        self.ok = 0
        self.failures: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.once()
                self.ok += 1
            except Exception as exc:  # noqa: BLE001: any way a call can fail counts
                self.failures.append(repr(exc)[:200])


def grpc_client(run) -> Loop:
    """Unary ModelInfer through the endpoint's gRPC port (the preprocessing model)."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{run.grpc_port}")

    def once() -> None:
        inputs = []
        for name, value, dtype in (("QUERY", b"grpc", "BYTES"), ("REQUEST_OUTPUT_LEN", 2, "INT32"),
                                   ("BAD_WORDS_DICT", b"", "BYTES"), ("STOP_WORDS_DICT", b"", "BYTES")):
            arr = np.array([[value]], dtype=object if dtype == "BYTES" else np.int32)
            t = grpcclient.InferInput(name, list(arr.shape), dtype)
            t.set_data_from_numpy(arr)
            inputs.append(t)
        res = client.infer("preprocessing", inputs, client_timeout=30)
        assert res.as_numpy("INPUT_ID").reshape(-1).tolist() == list(b"grpc")
    return Loop(once)


def openai_client(run, url: str = "") -> Loop:
    """/v1/completions in a loop, at the endpoint (or at `url`: the side workers' own listener)."""
    body = json.dumps({"model": "ensemble", "prompt": "an OpenAI call", "max_tokens": 4}).encode()
    url = url or run.url("/v1/completions")

    def once() -> None:
        req = urllib.request.Request(url, data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert json.loads(resp.read())["choices"][0]["text"]
    return Loop(once)


def engine_pids(status: dict) -> dict[str, int]:
    return {i["id"]: i["mpirun_pid"] for i in status["instances"]}


def worker_pids(status: dict) -> list[int]:
    return sorted(w["pid"] for w in status["proxies"][0]["workers"])


def kill_daemon(run) -> None:
    os.kill(run.status()["daemon"]["pid"], signal.SIGKILL)
    run.proc.wait(timeout=10)


def kill_and_up_under_load(run, clients: list) -> tuple[Load, float]:
    """HTTP load (2 threads) and `clients` running: kill -9 of the daemon, 2 s without one
    (something must be served then), the same `up` on the same state directory, 1 s more.
    Returns the load and how long the new `up` took to be ready."""
    with Load(run, threads=2) as load:
        for c in clients:
            c.start()
        time.sleep(1.0)
        kill_daemon(run)
        served_at_kill = load.ok
        time.sleep(2.0)  # no daemon: the data plane and the engines serve on their own
        assert load.ok > served_at_kill, "nothing was served while the daemon was away"
        t0 = time.monotonic()
        run.start()
        adopted_in = time.monotonic() - t0
        time.sleep(1.0)
        for c in clients:
            c.stop.set()
    for c in clients:
        c.join(60)
    return load, adopted_in


@pytest.mark.parametrize("front", ["aiohttp", "compiled"])
def test_kill_9_of_the_daemon_under_load_loses_nothing_and_the_next_up_adopts(orch_run, front):
    """With the compiled front too: its streams, the gRPC, OpenAI (handed to aiohttp) and native
    clients all go on while no daemon runs."""
    run = orch_run(gpus="0-3", tp=1, assume_gpus=4, extra=("--proxy-workers", "2", "--front", front)).start()
    before = run.status()
    engines, workers = engine_pids(before), worker_pids(before)
    clients = [Streams(run), Streams(run), grpc_client(run), openai_client(run)]
    load, adopted_in = kill_and_up_under_load(run, clients)
    after = run.status()
    streams, grpc_loop, openai_loop = clients[:2], clients[2], clients[3]
    assert load.failures == [], load.failures[:5]
    assert [s.cut for s in streams] == [[], []]
    assert grpc_loop.failures == [] and openai_loop.failures == [], (grpc_loop.failures[:3], openai_loop.failures[:3])
    assert all(c.done if isinstance(c, Streams) else c.ok for c in clients)
    assert engine_pids(after) == engines  # the same engines: nothing reloaded
    assert all(i["adopted"] and i["restarts"] == 0 and i["state"] == "READY" for i in after["instances"])
    assert worker_pids(after) == workers  # the same worker processes, still serving
    assert adopted_in < 15, adopted_in
    print(f"4 instances adopted and ready {adopted_in:.2f}s after the new up; {load.ok} HTTP, "
          f"{sum(s.done for s in streams)} streams, {grpc_loop.ok} gRPC, {openai_loop.ok} OpenAI requests, 0 failed")


def test_a_changed_config_is_adopted_then_replaced_one_at_a_time_under_load(orch_run):
    """A new launch command on the same GPUs and ports (here one more tritonserver argument):
    the groups are adopted and serve, then a rolling restart relaunches them one at a time,
    so some instance is ready all along and no request fails."""
    run = orch_run(gpus="0-1", tp=1, assume_gpus=2).start()
    engines = engine_pids(run.status())
    with Load(run, threads=2) as load:
        time.sleep(0.5)
        kill_daemon(run)
        run.args += ["--tritonserver-arg=--log-verbose=0"]  # a different launch command
        run.start(wait_ready=False)
        ready_while_replacing: list[int] = []

        def replaced(st: dict) -> bool:
            ready = sum(i["state"] == "READY" for i in st["instances"])
            # An adopted instance in STARTING is being checked by the new daemon (~20 ms after
            # it starts), not stopped: it serves all along. A status read in that window saw
            # 0 READY in 1 of ~10 runs, before anything was replaced.
            checking = any(i["adopted"] and i["state"] == "STARTING" for i in st["instances"])
            if not checking and (any(i["adopted"] for i in st["instances"]) or ready < 2):
                ready_while_replacing.append(ready)
            return ready == 2 and not set(engine_pids(st).values()) & set(engines.values())

        run.wait_for(replaced, 120, "every engine replaced and READY")
        fewest_ready = min(ready_while_replacing, default=2)
    log = run.daemon_log()
    print(f"\nchanged config: fewest ready while replacing {fewest_ready}; {load.ok} HTTP ok, "
          f"{len(load.failures)} failed")
    assert "launch command differs" in log and "replaced by a rolling restart once adopted" in log, log[-3000:]
    assert "rolling restart (adopted with an older launch command): 2 instance(s), one at a time" in log
    assert fewest_ready >= 1  # never all out at once
    assert load.failures == [], load.failures[:5]
    assert not any(alive(psutil.Process(p)) for p in engines.values() if psutil.pid_exists(p))


def test_a_half_dead_group_is_cleaned_up_and_restarted_the_rest_adopted(orch_run):
    run = orch_run(gpus="0-3", tp=2, assume_gpus=4).start()
    engines = engine_pids(run.status())
    kill_daemon(run)
    ranks = [p for p in psutil.Process(engines["1"]).children(recursive=True) if p.name() == "tritonserver"]
    ranks[-1].kill()  # one rank of instance 1 dies while no daemon watches
    time.sleep(0.5)
    run.start()
    after = {i["id"]: i for i in run.status()["instances"]}
    assert after["0"]["adopted"] and after["0"]["mpirun_pid"] == engines["0"]
    assert not after["1"]["adopted"] and after["1"]["mpirun_pid"] != engines["1"]
    # mpirun ends the job when a rank dies (Open MPI); a rank left without its mpirun is
    # swept by its tag. Either way the group is not adopted, and the log says why.
    assert "live restore: instance 1: not adopted:" in run.daemon_log()


def test_down_without_a_daemon_stops_everything_it_left(orch_run):
    run = orch_run(gpus="0-1", tp=1, assume_gpus=2, extra=("--proxy-workers", "2")).start()
    status = run.status()
    left = list(engine_pids(status).values()) + worker_pids(status)
    kill_daemon(run)
    assert all(psutil.pid_exists(p) for p in left)  # they outlived it
    out = run.down()
    assert out.returncode == 0, out.stderr
    assert not [p for p in left if psutil.pid_exists(p) and alive(psutil.Process(p))]


def test_a_state_file_that_cannot_be_read_adopts_nothing_and_sweeps(orch_run):
    run = orch_run(gpus="0-1", tp=1, assume_gpus=2).start()
    engines = engine_pids(run.status())
    kill_daemon(run)
    (run.state_dir / "state.json").write_text('{"instances": [1, 2')  # cut mid-write
    run.start()
    after = engine_pids(run.status())
    assert not set(after.values()) & set(engines.values())
    assert not any(psutil.pid_exists(p) and alive(psutil.Process(p)) for p in engines.values())


def test_upgrade_replaces_the_daemon_and_adopts_under_load(orch_run):
    run = orch_run(gpus="0-1", tp=1, assume_gpus=2, extra=("--proxy-workers", "2")).start()
    before = run.status()
    streams = [Streams(run)]
    with Load(run, threads=3) as load:
        streams[0].start()
        time.sleep(0.5)
        out = run.cli("upgrade", "--state-dir", str(run.state_dir), timeout=120)
        assert out.returncode == 0, out.stderr
        assert run.proc.wait(timeout=10) == 75  # the old daemon detached
        time.sleep(0.5)
        streams[0].stop.set()
    streams[0].join(60)
    after = run.status()
    assert "upgraded: daemon pid" in out.stdout and "2/2 instances adopted" in out.stdout, out.stdout
    assert after["daemon"]["pid"] != before["daemon"]["pid"] and after["daemon"]["version"]
    assert engine_pids(after) == engine_pids(before) and worker_pids(after) == worker_pids(before)
    assert load.failures == [] and streams[0].cut == []
    assert run.cli("down", "--state-dir", str(run.state_dir), timeout=120).returncode == 0


def test_a_daemon_upgrade_started_and_nobody_stopped_is_a_leak_the_harness_kills_first(orch_run):
    """The harness's leak check (tests/harness.Run.close) finds what the daemon started by its
    tag; a daemon `upgrade` started carries none. Left running, it started again everything the
    check killed (live_restore_bench's upgrade case left a daemon and its engines behind so)."""
    from tests.harness import daemons, tagged
    run = orch_run(gpus="0", tp=1, assume_gpus=1).start()
    assert run.cli("upgrade", "--state-dir", str(run.state_dir), timeout=120).returncode == 0
    assert run.proc.wait(timeout=10) == 75
    upgraded = daemons(run.state_dir)
    assert len(upgraded) == 1
    leaked = run.close()  # no `down`: what a failed test leaves
    assert upgraded[0].pid in leaked and len(leaked) > 1
    time.sleep(2.0)  # long enough for a surviving daemon to have started a group again
    assert daemons(run.state_dir) == [] and tagged(run.state_dir) == []


def test_sigusr2_detaches_and_leaves_everything_serving(orch_run):
    run = orch_run(gpus="0-1", tp=1, assume_gpus=2).start()
    before = run.status()
    os.kill(before["daemon"]["pid"], signal.SIGUSR2)
    assert run.proc.wait(timeout=30) == 75
    from tests.test_e2e_faults import post
    code, _ = post(run.url("/v2/models/ensemble/generate"))  # no daemon: still served
    assert code == 200
    assert json.loads((run.state_dir / "state.json").read_text())["instances"]
    run.start()
    assert engine_pids(run.status()) == engine_pids(before)


def rank_of(mpirun_pid: int) -> psutil.Process:
    """The tritonserver of a TP1 group (its one rank)."""
    ranks = [p for p in psutil.Process(mpirun_pid).children(recursive=True) if p.name() == "tritonserver"]
    assert len(ranks) == 1, ranks
    return ranks[0]


# While no daemon runs, only the data plane can see a hung instance: through its probes
# (away_probe.py, on by default) and, where set, --first-byte-timeout-s (each request it took
# is retried elsewhere and counts toward the workers' passive ejection). Round-robin sends the
# faulted instances their share (prefix-affinity kept this load's one prompt on one instance,
# least-outstanding avoids one whose requests pile up).
AWAY_FLAGS = ("--proxy-workers", "2", "--lb-policy", "round-robin",
              "--probe-interval-s", "0.5", "--probe-timeout-s", "0.5", "--probe-failures", "3")
AWAY_S = 12.0  # longer than a passive ejection (10 s): the hung instance is tried again


def faults_while_away(run) -> dict:
    """kill -9 of the daemon, then instance 1's rank is killed and instance 2's SIGSTOPped
    while none runs; `up` again. Checks what the next daemon does; returns the numbers."""
    engines = engine_pids(run.status())
    dead, hung, healthy = "1", "2", ("0", "3")
    streams = Streams(run, tokens=8)
    with Load(run, threads=2) as load:
        streams.start()
        time.sleep(1.0)
        kill_daemon(run)
        rank_of(engines[dead]).kill()
        hung_rank = rank_of(engines[hung])
        hung_rank.suspend()  # SIGSTOP: mpirun and the rank alive, nothing answers
        at_fault = load.ok
        time.sleep(AWAY_S)
        served_away = load.ok - at_fault
        t0 = time.monotonic()
        run.start(wait_ready=False)
        run.wait_for(lambda s: all(i["state"] == "READY" for i in s["instances"] if i["id"] in healthy),
                     timeout=30, what="the healthy instances adopted")
        adopted_s = time.monotonic() - t0
        after = run.wait_ready(timeout=90)
        healed_s = time.monotonic() - t0
        time.sleep(1.0)  # served by the healed set
        streams.stop.set()
    streams.join(60)
    by_id = {i["id"]: i for i in after["instances"]}
    log = run.daemon_log()
    print(f"away {AWAY_S:g} s: {served_away} HTTP served; healthy adopted {adopted_s:.2f}s, all 4 READY "
          f"{healed_s:.2f}s after the new up; {load.ok} HTTP ok, {len(load.failures)} failed; "
          f"{streams.done} streams, {len(streams.cut)} cut: {streams.cut[:3]}")
    assert load.failures == [], load.failures[:5]
    # A stream whose bytes reached the client ends with its instance (docs/health.md):
    # the one stream client has at most one in flight on each faulted instance.
    assert len(streams.cut) <= 2, streams.cut
    assert all(i["state"] == "READY" for i in after["instances"]), after
    for iid in healthy:  # the same engines, adopted, never restarted
        assert by_id[iid]["mpirun_pid"] == engines[iid] and by_id[iid]["adopted"], by_id[iid]
        assert by_id[iid]["restarts"] == 0, by_id[iid]
    assert by_id[dead]["mpirun_pid"] != engines[dead] and not by_id[dead]["adopted"]
    # Open MPI ends the job when its rank dies, but on a loaded machine its mpirun was once
    # still there 12 s later: then its group is half-dead. Either way, not adopted.
    assert f"instance {dead}: not adopted: mpirun pid {engines[dead]} is gone" in log or \
        f"instance {dead}: not adopted: half-dead: 0 of 1 tritonserver ranks alive" in log, log[-3000:]
    # Adoptable (mpirun and its rank alive), but silent: not ready within the probes'
    # budget (3 x (0.5 + 0.5) s), torn down and launched again.
    assert by_id[hung]["mpirun_pid"] != engines[hung] and not by_id[hung]["adopted"]
    assert "adopted, but not ready within 3s" in by_id[hung]["last_failure"], by_id[hung]
    assert not alive(hung_rank)  # the stopped rank was killed, not left behind
    assert healed_s < 60, healed_s
    return {"served_away": served_away, "adopted_s": adopted_s, "healed_s": healed_s}


def test_faults_while_no_daemon_runs_are_healed_by_the_next_up(orch_run):
    """With --first-byte-timeout-s the workers route around both faults on their own."""
    run = orch_run(gpus="0-3", tp=1, assume_gpus=4, extra=AWAY_FLAGS + ("--first-byte-timeout-s", "5")).start()
    numbers = faults_while_away(run)
    assert numbers["served_away"] > 0, "nothing was served while the daemon was away"


def test_a_hang_while_no_daemon_runs_is_probed_out_by_the_workers(orch_run):
    """Default settings (no first-byte timeout): the workers' own probes (away_probe.py) take
    the SIGSTOPped instance out and fail what waits on it over to the others. Before them
    the hung instance kept its round-robin share and both load threads got stuck there:
    measured, 2 requests served in the 12 s away instead of ~80."""
    run = orch_run(gpus="0-3", tp=1, assume_gpus=4, extra=AWAY_FLAGS).start()
    numbers = faults_while_away(run)
    assert numbers["served_away"] >= 20, numbers
    log = "".join(p.read_text(errors="replace") for p in (run.state_dir / "dataplane").glob("worker-*.log"))
    assert "instance 2 failed 3 probes in a row with no daemon" in log, log[-2000:]


# The release before this one: the last submission that landed (stop 29). Its daemon,
# engines and workers run the old code; `upgrade` from this code takes them over.
LAST_LANDED = "5a01d03"


def test_upgrade_from_the_last_landed_release_adopts_everything_under_load(orch_run, tmp_path):
    """A package upgrade: the old release's code as an installed package would be (on the
    path ahead of this one, not the working directory), started with `up`; `upgrade` run by
    this code detaches it and starts this code's daemon, which adopts the old release's
    engines and data-plane workers."""
    import subprocess
    import sys

    from tests.harness import REPO
    old = tmp_path / "old-release"
    old.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", LAST_LANDED, "orchestrator"],
                             capture_output=True)
    if archive.returncode != 0:
        pytest.skip(f"release {LAST_LANDED} not in this clone's history: {archive.stderr[-200:]!r}")
    subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True)
    run = orch_run(gpus="0-1", tp=1, assume_gpus=2, extra=("--proxy-workers", "2"))
    old_env = {**run.env, "PYTHONPATH": os.pathsep.join([str(old), run.env["PYTHONPATH"]])}
    run._log = open(run.log_path, "wb")
    run.proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "up", *run.args], env=old_env,
                                cwd=tmp_path, stdout=run._log, stderr=subprocess.STDOUT, start_new_session=True)
    run.wait_ready(90)
    before = run.status()
    workers_code = {psutil.Process(pid).environ().get("PYTHONPATH", "").split(os.pathsep)[0]
                    for pid in worker_pids(before)}
    assert workers_code == {str(old)}, workers_code  # the old release serves
    streams = Streams(run)
    with Load(run, threads=3) as load:
        streams.start()
        time.sleep(0.5)
        out = run.cli("upgrade", "--state-dir", str(run.state_dir), timeout=120)
        assert out.returncode == 0, out.stderr
        assert run.proc.wait(timeout=10) == 75  # the old daemon detached
        time.sleep(1.0)
        streams.stop.set()
    streams.join(60)
    after = run.status()
    new_daemon = psutil.Process(after["daemon"]["pid"])
    print(f"\nupgrade {LAST_LANDED} -> this code: {out.stdout.strip()}; {load.ok} HTTP ok, "
          f"{len(load.failures)} failed; {streams.done} streams, {len(streams.cut)} cut")
    assert str(old) not in new_daemon.environ().get("PYTHONPATH", "")  # this code took over
    assert "2/2 instances adopted" in out.stdout, out.stdout
    assert engine_pids(after) == engine_pids(before) and worker_pids(after) == worker_pids(before)
    assert all(i["restarts"] == 0 and i["state"] == "READY" for i in after["instances"]), after["instances"]
    assert load.failures == [] and streams.cut == [], (load.failures[:3], streams.cut[:3])
    assert run.cli("down", "--state-dir", str(run.state_dir), timeout=120).returncode == 0


def test_proxy_none_serves_v1_from_workers_that_outlive_the_daemon(orch_run):
    """`--proxy none --openai-listen` (where a system NGINX sends /v1/, render-nginx): the daemon
    runs side workers there (controlplane/side_workers.py), not a listener in its own process:
    a kill -9 of the daemon leaves them serving and the next `up` adopts them."""
    port = free_port()
    run = orch_run(gpus="0-1", tp=1, assume_gpus=2, proxy="none",
                   extra=("--openai-listen", f"127.0.0.1:{port}", "--proxy-workers", "2")).start()
    workers = worker_pids(run.status())
    assert len(workers) == 2
    client = openai_client(run, f"http://127.0.0.1:{port}/v1/completions")
    client.start()
    time.sleep(1.0)
    kill_daemon(run)
    served_at_kill = client.ok
    time.sleep(2.0)
    assert client.ok > served_at_kill, "/v1/ was not served while the daemon was away"
    run.start()
    time.sleep(1.0)
    client.stop.set()
    client.join(60)
    assert client.failures == [] and client.ok, client.failures[:3]
    assert worker_pids(run.status()) == workers  # the same processes, adopted
    text = run.cli("status", "--state-dir", str(run.state_dir), check=True).stdout
    assert "side workers running  2/2 workers" in text
    print(f"--proxy none: {client.ok} OpenAI requests across the daemon's kill, 0 failed")
    # (after `down`, the fixture finds no process of the run left)
