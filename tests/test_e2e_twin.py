"""The TRT-LLM twin behind the real CLI daemon.

1. The calls NVIDIA's Triton clients make (triton_backend/tools/inflight_batcher_llm/
   end_to_end_test.py and inflight_batcher_llm/client/end_to_end_grpc_client.py in
   NVIDIA/TensorRT-LLM), made with tritonclient through the orchestrator's endpoint
   (HTTP --listen, gRPC --grpc-listen), embedded proxy and NGINX, on the twin's
   non-streaming and streaming repositories (demo/fill_template.py --no-streaming /
   --streaming). NVIDIA's clients themselves were run by hand: bench/results/nvidia-clients-*.md.
2. A stalled rank: SIGSTOP of rank 1's tritonserver (not its stub) under load freezes
   instance 0's engine; the daemon restarts the group while instance 1 serves and no
   request through the endpoint fails; kill -9 of that process ends the whole job, healed too.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import re
import shutil
import signal
import threading
import time
import urllib.request

import numpy as np
import psutil
import pytest

from tests.test_e2e_faults import Load, fault_case, get_code, mpirun_of, post, rank_proc, stubs_of
from tests.test_demo_model import _body
from tests.test_twin_on_tritonserver import (_ensemble_inputs, _grpc_stream, _inputs, fill_template, tokens, ttft_at,
                                             twin_metrics)

pytestmark = pytest.mark.e2e

NGINX = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")
PROXIES = ("embedded", "nginx")


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("twin-repos")
    return {"plain": fill_template.write_repo(tmp / "plain", streaming=False),
            "stream": fill_template.write_repo(tmp / "stream", streaming=True)}


def start(orch_run, repo, proxy):
    """2 instances x TP1 behind the endpoint, as `up --assume-gpus 2 --tp 1` runs them."""
    if proxy == "nginx" and not NGINX:
        pytest.skip("nginx missing")
    extra = ("--nginx", NGINX) if proxy == "nginx" else ()
    t0 = time.monotonic()
    run = orch_run(gpus="0-1", tp=1, assume_gpus=2, proxy=proxy, model_repo=repo, extra=extra,
                   env_extra={"DEMO_TOKEN_DELAY_MS": "5"}).start()
    print(f"\n[{proxy}] ready in {time.monotonic() - t0:.1f}s")
    deadline = time.monotonic() + 30
    while get_code(run.url("/v2/health/ready")) != 200:
        assert time.monotonic() < deadline, "endpoint not ready"
        time.sleep(0.1)
    return run


def endpoints(run):
    return f"127.0.0.1:{run.listen_port}", f"127.0.0.1:{run.grpc_port}"


def by_hand(client, mod, prompt, n, decoupled, grpc_url=None):
    """end_to_end_test.py's step 1: preprocessing -> tensorrt_llm -> postprocessing."""
    words = np.array([[b""]], dtype=object)
    pre = client.infer("preprocessing", _inputs(mod, [
        ("QUERY", np.array([[prompt.encode()]], dtype=object)), ("BAD_WORDS_DICT", words),
        ("STOP_WORDS_DICT", words), ("REQUEST_OUTPUT_LEN", np.array([[n]], np.int32))]))
    assert pre.as_numpy("OUT_END_ID").reshape(-1)[0] == tokens.END_ID
    trt_in = _inputs(mod, [("input_ids", pre.as_numpy("INPUT_ID")),
                           ("decoder_input_ids", pre.as_numpy("DECODER_INPUT_ID")),
                           ("input_lengths", pre.as_numpy("REQUEST_INPUT_LEN")),
                           ("request_output_len", pre.as_numpy("REQUEST_OUTPUT_LEN")),
                           ("end_id", pre.as_numpy("OUT_END_ID")), ("pad_id", pre.as_numpy("OUT_PAD_ID"))])
    if decoupled:   # a decoupled model answers only on a gRPC stream (plain infer: 501 / UNIMPLEMENTED)
        (out,) = _grpc_stream(grpc_url, "tensorrt_llm", trt_in, ["output_ids", "sequence_length"])
        ids, lengths = out["output_ids"], out["sequence_length"]
    else:
        trt = client.infer("tensorrt_llm", trt_in)
        ids, lengths = trt.as_numpy("output_ids").astype(np.int32), trt.as_numpy("sequence_length")
    post = client.infer("postprocessing", _inputs(mod, [("TOKENS_BATCH", ids), ("SEQUENCE_LENGTH", lengths)]))
    return post.as_numpy("OUTPUT").reshape(-1)[0].decode()


def ensemble_text(client, mod, prompt, n):
    """end_to_end_test.py's step 2: the ensemble, plain infer."""
    r = client.infer("ensemble", _inputs(mod, [
        ("text_input", np.array([[prompt.encode()]], dtype=object)), ("max_tokens", np.array([[n]], np.int32)),
        ("bad_words", np.array([[b""]], dtype=object)), ("stop_words", np.array([[b""]], dtype=object))]),
        outputs=[mod.InferRequestedOutput("text_output")])
    return r.as_numpy("text_output").reshape(-1)[0].decode()


