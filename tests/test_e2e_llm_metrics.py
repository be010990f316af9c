"""The proxy's LLM-level metrics against what a client measured, on a real daemon.

Streaming (generate_stream, SSE), non-streaming (generate) and gRPC streaming
(ModelStreamInfer on the ensemble with stream=true) load through the public endpoints;
then the proxy's /metrics must count exactly what the client got (generations, output
events, routing decisions), its TTFT must agree with the client's within a tolerance
(the client's includes its own connection and parsing), and `status` must show the same
generations and a TTFT p50 in the last minute. The twin decodes a token every
DEMO_TOKEN_DELAY_MS, so TTFT and inter-token times are tens of ms, not noise.
"""

from __future__ import annotations

import asyncio
import json
import queue
import stat
import statistics
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.dataplane.shared_pending import SharedPending

pytestmark = pytest.mark.e2e

TOKEN_MS = 15
N_STREAM, N_PLAIN, N_GRPC, TOKENS = 24, 24, 6, 6
# TTFT agreement: the proxy starts its clock when it has the request and stops it when the
# event leaves; the client adds its own send, receive and parse on the same 2 busy cores.
TTFT_ABS_S, TTFT_REL = 0.030, 0.35


def body(i: int, stream: bool) -> dict:
    return {"text_input": f"metrics {i}", "max_tokens": TOKENS, "bad_words": "", "stop_words": "",
            **({"stream": True} if stream else {})}


async def _http_load(base: str) -> tuple[list[float], list[float], int]:
    import aiohttp

    stream_ttft: list[float] = []
    plain_ttft: list[float] = []
    events = 0
    sem = asyncio.Semaphore(4)

    async def streamed(session, i):
        nonlocal events
        async with sem:
            t0 = time.monotonic()
            async with session.post(f"{base}/generate_stream", json=body(i, True)) as resp:
                assert resp.status == 200
                buf, first = b"", None
                async for chunk in resp.content.iter_any():
                    buf += chunk
                    n = buf.count(b"\n\n")
                    if n and first is None:
                        first = time.monotonic() - t0
                    events += n
                    buf = buf.rsplit(b"\n\n", 1)[-1] if n else buf
            stream_ttft.append(first)

    async def plain(session, i):
        async with sem:
            t0 = time.monotonic()
            async with session.post(f"{base}/generate", json=body(i, False)) as resp:
                assert resp.status == 200
                await resp.read()
            plain_ttft.append(time.monotonic() - t0)

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(streamed(session, i) for i in range(N_STREAM)),
                             *(plain(session, i) for i in range(N_PLAIN)))
    return stream_ttft, plain_ttft, events


def _grpc_load(port: int) -> tuple[list[float], int]:
    import numpy as np
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    ttft, events = [], 0
    try:
        for i in range(N_GRPC):
            inputs = []
            for name, value, dtype in (("text_input", f"grpc {i}".encode(), "BYTES"), ("max_tokens", TOKENS, "INT32"),
                                       ("bad_words", b"", "BYTES"), ("stop_words", b"", "BYTES"),
                                       ("stream", True, "BOOL")):
                arr = np.array([[value]], dtype=object if dtype == "BYTES" else (bool if dtype == "BOOL" else np.int32))
                t = grpcclient.InferInput(name, list(arr.shape), dtype)
                t.set_data_from_numpy(arr)
                inputs.append(t)
            results: queue.Queue = queue.Queue()
            client.start_stream(callback=lambda result, error: results.put((time.monotonic(), error)))
            try:
                t0 = time.monotonic()
                client.async_stream_infer("ensemble", inputs, request_id=f"g{i}")
                for k in range(TOKENS):
                    at, error = results.get(timeout=20)
                    assert error is None, error
                    if k == 0:
                        ttft.append(at - t0)
                    events += 1
            finally:
                client.stop_stream()
    finally:
        client.close()
    return ttft, events


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[tuple[str, tuple], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples: dict, name: str, **match) -> float:
    return sum(v for (n, labels), v in samples.items()
               if n == name and all(dict(labels).get(k) == val for k, val in match.items()))


