"""StallDetector on literal Triton metrics text."""

from __future__ import annotations

import pytest

from orchestrator.health.metrics_stall import StallDetector, parse

pytestmark = pytest.mark.unit


def scrape(counter: float, active: float, model: str = "tensorrt_llm") -> str:
    return f"""# HELP nv_trt_llm_request_metrics TRT LLM request metrics
# TYPE nv_trt_llm_request_metrics gauge
nv_trt_llm_request_metrics{{model="{model}",request_type="context",version="1"}} 0
nv_trt_llm_request_metrics{{model="{model}",request_type="scheduled",version="1"}} {active}
nv_trt_llm_request_metrics{{model="{model}",request_type="max",version="1"}} 512
nv_trt_llm_request_metrics{{model="{model}",request_type="active",version="1"}} {active}
# HELP nv_trt_llm_general_metrics General TRT LLM metrics
# TYPE nv_trt_llm_general_metrics gauge
nv_trt_llm_general_metrics{{general_type="iteration_counter",model="{model}",version="1"}} {counter}
nv_trt_llm_general_metrics{{general_type="timestamp",model="{model}",version="1"}} 1700000000
# HELP nv_inference_request_success Number of successful inference requests
# TYPE nv_inference_request_success counter
nv_inference_request_success{{model="{model}",version="1"}} 10
"""


def test_parse_picks_counter_and_active() -> None:
    assert parse(scrape(42, 3)) == {(("model", "tensorrt_llm"), ("version", "1")): (42.0, 3.0)}


def test_rising_counter_is_not_a_stall() -> None:
    d = StallDetector(3)
    assert not any(d.observe(scrape(i, 4)) for i in range(10))


def test_frozen_counter_with_active_requests_stalls_after_n_scrapes() -> None:
    d = StallDetector(3)
    assert d.observe(scrape(100, 2)) is False  # baseline
    assert d.observe(scrape(100, 2)) is False
    assert d.observe(scrape(100, 2)) is False
    assert d.observe(scrape(100, 2)) is True
    assert "iteration_counter stuck at 100 with 2 active requests for 3 scrapes" in d.reason
    assert "model=tensorrt_llm" in d.reason


def test_frozen_counter_while_idle_is_fine() -> None:
    d = StallDetector(2)
    assert not any(d.observe(scrape(7, 0)) for _ in range(10))
    assert d.reason == ""


def test_progress_breaks_the_streak() -> None:
    d = StallDetector(3)
    for text in (scrape(1, 1), scrape(1, 1), scrape(1, 1), scrape(2, 1), scrape(2, 1), scrape(2, 1)):
        assert d.observe(text) is False
    assert d.observe(scrape(2, 1)) is True


def test_idle_scrape_breaks_the_streak() -> None:
    d = StallDetector(2)
    d.observe(scrape(5, 1))
    d.observe(scrape(5, 1))
    d.observe(scrape(5, 0))  # requests finished (or were cancelled): not stuck
    assert d.observe(scrape(5, 1)) is False


def test_counter_reset_after_restart_is_progress() -> None:
    d = StallDetector(1)
    d.observe(scrape(1000, 1))
    assert d.observe(scrape(3, 1)) is False


def two_models(counter_a: float, counter_b: float) -> str:
    # One HELP/TYPE block per family, as Triton writes it: drop the second model's comments.
    b = "\n".join(line for line in scrape(counter_b, 1, "b").splitlines() if not line.startswith("#"))
    return scrape(counter_a, 1, "a") + b + "\n"


def test_one_stalled_model_among_several() -> None:
    d = StallDetector(1)
    assert len(parse(two_models(1, 1))) == 2
    d.observe(two_models(1, 1))
    assert d.observe(two_models(2, 1)) is True
    assert "model=b" in d.reason and "model=a" not in d.reason


@pytest.mark.parametrize("text", ["", "# only comments\n", "nv_inference_request_success 1\n"])
def test_no_trt_llm_metrics_is_never_a_stall(text: str) -> None:
    d = StallDetector(1)
    assert not d.observe(text) and not d.observe(text)


def test_malformed_text_is_not_a_stall_and_keeps_the_streak() -> None:
    d = StallDetector(2)
    d.observe(scrape(9, 1))
    d.observe(scrape(9, 1))
    assert d.observe("this is {not prometheus") is False
    assert d.observe(scrape(9, 1)) is True


def test_reset_forgets_history() -> None:
    d = StallDetector(1)
    d.observe(scrape(9, 1))
    d.reset()
    assert d.observe(scrape(9, 1)) is False


def test_rejects_bad_observations() -> None:
    with pytest.raises(ValueError, match="observations"):
        StallDetector(0)