def grpc_client_call(grpc_url, prompt, n, stream):
    """end_to_end_grpc_client.py: a gRPC stream to the ensemble, with the inputs it always
    sends (stream, beam_width, temperature, exclude_input_in_output false)."""
    import tritonclient.grpc as grpcclient
    inputs = _ensemble_inputs(grpcclient, prompt, n, stream=stream) + _inputs(grpcclient, [
        ("exclude_input_in_output", np.array([[False]], bool)), ("return_perf_metrics", np.array([[True]], bool))])
    chunks = _grpc_stream(grpc_url, "ensemble", inputs, ["text_output", "kv_cache_alloc_total_blocks"])
    assert chunks[-1]["kv_cache_alloc_total_blocks"].reshape(-1)[0] >= 1     # the perf outputs came back
    return [c["text_output"].reshape(-1)[0].decode() for c in chunks]


@pytest.mark.parametrize("proxy", PROXIES)
def test_nvidia_calls_on_the_non_streaming_repo(orch_run, repos, proxy):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException
    run = start(orch_run, repos["plain"], proxy)
    http, grpc = endpoints(run)
    clients = ((httpclient, httpclient.InferenceServerClient(http)),
               (grpcclient, grpcclient.InferenceServerClient(grpc)))
    for i in range(2):   # twice per protocol: the balancer spreads them over both instances
        prompt, n = f"Summarize the following news article {i}:", 12
        want = tokens.generate_text(prompt, n)
        for mod, client in clients:
            assert by_hand(client, mod, prompt, n, decoupled=False) == ensemble_text(client, mod, prompt, n) == want
        # Not streamed, the prompt comes back first unless excluded (TRT-LLM's default).
        assert grpc_client_call(grpc, prompt, n, stream=False) == [prompt + want]
    # Streaming needs decoupled mode, as in TRT-LLM.
    with pytest.raises(InferenceServerException, match="Streaming is only supported if model is deployed"):
        clients[0][1].infer("ensemble", _ensemble_inputs(httpclient, "x", 2, stream=True))


@pytest.mark.parametrize("proxy", PROXIES)
def test_nvidia_calls_on_the_streaming_repo(orch_run, repos, proxy):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException
    run = start(orch_run, repos["stream"], proxy)
    http, grpc = endpoints(run)
    prompt, n = "What is machine learning?", 10
    want = tokens.generate_text(prompt, n)
    # Per token: one response per engine iteration, each the text of one new token.
    chunks = grpc_client_call(grpc, prompt, n, stream=True)
    assert len(chunks) == n and all(len(c.split()) == 1 for c in chunks) and "".join(chunks) == want, chunks
    assert grpc_client_call(grpc, prompt, n, stream=False) == [prompt + want]
    # The same over HTTP server-sent events ("stream": true), one event per token.
    req = urllib.request.Request(run.url("/v2/models/ensemble/generate_stream"), method="POST",
                                 data=('{"text_input": "%s", "max_tokens": %d, "bad_words": "", "stop_words": "", '
                                       '"stream": true}' % (prompt, n)).encode())
    with urllib.request.urlopen(req, timeout=30) as r:
        events = re.findall(rb'^data: .*"text_output":"([^"]*)"', r.read(), re.M)
    assert [e.decode() for e in events] == chunks
    # The pipeline by hand equals the ensemble (tensorrt_llm is decoupled: a gRPC stream).
    assert by_hand(grpcclient.InferenceServerClient(grpc), grpcclient, prompt, n, decoupled=True,
                   grpc_url=grpc) == want
    # A decoupled ensemble refuses plain infer, as Triton does for TRT-LLM's streaming repository.
    with pytest.raises(InferenceServerException, match="decoupled"):
        ensemble_text(httpclient.InferenceServerClient(http), httpclient, prompt, n)


# --- a stalled rank -------------------------------------------------------------------------
STALL = ("--stall-after-s", "1.5", "--engine-poll-s", "0.1", "--probe-interval-s", "0.5",
         "--probe-timeout-s", "0.5", "--probe-failures", "3", "--canary-interval-s", "2",
         "--canary-idle-s", "1", "--canary-deadline-s", "2", "--stop-grace-s", "3")


GEN20 = b'{"text_input": "stalled", "max_tokens": 20, "bad_words": "", "stop_words": ""}'


def iteration_counter(metrics_port):
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return float(re.search(r'nv_trt_llm_general_metrics\{general_type="iteration_counter"[^}]*\} (\S+)', text)[1])