def scrape_counted(port: int, name: str, at_least: float, timeout_s: float = 5.0,
                   **match) -> dict[tuple[str, tuple], float]:
    """A scrape once `name`'s total (of the samples matching the labels) reaches `at_least`, else
    the last one at the deadline: a worker counts a request a little after its answer (front/
    path.py's ACCOUNT_AFTER_S), and a scrape through another worker reads that one's counts as
    it last wrote them."""
    deadline = time.monotonic() + timeout_s
    m = scrape(port)
    while total(m, name, **match) < at_least and time.monotonic() < deadline:
        time.sleep(0.02)
        m = scrape(port)
    return m


def close(proxy_mean: float, client_mean: float) -> bool:
    return abs(client_mean - proxy_mean) <= TTFT_ABS_S + TTFT_REL * client_mean and proxy_mean <= client_mean + 0.005


def test_every_pick_of_a_generation_reaches_the_cost_model_and_its_metrics(orch_run):
    run = orch_run(gpus="0-1", tp=1, assume_gpus=2,
                   extra=("--canary-interval-s", "0", "--lb-policy", "cost-model", "--proxy-workers", "2"),
                   env_extra={"DEMO_TOKEN_DELAY_MS": str(TOKEN_MS)})
    run.start(timeout=120)
    asyncio.run(_http_load(run.url("/v2/models/ensemble")))
    _grpc_load(run.grpc_port)
    n = N_STREAM + N_PLAIN + N_GRPC
    decisions = "trtllm_orch_proxy_routing_decisions_total"
    m = scrape_counted(run.metrics_port, decisions, n, policy="cost-model")
    assert total(m, decisions, policy="cost-model") == n
    # each pick's prompt in tokens (its first token then ends the prefill the model counts as
    # pending there): before, only unit tests that called the metrics by hand saw one
    assert total(m, "trtllm_orch_proxy_route_prompt_tokens_count") == n
    assert total(m, "trtllm_orch_proxy_route_prompt_tokens_sum") > 0
    # the workers' pending prefill (shared_pending.py): owner-only, and every pick's prompt
    # tokens, added to its worker's cell, left it with its first token (nothing left pending)
    path = run.state_dir / "dataplane" / "pending"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    pending = SharedPending.open(path)
    try:
        cells = pending.cells("0", 2) + pending.cells("1", 2)
    finally:
        pending.close()
    assert cells == [0.0] * 4
    # the workers' routed requests (cost-model's write logs, shared): owner-only, each pick made
    # once its instance's engine had reported numbers counted once, whichever worker made it
    routed = [SharedPending.open(run.state_dir / "dataplane" / name) for name in ("routed-blocks", "routed-requests")]
    try:
        assert all(stat.S_IMODE(f.path.stat().st_mode) == 0o600 for f in routed)
        assert 0 < sum(routed[1].cells("0", 2) + routed[1].cells("1", 2)) <= n
    finally:
        for f in routed:
            f.close()


