"""The public endpoint end to end, in both proxy modes (embedded aiohttp + gRPC, managed nginx).

One real daemon per mode (`--gpus 0-1 --tp 1 --assume-gpus 2`: two instances), shared by
the module; every check looks from outside: HTTP/gRPC through `--listen`/`--grpc-listen`,
Triton's own metrics and readiness read DIRECTLY on each instance's loopback ports, and
`status` over the control socket. The destructive cases come last in the file (pytest runs
the module's tests in file order for each mode): kill instance 0 (`--max-failures 1`
keeps it FAILED, so every request must land on instance 1), then kill instance 1 (no
instance ready: 503 / UNAVAILABLE). The daemon runs with `--canary-interval-s 0` so
that the only inferences Triton counts are the test's own.
"""

from __future__ import annotations

import http.client
import json
import queue
import re
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from tests.harness import DEMO_REPO, Run, triton_env

pytestmark = pytest.mark.e2e

sys.path.insert(0, str(DEMO_REPO / "tensorrt_llm" / "1"))
import vocab  # noqa: E402

NGINX = "/usr/sbin/nginx"
MAX_BODY = 65536
EXTRA = ("--max-body-bytes", str(MAX_BODY), "--max-failures", "1", "--canary-interval-s", "0",
         "--stop-grace-s", "3")
GEN_PATH = "/v2/models/ensemble/generate"
STREAM_PATH = "/v2/models/ensemble/generate_stream"


def body(prompt: str = "hello", n: int = 3, **extra) -> bytes:
    return json.dumps({"text_input": prompt, "max_tokens": n, "bad_words": "", "stop_words": "",
                       **extra}).encode()


def request(url: str, data: bytes | None = None, method: str | None = None,
            timeout: float = 30) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"} if data is not None else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def generate(run: Run, prompt: str = "hello", n: int = 3) -> tuple[int, bytes]:
    code, _, data = request(run.url(GEN_PATH), body(prompt, n))
    return code, data


def success_counts(metrics_port: int, model: str = "ensemble") -> float:
    """Sum of Triton's nv_inference_request_success for one model, read from the instance."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    total = 0.0
    for m in re.finditer(r'^nv_inference_request_success\{([^}]*)\} (\S+)$', text, re.M):
        if f'model="{model}"' in m.group(1):
            total += float(m.group(2))
    return total


def per_instance(run: Run, model: str = "ensemble", ids=None) -> dict[str, float]:
    return {i["id"]: success_counts(i["ports"]["metrics"], model) for i in run.status()["instances"]
            if ids is None or i["id"] in ids}


def wait_counts(run: Run, before: dict[str, float], expected_total: int, timeout: float = 5,
                model: str = "ensemble") -> dict[str, float]:
    """Per-instance deltas once their sum reached expected_total (Triton updates counters at completion)."""
    deadline = time.monotonic() + timeout
    while True:
        after = per_instance(run, model, ids=set(before))
        delta = {k: after[k] - before[k] for k in before}
        if sum(delta.values()) >= expected_total or time.monotonic() > deadline:
            return delta
        time.sleep(0.1)


def direct_ready(inst: dict) -> int:
    code, _, _ = request(f"http://127.0.0.1:{inst['ports']['http']}/v2/models/ensemble/ready", timeout=5)
    return code


def rank0(run: Run, iid: str) -> psutil.Process:
    """The instance's tritonserver rank 0, found by the environment every rank carries."""
    for proc in psutil.process_iter(["name"]):
        try:
            if proc.info["name"] != "tritonserver":
                continue
            env = proc.environ()
            if env.get("TRTLLM_ORCH_STATE_DIR") == str(run.state_dir) and env.get("TRTLLM_ORCH_INSTANCE") == iid \
                    and "--http-port" in " ".join(proc.cmdline()):
                return proc
        except (psutil.Error, OSError):
            continue
    raise AssertionError(f"no rank 0 of instance {iid}")


