"""End-to-end checks of demo/model_repo on a real tritonserver.

Needs the `.triton/env` written by scripts/setup-triton (skipped otherwise).
One single-rank server is shared by the module; one 2-rank mpirun group checks
the rank coupling that hang-detection tests rely on.
"""
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.process

REPO = Path(__file__).resolve().parent.parent
MODEL_REPO = REPO / "demo" / "model_repo"
ENV_FILE = REPO / ".triton" / "env"

sys.path.insert(0, str(MODEL_REPO / "tensorrt_llm" / "1"))
import vocab  # noqa: E402

from tests.harness import free_port_block  # noqa: E402


def _triton_env():
    if not ENV_FILE.exists():
        pytest.skip(f"{ENV_FILE} missing: run scripts/setup-triton first")
    values = {}
    for line in ENV_FILE.read_text().splitlines():
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            values[key] = shlex.split(value)[0] if value else ""
    env = dict(os.environ)
    env.update(values)
    env.pop("DEMO_TOKEN_DELAY_MS", None)  # the tests assume the config default (20 ms)
    return env


def _free_ports(n):
    base = free_port_block(n)
    return list(range(base, base + n))


def _loopback_args(http, grpc, metrics):
    return [
        f"--http-port={http}", f"--grpc-port={grpc}", f"--metrics-port={metrics}",
        "--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1",
    ]


