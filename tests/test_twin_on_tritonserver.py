"""The TRT-LLM twin on a bare tritonserver, no daemon (and a 2-rank mpirun group): the calls
NVIDIA's clients make, in-flight batching seen in the metrics, KV reuse in TTFT, and rank
coupling through the ranks' server processes. Behind the daemon: test_e2e_twin.py."""
import concurrent.futures as cf
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from tests.test_demo_model import (MODEL_REPO, _body, _children, _free_ports, _get_status, _loopback_args, _post,
                                   _rank_pid, _stop, _stream, _triton_env, _wait_ready,
                                   start_two_rank_group)

pytestmark = pytest.mark.e2e

DEMO = MODEL_REPO.parent
sys.path.insert(0, str(DEMO))
import fill_template  # noqa: E402
from twin import tokens  # noqa: E402


class Server:
    def __init__(self, repo, tmp, env_extra=None):
        self.env = _triton_env()
        self.env.update(env_extra or {})
        http, grpc, metrics = _free_ports(3)
        self.http, self.grpc, self.metrics_url = (f"http://127.0.0.1:{http}", f"127.0.0.1:{grpc}",
                                                  f"http://127.0.0.1:{metrics}/metrics")
        self.log = Path(tmp) / "server.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [self.env["TRITONSERVER"], f"--model-repository={repo}",
                 f"--backend-directory={self.env['BACKEND_DIR']}",
                 *_loopback_args(http, grpc, metrics), "--disable-auto-complete-config"],
                env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            _wait_ready(self.proc, self.http, self.log)
        except BaseException:
            _stop(self.proc)
            raise

    def metrics(self):
        return twin_metrics(self.metrics_url)

    def close(self):
        _stop(self.proc)