def wait_endpoint(run: Run, mode: str, backends: int, timeout: float = 30) -> None:
    """The endpoint's own /v2/health/ready agrees with the ready set (nginx: after its reload)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        code, _, data = request(run.url("/v2/health/ready"), timeout=5)
        last = (code, data)
        if code == 200 and (mode == "embedded" or json.loads(data).get("backends") == backends):
            return
        time.sleep(0.1)
    raise AssertionError(f"endpoint not ready with {backends} backend(s) in {timeout}s: {last}")


# --- raw sockets ---------------------------------------------------------------------------
def raw(port: int, data: bytes, *, shut_wr: bool = False, timeout: float = 10) -> tuple[int | None, bytes]:
    """Send bytes, read until the server closes. (status or None, bytes). A hang is a failure."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    buf = b""
    try:
        try:
            s.sendall(data)
            if shut_wr:
                s.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server may answer and close before taking all of it
        deadline = time.monotonic() + timeout
        while True:
            if time.monotonic() > deadline:
                raise AssertionError(f"server kept the connection open without closing it: {buf[:300]!r}")
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                raise AssertionError(f"server neither answered nor closed: {buf[:300]!r}") from None
            except ConnectionResetError:
                break
            if not chunk:
                break
            buf += chunk
    finally:
        s.close()
    m = re.match(rb"HTTP/1\.[01] (\d{3})", buf)
    return (int(m.group(1)) if m else None), buf


def assert_4xx_or_closed(what: str, status: int | None, data: bytes) -> None:
    assert status is None or 400 <= status < 500, f"{what}: {status} {data[:300]!r}"
    if status is None:
        assert data == b"", f"{what}: garbage instead of an HTTP answer: {data[:300]!r}"


# --- the daemon, one per mode ------------------------------------------------------------------
@pytest.fixture(scope="module", params=["embedded", "nginx"])
def orch(request, tmp_path_factory):
    if triton_env() is None:
        pytest.skip("no .triton/env: run scripts/setup-triton (the README's test command does)")
    mode = request.param
    if mode == "nginx" and not Path(NGINX).exists():
        pytest.skip(f"{NGINX} missing")
    extra = EXTRA + (("--nginx", NGINX) if mode == "nginx" else ())
    run = Run(tmp_path_factory.mktemp(f"proxy-{mode}"), gpus="0-1", tp=1, assume_gpus=2, proxy=mode,
              extra=extra, env_extra={"DEMO_TOKEN_DELAY_MS": "20"})
    try:
        t0 = time.monotonic()
        run.start(timeout=120)
        wait_endpoint(run, mode, 2)
        print(f"\n[{mode}] daemon ready in {time.monotonic() - t0:.1f}s")
        yield mode, run
    finally:
        leaked = run.close()
    assert not leaked, f"processes left running after the {mode} daemon: {leaked}"


# --- 1. load balancing -----------------------------------------------------------------------
def test_generate_reaches_both_instances(orch):
    mode, run = orch
    before = per_instance(run)
    assert set(before) == {"0", "1"}
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: generate(run, f"prompt {i}", 3), range(40)))
    bad = [r for r in results if r[0] != 200]
    assert not bad, bad[:3]
    assert json.loads(results[7][1])["text_output"] == vocab.generate_text("prompt 7", 3)
    delta = wait_counts(run, before, 40)
    assert all(d > 0 for d in delta.values()), delta
    assert sum(delta.values()) == 40, delta
    print(f"\n[{mode}] 40 generates split {delta}")


