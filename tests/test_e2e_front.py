"""`--front compiled` end to end (issue 22): the data-plane workers serve the native generations
through the C front, over real tritonserver ranks under mpirun and the TRT-LLM twin. What the
client got must be what the endpoint counted, the front must be what served it, the rest of the
surface must stay aiohttp's, and `down` must leave nothing."""

from __future__ import annotations

import asyncio
import signal
import statistics
import time

import psutil
import pytest

from tests.test_e2e_faults import SLACK_S, Load, alive, fault_case, get_code, post, rank_proc, start_run
from tests.test_e2e_llm_metrics import N_PLAIN, N_STREAM, TOKEN_MS, TOKENS, TTFT_ABS_S, TTFT_REL, _http_load, \
    scrape_counted, total

pytestmark = pytest.mark.e2e


def test_the_compiled_front_serves_generations_counted_as_the_client_saw_them(orch_run):
    run = orch_run(gpus="0-1", tp=1, assume_gpus=2,
                   extra=("--canary-interval-s", "0", "--proxy-workers", "2", "--front", "compiled"),
                   env_extra={"DEMO_TOKEN_DELAY_MS": str(TOKEN_MS)})
    run.start(timeout=120)
    pool = run.status()["proxies"][0]
    pids = [w["pid"] for w in pool["workers"]]
    stream_ttft, plain_ttft, sse_events = asyncio.run(_http_load(run.url("/v2/models/ensemble")))
    assert sse_events == N_STREAM * TOKENS

    m = scrape_counted(run.metrics_port, "trtllm_orch_proxy_requests_total", N_STREAM + N_PLAIN, code="200")
    ttft = "trtllm_orch_proxy_time_to_first_token_seconds"
    # and once every first token is counted too: one CI run read a scrape with all the requests
    # but one answer's first token (23 of 24), another worker's counts caught mid-write
    m = scrape_counted(run.metrics_port, f"{ttft}_count", N_STREAM + N_PLAIN)
    assert total(m, f"{ttft}_count", api="generate_stream") == N_STREAM
    assert total(m, f"{ttft}_count", api="generate") == N_PLAIN
    assert total(m, "trtllm_orch_proxy_output_events_total", api="generate_stream") == sse_events
    assert total(m, "trtllm_orch_proxy_inter_token_seconds_count", api="generate_stream") == sse_events - N_STREAM
    # the twin decodes a token every TOKEN_MS: the gaps the front timed are of that order, not zeros
    itl_mean = total(m, "trtllm_orch_proxy_inter_token_seconds_sum", api="generate_stream") / (sse_events - N_STREAM)
    assert TOKEN_MS / 1000 * 0.5 < itl_mean < 1.0, itl_mean
    assert total(m, "trtllm_orch_proxy_requests_total", code="200") == N_STREAM + N_PLAIN
    assert total(m, "trtllm_orch_proxy_inflight_requests") == 0
    for api, client in (("generate_stream", stream_ttft), ("generate", plain_ttft)):
        proxy_mean = total(m, f"{ttft}_sum", api=api) / total(m, f"{ttft}_count", api=api)
        client_mean = statistics.mean(client)
        assert abs(proxy_mean - client_mean) <= TTFT_ABS_S + TTFT_REL * client_mean, (api, proxy_mean, client_mean)

    # the front answered them (the workers report it once a second)
    run.wait_for(lambda s: sum(w["front_served"] or 0 for w in s["proxies"][0]["workers"]) >= N_STREAM + N_PLAIN,
                 timeout=10)
    # the rest of the surface is aiohttp's, on the same port: health, the admin API's refusal
    assert get_code(run.url("/v2/health/ready")) == 200
    code, answer = post(run.url("/v2/repository/models/ensemble/unload"), b"{}")
    assert code == 403 and b"admin API is disabled" in answer

    out = run.down()
    assert out.returncode == 0, out.stderr
    assert not [p for p in pids if psutil.pid_exists(p) and alive(psutil.Process(p))]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["kill-9", "sigstop"])
def test_a_rank_killed_or_hung_under_load_through_the_front_fails_no_request(orch_run, sig):
    """The embedded path's promise kept by the front: requests waiting at an instance that dies
    or hangs go to the other one (a refused connect, a dropped one, or the daemon's abort of a
    hung instance: retry()), none reaches the client as an error, and the instance comes back."""
    run = start_run(orch_run, extra=("--proxy-workers", "2", "--front", "compiled"))
    rank0 = rank_proc(run, "0", 0)
    with Load(run, threads=4) as load:
        time.sleep(1.0)
        assert load.ok > 0 and not load.failures, load.failures[:3]
        fault_case(run, f"{sig.name} rank 0 under load, --front compiled", lambda: rank0.send_signal(sig),
                   detect_within=0.5 + 0.5 + SLACK_S)
        time.sleep(1.0)
    assert load.failures == [], load.failures[:5]
    assert load.ok >= 10
    # the front carried them (the workers report once a second)
    run.wait_for(lambda s: sum(w["front_served"] or 0 for w in s["proxies"][0]["workers"]) >= load.ok, timeout=10)
