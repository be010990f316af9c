"""The engine state operators see: the KV reuse hit rate from the engine's own counters,
the engine gauges the proxies export, and the engine line of `status`."""

from __future__ import annotations

import pytest

from orchestrator.cli import format_engine, format_status
from orchestrator.health.engine_state import EngineView, parse_engine_metrics
from orchestrator.routing.backends import Backend
from orchestrator.dataplane.metrics import ProxyMetrics
from tests.test_metrics_stall import scrape

pytestmark = pytest.mark.unit


def with_reuse(counter: float, reused: int, input_tokens: int, tokens_per_block: int = 32, **kw) -> str:
    """A scrape plus the KV block size, the cumulative reused blocks and the input-token
    histogram's sum, as TRT-LLM (and the twin) export them."""
    return scrape(counter, kw.pop("active", 1), **kw) + f"""\
nv_trt_llm_kv_cache_block_metrics{{kv_cache_block_type="tokens_per",model="tensorrt_llm",version="1"}} \
{tokens_per_block}
nv_trt_llm_kv_cache_block_metrics{{kv_cache_block_type="reused",model="tensorrt_llm",version="1"}} {reused}
nv_llm_input_token_len_bucket{{model="tensorrt_llm",response_metric_type="total_input_tokens",version="1",le="+Inf"}} 7
nv_llm_input_token_len_count{{model="tensorrt_llm",response_metric_type="total_input_tokens",version="1"}} 7
nv_llm_input_token_len_sum{{model="tensorrt_llm",response_metric_type="total_input_tokens",version="1"}} {input_tokens}
"""


def test_reuse_hit_rate_is_reused_blocks_over_prompt_blocks_of_the_window() -> None:
    view = EngineView()
    view.update(parse_engine_metrics(with_reuse(1, reused=10, input_tokens=640), at=0.0))
    assert view.reuse_hit_rate() is None  # nothing finished in the window yet
    # 1280 more prompt tokens = 40 blocks of 32, of which 30 came from the cache
    view.update(parse_engine_metrics(with_reuse(9, reused=40, input_tokens=1920), at=5.0))
    assert view.reuse_hit_rate() == 0.75
    described = view.describe()
    assert described["kv_reuse_hit_rate"] == 0.75 and described["kv_reused_last_minute"] == 30


def test_reuse_hit_rate_without_prompts_or_after_a_counter_reset_is_unknown() -> None:
    view = EngineView()
    view.update(parse_engine_metrics(with_reuse(1, reused=50, input_tokens=900), at=0.0))
    view.update(parse_engine_metrics(with_reuse(2, reused=3, input_tokens=950), at=1.0))  # went back
    assert view.reuse_hit_rate() is None
    plain = EngineView()  # a version without the input-token histogram
    plain.update(parse_engine_metrics(scrape(1, 1), at=0.0))
    plain.update(parse_engine_metrics(scrape(2, 1), at=1.0))
    assert plain.reuse_hit_rate() is None


def backend(iid: str, view: EngineView | None) -> Backend:
    return Backend(iid, "127.0.0.1", 9000, 9001, 9002, engine=view)


def test_proxy_metrics_export_each_ready_engine_and_nothing_stale() -> None:
    import time
    now = time.monotonic()
    fresh, stale = EngineView(stale_after_s=5.0), EngineView(stale_after_s=5.0)
    fresh.update(parse_engine_metrics(with_reuse(1, reused=0, input_tokens=0, waiting=2, kv_used=25), at=now - 1))
    fresh.update(parse_engine_metrics(with_reuse(2, reused=4, input_tokens=256, waiting=2, kv_used=25), at=now))
    stale.update(parse_engine_metrics(scrape(1, 1), at=now - 60))
    metrics = ProxyMetrics()
    metrics.set_ready([backend("0", fresh), backend("1", stale), backend("2", None)])
    text = metrics.render().decode()
    assert 'trtllm_orch_engine_waiting{instance="0"} 2.0' in text
    assert 'trtllm_orch_engine_active{instance="0"} 1.0' in text
    assert 'trtllm_orch_engine_max_active{instance="0"} 8.0' in text
    assert 'trtllm_orch_engine_kv_fraction{instance="0"} 0.25' in text
    assert 'trtllm_orch_engine_kv_reuse_hit_rate{instance="0"} 0.5' in text  # 4 of 8 blocks
    assert 'instance="1"' not in text.split("trtllm_orch_engine_", 1)[1]
    metrics.set_ready([])  # the instance left the ready set: its engine is no longer exported
    assert 'trtllm_orch_engine_waiting{instance="0"}' not in metrics.render().decode()


def test_status_shows_the_engine_line() -> None:
    engine = {"active": 3, "max_active": 8, "waiting": 1, "kv_fraction": 0.42, "kv_used_blocks": 42,
              "kv_max_blocks": 100, "kv_reused_last_minute": 12, "kv_reuse_hit_rate": 0.6}
    assert format_engine(engine) == ("engine: waiting 1  active 3/8  KV 42% (42/100 blocks)  "
                                     "reuse 60% of prompt blocks (12 reused, last minute)")
    status = {"daemon": {"pid": 1, "uptime_s": 5, "proxy": "embedded", "listen": "0.0.0.0:8080"},
              "ready": 1, "total": 1,
              "instances": [{"id": "0", "gpus": [0], "state": "READY", "uptime_s": 4.0, "restarts": 0,
                             "ports": {"http": 8000, "grpc": 8001, "metrics": 8002}, "pids": [10],
                             "engine": engine}]}
    assert "      engine: waiting 1  active 3/8" in format_status(status)