def test_llm_metrics_match_what_the_client_measured(orch_run):
    run = orch_run(gpus="0-1", tp=1, assume_gpus=2, extra=("--canary-interval-s", "0"),
                   env_extra={"DEMO_TOKEN_DELAY_MS": str(TOKEN_MS)})
    run.start(timeout=120)
    base = run.url("/v2/models/ensemble")
    stream_ttft, plain_ttft, sse_events = asyncio.run(_http_load(base))
    grpc_ttft, grpc_events = _grpc_load(run.grpc_port)
    assert sse_events == N_STREAM * TOKENS and grpc_events == N_GRPC * TOKENS

    m = scrape(run.metrics_port)
    ttft = "trtllm_orch_proxy_time_to_first_token_seconds"
    # counts equal: one TTFT per generation, every event the client got, one decision per attempt
    assert total(m, f"{ttft}_count", api="generate_stream") == N_STREAM
    assert total(m, f"{ttft}_count", api="generate") == N_PLAIN
    assert total(m, f"{ttft}_count", api="ModelStreamInfer") == N_GRPC
    assert total(m, "trtllm_orch_proxy_output_events_total", api="generate_stream") == sse_events
    assert total(m, "trtllm_orch_proxy_output_events_total", api="generate") == N_PLAIN
    assert total(m, "trtllm_orch_proxy_output_events_total", api="ModelStreamInfer") == grpc_events
    assert total(m, "trtllm_orch_proxy_inter_token_seconds_count", api="generate_stream") == \
        sse_events - N_STREAM
    assert total(m, "trtllm_orch_proxy_routing_decisions_total", policy="prefix-affinity") == \
        N_STREAM + N_PLAIN + N_GRPC
    assert total(m, "trtllm_orch_proxy_held_requests") == 0
    assert total(m, "trtllm_orch_proxy_retries_total") == 0
    # both instances served (the default prefix-affinity routes these short prompts by load)
    per_instance = {dict(labels)["instance"] for (n, labels), v in m.items()
                    if n == f"{ttft}_count" and v > 0}
    assert per_instance == {"0", "1"}

    # TTFT within tolerance of the client's, per API (means: _sum / _count)
    for api, client in (("generate_stream", stream_ttft), ("generate", plain_ttft),
                        ("ModelStreamInfer", grpc_ttft)):
        proxy_mean = total(m, f"{ttft}_sum", api=api) / total(m, f"{ttft}_count", api=api)
        client_mean = statistics.mean(client)
        print(f"{api}: proxy TTFT mean {proxy_mean * 1000:.1f} ms, client {client_mean * 1000:.1f} ms")
        assert close(proxy_mean, client_mean), (api, proxy_mean, client_mean)
    # a streamed first token comes after at least one decode step; the whole answer after all
    assert total(m, f"{ttft}_sum", api="generate_stream") / N_STREAM >= TOKEN_MS / 1000 * 0.8
    assert total(m, f"{ttft}_sum", api="generate") / N_PLAIN >= TOKENS * TOKEN_MS / 1000 * 0.8
    itl = total(m, "trtllm_orch_proxy_inter_token_seconds_sum", api="generate_stream") / (sse_events - N_STREAM)
    assert TOKEN_MS / 1000 * 0.5 <= itl <= TOKEN_MS / 1000 * 6, itl

    # status: the same generations in the last minute, a TTFT p50 and tokens/s per instance.
    # The data-plane workers send the daemon their last minute once a second: status may
    # lag the clients by that much, never by more.
    status = run.wait_for(lambda s: sum((i["llm"] or {}).get("generations", 0) for i in s["instances"])
                          == N_STREAM + N_PLAIN + N_GRPC, timeout=3, what="status counts every generation")
    llm = [i["llm"] for i in status["instances"]]
    assert all(x is not None for x in llm), llm
    assert all(x["ttft_p50_ms"] > 0 and x["tokens_per_s"] > 0 for x in llm), llm
    assert status["daemon"]["tokens_per_s"] > 0 and status["daemon"]["held"] == 0
    assert status["daemon"]["lb_policy"] == "prefix-affinity"
    all_client = sorted(stream_ttft + plain_ttft + grpc_ttft)
    p50_status = statistics.median(x["ttft_p50_ms"] for x in llm) / 1000
    assert p50_status <= all_client[-1] + 0.005, (p50_status, all_client)
    assert json.dumps(status)  # still plain JSON

    # what each engine reports (its TRT-LLM metrics, scraped by the instance): in status,
    # its plain text, and the proxy's engine gauges
    engines = [i["engine"] for i in status["instances"]]
    assert all(e is not None and e["max_active"] > 0 for e in engines), engines
    # every prompt finished inside the last minute: a hit rate is known (0 when nothing was shared)
    assert all(e["kv_reuse_hit_rate"] is not None and 0 <= e["kv_reuse_hit_rate"] <= 1 for e in engines), engines
    text = run.cli("status", "--state-dir", str(run.state_dir), check=True).stdout
    assert text.count("engine: waiting ") == 2, text
    m = scrape(run.metrics_port)
    for iid, engine in zip(("0", "1"), engines):
        assert total(m, "trtllm_orch_engine_max_active", instance=iid) == engine["max_active"]
        assert (("trtllm_orch_engine_kv_fraction", (("instance", iid),)) in m), sorted(m)[:20]