@pytest.mark.parametrize("proxy", PROXIES)
def test_engine_batches_queues_and_reuses_behind_the_endpoint(orch_run, tmp_path, proxy):
    """The engine's behaviour as a client of the endpoint sees it, the instance under
    mpirun: a repeated long prompt's TTFT drops to a third with KV reuse, shown in the
    reused blocks; with 2 batch slots, 6 concurrent requests run 2 at a time (the other 4
    in the engine's queue) and finish in three waves n steps apart."""
    if proxy == "nginx" and not NGINX:
        pytest.skip("nginx missing")
    decode_s, n = 0.01, 60
    repo = fill_template.write_repo(tmp_path / "repo", streaming=True, overrides={
        "twin_engine_max_batch_size": "2", "twin_engine_max_queue_size": "4", "enable_kv_cache_reuse": "true",
        "twin_prefill_ms_per_token": "0.2", "twin_decode_ms": str(decode_s * 1000)})
    run = orch_run(gpus="0", tp=1, assume_gpus=1, proxy=proxy, model_repo=repo,
                   extra=(("--nginx", NGINX) if proxy == "nginx" else ()) + ("--canary-interval-s", "0")).start()
    metrics_url = f"http://127.0.0.1:{run.status()['instances'][0]['ports']['metrics']}/metrics"
    endpoint = run.url("")

    prompt = ("a long shared system prompt " * 200)[:4000]     # 62 full blocks of 64 tokens
    first, second = ttft_at(endpoint, prompt), ttft_at(endpoint, prompt)
    assert first >= 0.8 and second <= first / 3, (first, second)   # 4000 x 0.2 ms of prefill, then cached
    assert twin_metrics(metrics_url)[("nv_trt_llm_kv_cache_block_metrics", "reused")] == (4000 - 1) // 64

    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(6) as ex:
        futs = [ex.submit(lambda i: (post(endpoint + "/v2/models/ensemble/generate",
                                          json.dumps(_body(f"slot {i}", n)).encode()), time.monotonic() - t0), i)
                for i in range(6)]
        deadline, seen = time.monotonic() + 5, []
        while time.monotonic() < deadline:   # until all six have reached the engine
            m = twin_metrics(metrics_url)
            seen.append((m[("nv_trt_llm_request_metrics", "active")], m[("twin_executor_queued_requests", "")]))
            if seen[-1] == (2, 4):
                break
            time.sleep(0.02)
        results = [f.result() for f in futs]
    assert seen[-1] == (2, 4), seen
    assert all(code == 200 for (code, _), _ in results), results
    done = sorted(t for _, t in results)
    assert all(done[i + 1] - done[i] < 0.5 * n * decode_s for i in (0, 2, 4)), done      # two at a time
    assert all(0.8 * n * decode_s <= done[i + 1] - done[i] <= 2.5 * n * decode_s for i in (1, 3)), done


def test_stopped_rank1_server_is_healed_under_load_and_its_death_ends_the_job(orch_run):
    run = orch_run(extra=STALL).start()          # 2 instances x TP2 on 4 declared GPUs
    assert [i["state"] for i in run.status()["instances"]] == ["READY", "READY"]
    with Load(run, threads=4) as load:
        time.sleep(1.0)
        assert load.ok > 0 and not load.failures, load.failures[:3]

        # SIGSTOP of rank 1's server alone: its Python stubs keep running.
        inst0 = run.status()["instances"][0]
        rank1 = rank_proc(run, "0", 1)
        stubs = stubs_of(rank1)
        assert stubs, "rank 1 has a stub"
        base = f"http://127.0.0.1:{inst0['ports']['http']}"
        seen = {}

        def generate_direct():
            try:
                seen["answered"] = post(base + "/v2/models/ensemble/generate", GEN20)[0]
            except OSError as exc:   # the group is killed under it
                seen["answered"] = repr(exc)

        def stop_and_watch():
            rank1.send_signal(signal.SIGSTOP)
            # Generation stops within an iteration: a request straight to instance 0 gets
            # nothing and the iteration counter stands still, while /ready stays 200.
            threading.Thread(target=generate_direct, daemon=True).start()
            time.sleep(0.2)
            frozen = iteration_counter(inst0["ports"]["metrics"])
            time.sleep(0.8)
            seen["counter"] = (frozen, iteration_counter(inst0["ports"]["metrics"]))
            seen["answered_while_stopped"] = "answered" in seen
            seen["ready"] = get_code(base + "/v2/health/ready")
            seen["stubs_running"] = all(s.status() != psutil.STATUS_STOPPED for s in stubs)

        fault_case(run, "SIGSTOP rank 1 server", stop_and_watch, detect_within=1.5 + 2 + 6)
        assert seen["counter"][0] == seen["counter"][1] and not seen["answered_while_stopped"], seen
        assert seen["ready"] == 200 and seen["stubs_running"], seen
        assert not rank1.is_running() or rank1.status() == psutil.STATUS_ZOMBIE

        # kill -9 of the new group's rank 1 server: mpirun ends the whole job (as MPI_Abort).
        rank1 = rank_proc(run, "0", 1)
        job = mpirun_of(run, "0")
        fault_case(run, "kill -9 rank 1 server", lambda: rank1.send_signal(signal.SIGKILL), detect_within=6)
        assert not job.is_running() or job.status() == psutil.STATUS_ZOMBIE
        time.sleep(1.0)
    print(f"[stalled rank under load] {load.ok} requests ok, {len(load.failures)} failed")
    assert not load.failures, f"{len(load.failures)} failed of {load.ok + len(load.failures)}: {load.failures[:5]}"
    assert load.ok >= 20