def twin_metrics(url):
    """{(family, its category label's value): value} of a server's metrics page."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out = {}
    for m in re.finditer(r'^(\w+)\{([^}]*)\} (\S+)$', text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        cat = [v for k, v in labels.items() if k not in ("model", "version")]
        out[(m.group(1), cat[0] if cat else "")] = float(m.group(3))
    return out


@pytest.fixture(scope="module")
def streaming(tmp_path_factory):
    s = Server(MODEL_REPO, tmp_path_factory.mktemp("stream"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """Non-streaming repository, prompt echoed (TRT-LLM's default)."""
    tmp = tmp_path_factory.mktemp("plain")
    repo = fill_template.write_repo(tmp / "repo", streaming=False, overrides={"exclude_input_in_output": "false"})
    s = Server(repo, tmp)
    yield s
    s.close()


@pytest.fixture
def two_slots(tmp_path):
    """Streaming (decoupled) repository with 2 engine batch slots and an engine queue of 4.
    The slots are the engine's (twin_engine_max_batch_size), with Triton's batch left
    at 64: with Triton's max_batch_size at 2 this Triton keeps requests in its own
    scheduler queue, and a non-decoupled Python model is held until its batch is done.

    The queue limit is the engine's alone (twin_engine_max_queue_size), not Triton's
    queue policy (max_queue_size, which TRT-LLM's backend also hands to the executor):
    with a policy of max_queue_size > 0, this tritonserver (2.51) now and then holds a
    request ~0.5 s in the dynamic batcher (6 of 300 sequential preprocessing calls took
    0.502 s, none without it), so the six requests reached the engine up to a second
    apart, and its scheduler queue refuses a burst by itself ("Exceeds maximum queue
    size") before the engine sees it."""
    repo = fill_template.write_repo(tmp_path / "repo", streaming=True, overrides={
        "twin_engine_max_batch_size": "2", "twin_engine_max_queue_size": "4"})
    s = Server(repo, tmp_path)
    yield s
    s.close()


def _inputs(mod, specs):
    out = []
    for name, arr in specs:
        dt = {np.dtype(np.int32): "INT32", np.dtype(np.float32): "FP32", np.dtype(bool): "BOOL",
              np.dtype(object): "BYTES"}[arr.dtype]
        t = mod.InferInput(name, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def _ensemble_inputs(mod, prompt, n, stream=None):
    specs = [("text_input", np.array([[prompt.encode()]], dtype=object)), ("max_tokens", np.array([[n]], np.int32)),
             ("bad_words", np.array([[b""]], dtype=object)), ("stop_words", np.array([[b""]], dtype=object)),
             # What NVIDIA's clients always send; the twin accepts and ignores them.
             ("beam_width", np.array([[1]], np.int32)), ("temperature", np.array([[1.0]], np.float32)),
             ("top_k", np.array([[1]], np.int32)), ("top_p", np.array([[0.0]], np.float32))]
    if stream is not None:
        specs.append(("stream", np.array([[stream]], bool)))
    return _inputs(mod, specs)


def _grpc_stream(url, model, inputs, outputs, request_id="r"):
    import queue

    import tritonclient.grpc as grpcclient
    results = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    got = []
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer(model, inputs, request_id=request_id,
                                  outputs=[grpcclient.InferRequestedOutput(o) for o in outputs],
                                  enable_empty_final_response=True)
        while True:
            result, error = results.get(timeout=30)
            assert error is None, error
            resp = result.get_response()
            if resp.outputs:
                got.append({o: result.as_numpy(o) for o in outputs})
            if resp.parameters["triton_final_response"].bool_param:
                return got
    finally:
        client.stop_stream()
        client.close()


def test_pipeline_by_hand_equals_ensemble(streaming):
    """preprocessing -> tensorrt_llm -> postprocessing, as NVIDIA's clients chain them."""
    import tritonclient.grpc as grpcclient
    prompt, n = "pipeline by hand", 6
    c = grpcclient.InferenceServerClient(streaming.grpc)
    pre = c.infer("preprocessing", _inputs(grpcclient, [
        ("QUERY", np.array([[prompt.encode()]], dtype=object)), ("REQUEST_OUTPUT_LEN", np.array([[n]], np.int32)),
        ("BAD_WORDS_DICT", np.array([[b""]], dtype=object)), ("STOP_WORDS_DICT", np.array([[b""]], dtype=object))]))
    for name in ("DECODER_INPUT_ID", "OUT_END_ID", "OUT_PAD_ID", "BAD_WORDS_IDS", "STOP_WORDS_IDS", "EMBEDDING_BIAS"):
        assert pre.as_numpy(name) is not None, name
    assert pre.as_numpy("OUT_END_ID").reshape(-1)[0] == tokens.END_ID
    ids = pre.as_numpy("INPUT_ID")
    trt_in = [("input_ids", ids), ("input_lengths", pre.as_numpy("REQUEST_INPUT_LEN")),
              ("request_output_len", pre.as_numpy("REQUEST_OUTPUT_LEN")), ("end_id", pre.as_numpy("OUT_END_ID")),
              ("pad_id", pre.as_numpy("OUT_PAD_ID")), ("beam_width", np.array([[1]], np.int32)),
              ("temperature", np.array([[1.0]], np.float32)), ("runtime_top_k", np.array([[1]], np.int32)),
              ("runtime_top_p", np.array([[0.0]], np.float32)),
              ("exclude_input_in_output", np.array([[True]], bool)), ("streaming", np.array([[False]], bool))]
    (out,) = _grpc_stream(streaming.grpc, "tensorrt_llm", _inputs(grpcclient, trt_in),
                          ["output_ids", "sequence_length"])
    post = c.infer("postprocessing", _inputs(grpcclient, [("TOKENS_BATCH", out["output_ids"]),
                                                          ("SEQUENCE_LENGTH", out["sequence_length"])]))
    by_hand = post.as_numpy("OUTPUT").reshape(-1)[0].decode()
    ens = _post(streaming.http, "/v2/models/ensemble/generate", _body(prompt, n))["text_output"]
    assert by_hand == ens == tokens.generate_text(prompt, n)


def test_per_token_streaming_on_streaming_repo(streaming):
    import tritonclient.grpc as grpcclient
    n = 7
    chunks = _grpc_stream(streaming.grpc, "ensemble", _ensemble_inputs(grpcclient, "stream it", n, stream=True),
                          ["text_output"])
    texts = [c["text_output"].reshape(-1)[0].decode() for c in chunks]
    assert len(texts) == n and all(len(t.split()) == 1 for t in texts)
    assert "".join(texts) == tokens.generate_text("stream it", n)
    sse = _stream(streaming.http, _body("stream it", n, stream=True))
    assert [c["text_output"] for _, c in sse] == texts


def test_plain_infer_on_non_streaming_repo(plain):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    want = "plain infer" + tokens.generate_text("plain infer", 5)   # prompt echoed: exclude_input_in_output false
    r = httpclient.InferenceServerClient(plain.http[len("http://"):]).infer(
        "ensemble", _ensemble_inputs(httpclient, "plain infer", 5))
    assert r.as_numpy("text_output").reshape(-1)[0].decode() == want
    r = grpcclient.InferenceServerClient(plain.grpc).infer("ensemble", _ensemble_inputs(grpcclient, "plain infer", 5))
    assert r.as_numpy("text_output").reshape(-1)[0].decode() == want
    # Streaming needs decoupled mode, as in TRT-LLM.
    from tritonclient.utils import InferenceServerException
    with pytest.raises(InferenceServerException,
                       match="Streaming is only supported if model is deployed using decoupled mode"):
        httpclient.InferenceServerClient(plain.http[len("http://"):]).infer(
            "ensemble", _ensemble_inputs(httpclient, "x", 2, stream=True))


def _with_counts(mod, prompt, n, stream=None):
    flags = [mod.InferInput(f, [1, 1], "BOOL") for f in ("return_log_probs", "return_num_output_tokens")]
    for f in flags:
        f.set_data_from_numpy(np.array([[True]], bool))
    return _ensemble_inputs(mod, prompt, n, stream) + flags


def test_bls_answers_as_the_ensemble_on_non_streaming_repo(plain):
    """tensorrt_llm_bls chains the three models itself: same text and outputs as the ensemble, plain infer."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    outs = ["text_output", "cum_log_probs", "output_log_probs", "num_output_tokens"]
    for mod, c in ((httpclient, httpclient.InferenceServerClient(plain.http[len("http://"):])),
                   (grpcclient, grpcclient.InferenceServerClient(plain.grpc))):
        got = {}
        for model in ("ensemble", "tensorrt_llm_bls"):
            r = c.infer(model, _with_counts(mod, "bls plain", 5),
                        outputs=[mod.InferRequestedOutput(o) for o in outs])
            got[model] = {o: r.as_numpy(o).tolist() for o in outs}
        assert got["tensorrt_llm_bls"] == got["ensemble"]
        assert got["ensemble"]["text_output"][0] == ("bls plain" + tokens.generate_text("bls plain", 5)).encode()
        assert got["ensemble"]["num_output_tokens"] == [[5]]
    body = _body("bls generate", 4)
    assert (_post(plain.http, "/v2/models/tensorrt_llm_bls/generate", body)["text_output"]
            == _post(plain.http, "/v2/models/ensemble/generate", body)["text_output"])
    with pytest.raises(urllib.error.HTTPError) as exc:   # validated before any model runs, as TRT-LLM's BLS does
        _post(plain.http, "/v2/models/tensorrt_llm_bls/generate", _body("none", 0))
    assert "max_tokens must be a single value > 0" in exc.value.read().decode()


def test_bls_streams_per_token_as_the_ensemble_on_streaming_repo(streaming):
    import tritonclient.grpc as grpcclient
    n, prompt = 7, "bls stream"
    chunks = {m: _grpc_stream(streaming.grpc, m, _with_counts(grpcclient, prompt, n, stream=True),
                              ["text_output", "num_output_tokens"], request_id=m)
              for m in ("ensemble", "tensorrt_llm_bls")}
    texts = {m: [c["text_output"].reshape(-1)[0].decode() for c in cs] for m, cs in chunks.items()}
    assert texts["tensorrt_llm_bls"] == texts["ensemble"]
    assert len(texts["ensemble"]) == n and "".join(texts["ensemble"]) == tokens.generate_text(prompt, n)
    assert [c["num_output_tokens"].tolist() for c in chunks["tensorrt_llm_bls"]] == [[[1]]] * n
    # stream false on the decoupled repository: one response with the whole text.
    (whole,) = _grpc_stream(streaming.grpc, "tensorrt_llm_bls",
                            _ensemble_inputs(grpcclient, prompt, n, stream=False), ["text_output"])
    assert whole["text_output"].reshape(-1)[0].decode() == "".join(texts["ensemble"])
    req = urllib.request.Request(streaming.http + "/v2/models/tensorrt_llm_bls/generate_stream",
                                 data=json.dumps(_body(prompt, n, stream=True)).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        sse = [json.loads(line[5:])["text_output"] for line in r if line.startswith(b"data:")]
    assert sse == texts["ensemble"]


def test_bls_accumulate_tokens_streams_the_text_so_far(tmp_path):
    import tritonclient.grpc as grpcclient
    s = Server(fill_template.write_repo(tmp_path / "repo", streaming=True, overrides={"accumulate_tokens": "true"}),
               tmp_path)
    try:
        chunks = _grpc_stream(s.grpc, "tensorrt_llm_bls", _ensemble_inputs(grpcclient, "so far", 4, stream=True),
                              ["text_output"])
    finally:
        s.close()
    assert [c["text_output"].reshape(-1)[0].decode() for c in chunks] == [
        tokens.generate_text("so far", i) for i in range(1, 5)]


def test_bls_stream_cancelled_by_its_client_stops_the_generation(streaming):
    """The BLS model's own call into tensorrt_llm is not cancelled with its client's request:
    it sends `stop` with its request id, as TRT-LLM's BLS does, and the engine frees the slot."""
    import queue

    import tritonclient.grpc as grpcclient
    got = queue.Queue()
    c = grpcclient.InferenceServerClient(streaming.grpc)
    c.start_stream(callback=lambda result, error: got.put(error))
    c.async_stream_infer("tensorrt_llm_bls", _ensemble_inputs(grpcclient, "cancel me", 2000, stream=True))
    for _ in range(3):
        assert got.get(timeout=30) is None
    assert streaming.metrics()[("nv_trt_llm_request_metrics", "active")] == 1
    c.stop_stream(cancel_requests=True)
    c.close()
    deadline = time.monotonic() + 5      # 2000 tokens would take 40 s
    while streaming.metrics()[("nv_trt_llm_request_metrics", "active")] != 0:
        assert time.monotonic() < deadline, "the generation went on after its client cancelled"
        time.sleep(0.05)


def test_two_slots_six_requests_metrics_and_queue_limit(two_slots):
    plain = two_slots
    n, step = 80, 0.02
    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(7) as ex:
        futs = [ex.submit(lambda i: (_post(plain.http, "/v2/models/ensemble/generate", _body(f"slot {i}", n)),
                                     time.monotonic() - t0), i) for i in range(6)]
        deadline = time.monotonic() + 5
        while True:   # until all six have arrived (a busy 2-core box may take a while)
            m = plain.metrics()
            if m[("twin_executor_queued_requests", "")] == 4 or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        # The queue holds 4 (max_queue_size 4): a 7th request is refused with TRT-LLM's text.
        assert m[("twin_executor_queued_requests", "")] == 4, m
        with pytest.raises(urllib.error.HTTPError) as exc:
            _post(plain.http, "/v2/models/ensemble/generate", _body("one too many", n))
        done = sorted(f.result()[1] for f in futs)
    body = exc.value.read().decode()
    assert "Maximum queue size of 4 has been reached, please try again later" in body, (exc.value.code, body)
    # /generate answers 400 for any model error in this Triton; /infer maps INTERNAL to 500.
    assert exc.value.code in (400, 500), (exc.value.code, body)
    req = lambda k: m[("nv_trt_llm_request_metrics", k)]  # noqa: E731
    # TRT-LLM's meaning: active = in the batch (at most max), waiting = active - scheduled;
    # the executor queue is not exported by TRT-LLM: the twin shows it separately.
    assert (req("max"), req("active"), req("scheduled"), req("waiting")) == (2, 2, 2, 0), m
    assert m[("twin_executor_queued_requests", "")] == 4
    assert m[("nv_trt_llm_kv_cache_block_metrics", "used")] == 2
    # Three waves of two, each n steps after the previous one.
    within = [done[1] - done[0], done[3] - done[2], done[5] - done[4]]
    between = [done[2] - done[1], done[4] - done[3]]
    assert all(w < 0.5 * n * step for w in within), done
    assert all(0.8 * n * step <= b <= 2.5 * n * step for b in between), done
    # The final iteration stat (active 0) follows the last response: give it a moment.
    deadline = time.monotonic() + 3
    while True:
        m2 = plain.metrics()
        idle = (m2[("nv_trt_llm_request_metrics", "active")], m2[("nv_trt_llm_kv_cache_block_metrics", "used")])
        if idle == (0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert idle == (0, 0), m2


def _ttft(server, prompt):
    return ttft_at(server.http, prompt)


def ttft_at(base_url, prompt):
    """Seconds to the first SSE event of a 2-token generate_stream at base_url."""
    t0 = time.monotonic()
    req = urllib.request.Request(base_url + "/v2/models/ensemble/generate_stream",
                                 data=json.dumps(_body(prompt, 2, stream=True)).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        for line in r:
            if line.startswith(b"data:"):
                ttft = time.monotonic() - t0
                break
        r.read()
    return ttft


@pytest.mark.parametrize("reuse", [True, False])
def test_repeated_long_prompt_ttft_with_and_without_reuse(tmp_path, reuse):
    repo = fill_template.write_repo(tmp_path / "repo", streaming=True, overrides={
        "enable_kv_cache_reuse": str(reuse).lower(), "twin_prefill_ms_per_token": "0.2", "twin_decode_ms": "10"})
    s = Server(repo, tmp_path)
    try:
        prompt = ("a long shared system prompt " * 200)[:4000]       # 4000 tokens: 62 full blocks of 64
        first = _ttft(s, prompt)
        second = _ttft(s, prompt)
        reused = s.metrics()[("nv_trt_llm_kv_cache_block_metrics", "reused")]
    finally:
        s.close()
    assert first >= 0.8                                                # 4000 x 0.2 ms of prefill
    if reuse:
        assert second <= first / 3, (first, second)
        assert reused == (4000 - 1) // 64
    else:
        assert second >= 0.8 * first, (first, second)
        assert reused == 0


def test_group_stalls_when_rank1_server_alone_is_stopped_and_dies_with_it(tmp_path):
    """2-rank leader-mode group: SIGSTOP of rank 1's tritonserver (its stub keeps
    running) freezes generation and the iteration counter while ready stays 200;
    SIGCONT resumes; kill -9 of that server ends the whole mpirun job."""
    proc, base, metrics, log_path = start_two_rank_group(tmp_path, 8)
    metrics_url = f"http://127.0.0.1:{metrics}/metrics"
    stopped = None

    def counter():
        with urllib.request.urlopen(metrics_url, timeout=5) as r:
            text = r.read().decode()
        return float(re.search(r'nv_trt_llm_general_metrics\{general_type="iteration_counter"[^}]*\} (\S+)', text)[1])

    try:
        _wait_ready(proc, base, log_path)
        assert _post(base, "/v2/models/ensemble/generate", _body("x", 3))["text_output"] == tokens.generate_text("x", 3)
        rank1 = _rank_pid(proc.pid, "--id=rank1")
        assert _children(rank1), "rank 1 has a stub"
        os.kill(rank1, signal.SIGSTOP)          # the server only: its stub keeps running
        stopped = rank1
        result = {}
        t = threading.Thread(target=lambda: result.update(
            out=_post(base, "/v2/models/ensemble/generate", _body("stalled", 20), timeout=30)), daemon=True)
        t.start()
        time.sleep(0.6)
        frozen = counter()
        time.sleep(0.6)
        assert counter() == frozen and "out" not in result       # no iteration completes
        assert _get_status(base + "/v2/health/ready") == 200      # and health says nothing
        os.kill(rank1, signal.SIGCONT)
        stopped = None
        t.join(15)
        assert result["out"]["text_output"] == tokens.generate_text("stalled", 20)

        os.kill(rank1, signal.SIGKILL)
        proc.wait(30)                                             # the whole job ends
        assert proc.returncode != 0
    finally:
        if stopped:
            os.kill(stopped, signal.SIGCONT)
        _stop(proc)
