"""StallDetector and the engine-metrics scanner on literal Triton metrics text."""

from __future__ import annotations

import pytest

from orchestrator.health.engine_state import EngineView, parse_engine_metrics
from orchestrator.health.metrics_stall import StallDetector

pytestmark = pytest.mark.unit


def scrape(counter: float, active: float, model: str = "tensorrt_llm", waiting: int = 0,
           kv_used: int = 0, kv_max: int = 100, pending: int = 0) -> str:
    return f"""# HELP nv_trt_llm_request_metrics TRT LLM request metrics
# TYPE nv_trt_llm_request_metrics gauge
nv_trt_llm_request_metrics{{model="{model}",request_type="context",version="1"}} 0
nv_trt_llm_request_metrics{{model="{model}",request_type="scheduled",version="1"}} {active}
nv_trt_llm_request_metrics{{model="{model}",request_type="max",version="1"}} 8
nv_trt_llm_request_metrics{{model="{model}",request_type="active",version="1"}} {active}
nv_trt_llm_request_metrics{{model="{model}",request_type="waiting",version="1"}} {waiting}
# HELP nv_trt_llm_kv_cache_block_metrics TRT LLM KV cache block metrics
# TYPE nv_trt_llm_kv_cache_block_metrics gauge
nv_trt_llm_kv_cache_block_metrics{{kv_cache_block_type="max",model="{model}",version="1"}} {kv_max}
nv_trt_llm_kv_cache_block_metrics{{kv_cache_block_type="used",model="{model}",version="1"}} {kv_used}
nv_trt_llm_kv_cache_block_metrics{{kv_cache_block_type="free",model="{model}",version="1"}} {kv_max - kv_used}
nv_trt_llm_kv_cache_block_metrics{{kv_cache_block_type="fraction",model="{model}",version="1"}} 0.5
# HELP nv_trt_llm_general_metrics General TRT LLM metrics
# TYPE nv_trt_llm_general_metrics gauge
nv_trt_llm_general_metrics{{general_type="iteration_counter",model="{model}",version="1"}} {counter}
nv_trt_llm_general_metrics{{general_type="timestamp",model="{model}",version="1"}} 1700000000
# HELP nv_inference_pending_request_count Instantaneous number of pending requests awaiting execution per-model.
# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{{model="{model}",version="1"}} {pending}
nv_inference_request_success{{model="{model}",version="1"}} 10
"""


def test_scanner_reads_the_families_routing_needs() -> None:
    snap = parse_engine_metrics(scrape(42, 3, waiting=2, kv_used=25, pending=1), at=5.0)
    assert (snap.iteration, snap.active, snap.max_active, snap.waiting, snap.pending) == (42.0, 3, 8, 2, 1)
    assert snap.queued == 3 and snap.kv_fraction == 0.25 and snap.at == 5.0 and snap.has_engine


def test_scanner_sums_several_trtllm_models() -> None:
    snap = parse_engine_metrics(scrape(1, 2, model="a") + scrape(1, 3, model="b"), at=0)
    assert snap.active == 5 and snap.max_active == 16


def test_a_server_without_trtllm_metrics_has_no_engine() -> None:
    snap = parse_engine_metrics('nv_inference_request_success{model="x",version="1"} 3\n', at=0)
    assert not snap.has_engine
    view = EngineView()
    view.update(snap)
    assert view.fresh(0) is None and view.describe() is None


def test_view_goes_stale() -> None:
    view = EngineView(stale_after_s=1.0)
    view.update(parse_engine_metrics(scrape(1, 1), at=10.0))
    assert view.fresh(10.5) is not None and view.fresh(11.5) is None
    view.clear()
    assert view.fresh(10.0) is None


def observe(det: StallDetector, at: float, counter: float, active: int) -> bool:
    return det.observe(parse_engine_metrics(scrape(counter, active), at=at))


def test_frozen_counter_with_active_requests_is_a_stall_after_the_window() -> None:
    det = StallDetector(stall_after_s=1.0)
    assert not observe(det, 0.0, 5, 2)
    assert not observe(det, 0.1, 5, 2)  # frozen since 0.1
    assert not observe(det, 1.0, 5, 2)
    assert observe(det, 1.2, 5, 2)
    assert "stuck at 5 with 2 active requests for 1.1s" in det.reason


def test_idle_instance_is_not_stalled() -> None:
    det = StallDetector(stall_after_s=0.5)
    for t in range(10):
        assert not observe(det, t, 7, 0)


def test_progress_resets_the_window() -> None:
    det = StallDetector(stall_after_s=1.0)
    observe(det, 0.0, 5, 1)
    observe(det, 0.9, 5, 1)
    assert not observe(det, 1.0, 6, 1)  # moved
    assert not observe(det, 1.5, 6, 1)
    assert not observe(det, 2.4, 6, 1)
    assert observe(det, 2.6, 6, 1)


def test_counter_going_down_is_a_restart_not_a_stall() -> None:
    det = StallDetector(stall_after_s=0.1)
    observe(det, 0.0, 100, 1)
    assert not observe(det, 1.0, 3, 1)
    det.reset()
    assert not observe(det, 2.0, 3, 1)


def test_no_engine_metrics_says_nothing() -> None:
    det = StallDetector(stall_after_s=0.1)
    for t in range(5):
        assert not det.observe(parse_engine_metrics("", at=t))


@pytest.mark.parametrize("bad", [0, -1])
def test_rejects_bad_window(bad: float) -> None:
    with pytest.raises(ValueError, match="stall_after_s"):
        StallDetector(bad)