# --- 2. streaming is not buffered ----------------------------------------------------------------
def test_generate_stream_first_chunk_early(orch):
    mode, run = orch
    conn = http.client.HTTPConnection("127.0.0.1", run.listen_port, timeout=30)
    try:
        t0 = time.monotonic()
        conn.request("POST", STREAM_PATH, body("stream me", 20, stream=True), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        assert resp.getheader("Content-Type", "").startswith("text/event-stream")
        chunks = []
        while True:
            line = resp.readline()
            if not line:
                break
            if line.startswith(b"data:"):
                chunks.append((time.monotonic() - t0, json.loads(line[5:])))
        total = time.monotonic() - t0
    finally:
        conn.close()
    assert len(chunks) == 20, chunks
    assert "".join(c["text_output"] for _, c in chunks) == vocab.generate_text("stream me", 20)
    first = chunks[0][0]
    assert first < 0.5 * total, f"first chunk after {first:.3f}s of {total:.3f}s: buffered"
    print(f"\n[{mode}] stream: first chunk {first * 1000:.0f} ms, total {total * 1000:.0f} ms")


# --- 3. admin API ------------------------------------------------------------------------------
ADMIN = [("POST", "/v2/repository/models/ensemble/unload"), ("POST", "/v2/repository/index"),
         ("GET", "/v2/systemsharedmemory/status"), ("GET", "/v2/logging"), ("POST", "/v2/logging"),
         ("GET", "/v2/models/ensemble/config"), ("GET", "/v2/models/ensemble/stats")]


@pytest.mark.parametrize("method,path", ADMIN)
def test_admin_api_refused(orch, method, path):
    mode, run = orch
    data = b"{}" if method == "POST" else None
    code, _, out = request(run.url(path), data, method=method)
    assert code == 403, (code, out)
    for inst in run.status()["instances"]:
        assert direct_ready(inst) == 200, inst["id"]


# --- 6. gRPC -----------------------------------------------------------------------------------
def _bytes_inputs(grpcclient, np, spec) -> list:
    inputs = []
    for name, value, dtype in spec:
        arr = np.array([[value]], dtype=object if dtype == "BYTES" else np.int32)
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        inputs.append(t)
    return inputs


def _ensemble_inputs(grpcclient, np, prompt: str, n: int) -> list:
    return _bytes_inputs(grpcclient, np, (("text_input", prompt.encode(), "BYTES"), ("max_tokens", n, "INT32"),
                                          ("bad_words", b"", "BYTES"), ("stop_words", b"", "BYTES")))


def _preprocessing_inputs(grpcclient, np, prompt: str, n: int) -> list:
    return _bytes_inputs(grpcclient, np, (("QUERY", prompt.encode(), "BYTES"), ("REQUEST_OUTPUT_LEN", n, "INT32"),
                                          ("BAD_WORDS_DICT", b"", "BYTES"), ("STOP_WORDS_DICT", b"", "BYTES")))


def _stream_collect(client, results: queue.Queue, model: str, inputs: list, output: str, n: int,
                    request_id: str) -> list:
    import tritonclient.grpc as grpcclient

    client.async_stream_infer(model, inputs, request_id=request_id,
                              outputs=[grpcclient.InferRequestedOutput(output)])
    out = []
    for _ in range(n):
        result, error = results.get(timeout=15)
        assert error is None, error
        out.append(result.as_numpy(output))
    return out


def test_grpc_unary_spread_stream_and_admin(orch):
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    mode, run = orch
    instances = run.status()["instances"]
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{run.grpc_port}")
    try:
        assert client.is_server_ready() and client.is_model_ready("ensemble")

        # Unary ModelInfer on `ensemble`: the demo ensemble contains the decoupled
        # tensorrt_llm step, so Triton itself refuses unary gRPC infer on it. The
        # endpoint must pass Triton's answer through unchanged (same as direct).
        direct = grpcclient.InferenceServerClient(f"127.0.0.1:{instances[0]['ports']['grpc']}")
        try:
            with pytest.raises(InferenceServerException) as exc_direct:
                direct.infer("ensemble", _ensemble_inputs(grpcclient, np, "x", 1), client_timeout=30)
        finally:
            direct.close()
        with pytest.raises(InferenceServerException) as exc:
            client.infer("ensemble", _ensemble_inputs(grpcclient, np, "x", 1), client_timeout=30)
        assert exc.value.status() == exc_direct.value.status() == "StatusCode.UNIMPLEMENTED", exc.value
        assert "decoupled" in exc.value.message(), exc.value

        # Unary ModelInfer with BYTES inputs on the (non-decoupled) preprocessing model,
        # spread over both instances.
        before = per_instance(run, "preprocessing")
        for i in range(20):
            res = client.infer("preprocessing", _preprocessing_inputs(grpcclient, np, f"grpc {i}", 2),
                               client_timeout=30)
            assert res.as_numpy("INPUT_ID").reshape(-1).tolist() == list(f"grpc {i}".encode())
        unary = wait_counts(run, before, 20, model="preprocessing")
        assert all(d > 0 for d in unary.values()) and sum(unary.values()) == 20, unary

        # The ensemble over gRPC: one ModelStreamInfer per request, spread too.
        results: queue.Queue = queue.Queue()
        before = per_instance(run)
        for i in range(10):
            client.start_stream(callback=lambda result, error: results.put((result, error)))
            try:
                (out,) = _stream_collect(client, results, "ensemble",
                                         _ensemble_inputs(grpcclient, np, f"ens {i}", 2), "text_output", 1, f"e{i}")
            finally:
                client.stop_stream()
            assert out.reshape(-1)[0].decode() == vocab.generate_text(f"ens {i}", 2)
        ens = wait_counts(run, before, 10)
        assert all(d > 0 for d in ens.values()) and sum(ens.values()) == 10, ens

        # Bidi streaming against the decoupled model: every response arrives.
        n = 8
        ids = np.array([list(b"grpc stream")], dtype=np.int32)
        inputs = []
        for name, arr in (("input_ids", ids), ("input_lengths", np.array([[ids.shape[1]]], dtype=np.int32)),
                          ("request_output_len", np.array([[n]], dtype=np.int32)),
                          ("streaming", np.array([[True]], dtype=bool))):
            t = grpcclient.InferInput(name, list(arr.shape), "BOOL" if arr.dtype == bool else "INT32")
            t.set_data_from_numpy(arr)
            inputs.append(t)
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        try:
            outs = _stream_collect(client, results, "tensorrt_llm", inputs, "output_ids", n, "s1")
        finally:
            client.stop_stream()
        tokens = [t for o in outs for t in o.reshape(-1).tolist()]
        assert tokens == vocab.next_tokens(list(b"grpc stream"), n)

        # Admin RPC refused; the model stays loaded everywhere.
        with pytest.raises(InferenceServerException) as exc:
            client.unload_model("ensemble")
        assert exc.value.status() == "StatusCode.PERMISSION_DENIED", exc.value
        assert client.is_model_ready("ensemble")
    finally:
        client.close()
    for inst in run.status()["instances"]:
        assert direct_ready(inst) == 200, inst["id"]
    print(f"\n[{mode}] gRPC: 20 unary infers split {unary}; 10 ensemble streams split {ens}; "
          f"stream of {n} responses complete")


# --- 7. malformed input --------------------------------------------------------------------------
def test_malformed_input_is_refused_and_counts_as_no_failure(orch):
    mode, run = orch
    port = run.listen_port
    before = {i["id"]: (i["state"], i["restarts"], i["last_failure"], sorted(i["pids"]))
              for i in run.status()["instances"]}
    results = {}

    status, data = raw(port, b"BREW /v2 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert_4xx_or_closed("bad method", status, data)
    results["bad method"] = status

    huge = b"GET /v2 HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\nConnection: close\r\n\r\n"
    status, data = raw(port, huge)
    assert_4xx_or_closed("100 KB header", status, data)
    results["100 KB header"] = status

    big = b"x" * 100_000
    status, data = raw(port, (f"POST {GEN_PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              f"Content-Length: {len(big)}\r\nConnection: close\r\n\r\n").encode() + big)
    assert_4xx_or_closed("body over the limit", status, data)
    results["100 KB body"] = status

    # Chunked without a length in the headers: the limit is found while reading.
    chunked = b"".join(b"%x\r\n%s\r\n" % (16384, b"y" * 16384) for _ in range(7)) + b"0\r\n\r\n"
    status, data = raw(port, (f"POST {GEN_PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n").encode() + chunked)
    assert_4xx_or_closed("chunked body over the limit", status, data)
    results["chunked 112 KB"] = status

    status, data = raw(port, (f"POST {GEN_PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                              "400\r\n{\"text_input\": \"trunc").encode(), shut_wr=True)
    assert_4xx_or_closed("truncated chunked body", status, data)
    results["truncated chunked"] = status

    # A client that reads one SSE chunk of a 200-token stream and hangs up.
    counts0 = per_instance(run)
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        payload = body("disconnect me", 200, stream=True)
        s.sendall((f"POST {STREAM_PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload)
        buf = b""
        while b"data:" not in buf:
            chunk = s.recv(4096)
            assert chunk, f"closed before the first chunk: {buf!r}"
            buf += chunk
        assert buf.startswith(b"HTTP/1.1 200"), buf[:200]
    finally:
        s.close()
    if mode == "embedded":  # the proxy let go of the upstream at once (nginx does not report in-flight)
        run.wait_for(lambda st: all(i["inflight"] == 0 for i in st["instances"]), 3, "in-flight back to 0")

    # Afterwards: the endpoint serves, nothing was blamed on an instance.
    for i in range(4):
        code, out = generate(run, f"after {i}", 2)
        assert code == 200 and json.loads(out)["text_output"], (code, out)
    # Triton (this version) runs the abandoned ensemble to its end (~4 s) and counts it a
    # success; wait for it so that it cannot land in a later case's exact counts. Also
    # room for a wrongly counted instance failure to show in status.
    time.sleep(1.0)
    wait_counts(run, counts0, 5, timeout=10)
    st = run.status()
    after = {i["id"]: (i["state"], i["restarts"], i["last_failure"], sorted(i["pids"])) for i in st["instances"]}
    assert after == before and all(v[0] == "READY" for v in after.values()), (before, after)
    assert run.proc.poll() is None, "daemon died"
    print(f"\n[{mode}] malformed input answers: {results}")


# --- 4. one instance down ------------------------------------------------------------------------
def test_one_instance_failed_every_request_succeeds(orch):
    mode, run = orch
    victim = rank0(run, "0")
    t0 = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    st = run.wait_for(lambda s: s["instances"][0]["state"] == "FAILED", 60, "instance 0 FAILED")
    failed_s = time.monotonic() - t0
    assert st["instances"][1]["state"] == "READY", st
    before = {"1": success_counts(st["instances"][1]["ports"]["metrics"])}
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: generate(run, f"one down {i}", 2), range(20)))
    bad = [r for r in results if r[0] != 200]
    assert not bad, bad[:3]
    delta = wait_counts(run, before, 20)
    assert delta == {"1": 20}, delta
    # Still down (max-failures 1): nobody restarted it behind our back.
    assert run.status()["instances"][0]["state"] == "FAILED"
    print(f"\n[{mode}] instance 0 FAILED {failed_s:.2f}s after kill -9; 20/20 requests served by instance 1")


# --- 5. none ready -------------------------------------------------------------------------------
def test_no_instance_ready_is_503(orch):
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    mode, run = orch
    assert run.status()["instances"][0]["state"] == "FAILED"  # left so by the previous case
    rank0(run, "1").send_signal(signal.SIGKILL)
    run.wait_for(lambda s: all(i["state"] == "FAILED" for i in s["instances"]), 60, "both FAILED")
    deadline = time.monotonic() + 15  # nginx: until its reload to the no-backend config
    while True:
        code, headers, data = request(run.url(GEN_PATH), body())
        if code == 503 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert code == 503, (code, data)
    assert "error" in json.loads(data), data
    assert headers.get("Retry-After"), headers
    code, headers, data = request(run.url("/v2/health/ready"))
    assert code == 503 and headers.get("Retry-After"), (code, headers, data)
    code, _, _ = request(run.url("/v2/health/live"))
    assert code == 200
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{run.grpc_port}")
    try:
        with pytest.raises(InferenceServerException) as exc:
            # A deadline past the proxy's hold (--hold-s, 10 s by default): the proxy's own
            # answer must arrive, not the client's DEADLINE_EXCEEDED (at exactly the hold the
            # two race, whatever the event loop).
            client.infer("ensemble", _ensemble_inputs(grpcclient, np, "none", 1), client_timeout=20)
        assert exc.value.status() == "StatusCode.UNAVAILABLE", exc.value
    finally:
        client.close()
    assert run.proc.poll() is None