def _get_status(url):
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def _wait_ready(proc, base, log_path, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited rc={proc.returncode}:\n{Path(log_path).read_text()[-3000:]}")
        if _get_status(base + "/v2/health/ready") == 200:
            return
        time.sleep(0.1)
    raise AssertionError(f"not ready in {timeout}s:\n{Path(log_path).read_text()[-3000:]}")


def _stop(proc):
    """SIGTERM the process group, SIGKILL what is left after a grace period; then
    SIGKILL any process still tagged with the job's group dir (mpirun puts each rank
    in a process group of its own, and a rank's stub outlives a SIGKILLed rank)."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue
        # The process group may outlive its leader (stubs); make sure it is empty.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        break
    group_dir = getattr(proc, "group_dir", None)
    if group_dir:
        for p in _tagged(group_dir):
            p.kill()
    # A SIGKILLed Python-backend stub leaves its regions in /dev/shm (RAM).
    for path in Path("/dev/shm").glob(getattr(proc, "shm_glob", "") or "-"):
        path.unlink(missing_ok=True)


def _tagged(group_dir):
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("TRTLLM_ORCH_GROUP_DIR") == str(group_dir) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def _post(base, path, body, timeout=30):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _stream(base, body, timeout=30):
    """POST generate_stream; returns [(seconds since start, chunk dict)]."""
    req = urllib.request.Request(base + "/v2/models/ensemble/generate_stream", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    chunks = []
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            if line.startswith(b"data:"):
                chunks.append((time.monotonic() - t0, json.loads(line[5:])))
    return chunks


def _body(prompt, n, **extra):
    return {"text_input": prompt, "max_tokens": n, "bad_words": "", "stop_words": "", **extra}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    env = _triton_env()
    http, grpc, metrics = _free_ports(3)
    log_path = tmp_path_factory.mktemp("triton") / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [env["TRITONSERVER"], f"--model-repository={MODEL_REPO}", f"--backend-directory={env['BACKEND_DIR']}",
             *_loopback_args(http, grpc, metrics), "--disable-auto-complete-config"],
            env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
    base = f"http://127.0.0.1:{http}"
    try:
        _wait_ready(proc, base, log_path)
        yield {"http": base, "grpc": f"127.0.0.1:{grpc}"}
    finally:
        _stop(proc)


def test_generate_is_deterministic(server):
    a = _post(server["http"], "/v2/models/ensemble/generate", _body("hello world", 6))["text_output"]
    b = _post(server["http"], "/v2/models/ensemble/generate", _body("hello world", 6))["text_output"]
    c = _post(server["http"], "/v2/models/ensemble/generate", _body("another prompt", 6))["text_output"]
    assert a == b == vocab.generate_text("hello world", 6)
    assert len(a.split()) == 6
    assert c != a


def test_token_delay(server):
    t0 = time.monotonic()
    _post(server["http"], "/v2/models/ensemble/generate", _body("timing", 10))
    assert time.monotonic() - t0 >= 0.18


def test_generate_stream_one_chunk_per_token(server):
    chunks = _stream(server["http"], _body("stream me", 8, stream=True))
    assert len(chunks) == 8
    assert "".join(c["text_output"] for _, c in chunks) == vocab.generate_text("stream me", 8)
    # Tokens really are spread over time: 7 token delays between first and last.
    assert chunks[-1][0] - chunks[0][0] >= 0.12


def test_tensorrt_llm_grpc_streaming(server):
    import queue

    import numpy as np
    import tritonclient.grpc as grpcclient

    ids = np.array([list(b"grpc prompt")], dtype=np.int32)
    inputs = []
    for name, arr in (("input_ids", ids), ("input_lengths", np.array([[ids.shape[1]]], dtype=np.int32)),
                      ("request_output_len", np.array([[5]], dtype=np.int32)),
                      ("streaming", np.array([[True]], dtype=bool))):
        t = grpcclient.InferInput(name, list(arr.shape), "BOOL" if arr.dtype == bool else "INT32")
        t.set_data_from_numpy(arr)
        inputs.append(t)
    results = queue.Queue()
    client = grpcclient.InferenceServerClient(server["grpc"])
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer("tensorrt_llm", inputs, request_id="r1",
                                  outputs=[grpcclient.InferRequestedOutput("output_ids")])
        tokens = []
        for _ in range(5):
            result, error = results.get(timeout=10)
            assert error is None, error
            tokens += result.as_numpy("output_ids").reshape(-1).tolist()
    finally:
        client.stop_stream()
        client.close()
    assert tokens == vocab.next_tokens(list(b"grpc prompt"), 5)


def start_two_rank_group(tmp_path, instance):
    """mpirun with 2 leader-mode ranks of MODEL_REPO; returns (proc, http base, metrics port, log path)."""
    env = _triton_env()
    group_dir = tmp_path / "group"
    group_dir.mkdir(mode=0o700)
    # TMPDIR: Open MPI's session dir goes there, not into a /tmp shared with every
    # earlier run (a stale ompi.<pid> with a reused pid stops prterun from starting).
    (tmp_path / "mpi-tmp").mkdir()
    env.update(TRTLLM_ORCH_INSTANCE=str(instance), TRTLLM_ORCH_GROUP_DIR=str(group_dir),
               TMPDIR=str(tmp_path / "mpi-tmp"))
    http, grpc, metrics = _free_ports(3)
    common = [f"--model-repository={MODEL_REPO}", f"--backend-directory={env['BACKEND_DIR']}",
              "--disable-auto-complete-config"]
    cmd = [env["MPIRUN"], "--allow-run-as-root", "--oversubscribe",
           *[a for v in ("TRTLLM_ORCH_INSTANCE", "TRTLLM_ORCH_GROUP_DIR", "PYTHONPATH", "LD_LIBRARY_PATH")
             for a in ("-x", v)],
           "-n", "1", env["TRITONSERVER"], *common, *_loopback_args(http, grpc, metrics),
           f"--backend-config=python,shm-region-prefix-name=orch_t{instance}_r0_", "--id=rank0", ":",
           "-n", "1", env["TRITONSERVER"], *common, "--model-control-mode=explicit", "--load-model=tensorrt_llm",
           "--allow-http=false", "--allow-grpc=false", "--allow-metrics=false",
           f"--backend-config=python,shm-region-prefix-name=orch_t{instance}_r1_", "--id=rank1"]
    log_path = tmp_path / "mpirun.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    proc.group_dir, proc.shm_glob = group_dir, f"orch_t{instance}_r*"  # for _stop
    return proc, f"http://127.0.0.1:{http}", metrics, log_path


def test_two_rank_group_stalls_when_rank1_is_stopped(tmp_path):
    """Leader-mode group under mpirun: SIGSTOP of rank 1 stalls rank 0's
    generation while /v2/health/ready stays 200; SIGCONT lets it finish."""
    proc, base, _metrics, log_path = start_two_rank_group(tmp_path, 7)
    stopped = []
    try:
        _wait_ready(proc, base, log_path)
        assert _post(base, "/v2/models/ensemble/generate", _body("x", 3))["text_output"] == vocab.generate_text("x", 3)

        rank1 = _rank_pid(proc.pid, "--id=rank1")
        stopped = [rank1, *_children(rank1)]
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        with pytest.raises((TimeoutError, socket.timeout, urllib.error.URLError)):
            _post(base, "/v2/models/ensemble/generate", _body("stalled", 3), timeout=1.5)
        assert _get_status(base + "/v2/health/ready") == 200

        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        stopped = []
        assert _post(base, "/v2/models/ensemble/generate", _body("y", 3))["text_output"] == vocab.generate_text("y", 3)
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        _stop(proc)


def _children(pid):
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _rank_pid(mpirun_pid, marker):
    for pid in _children(mpirun_pid):
        if marker in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
            return pid
    raise AssertionError(f"no child of mpirun {mpirun_pid} with {marker!r}")
