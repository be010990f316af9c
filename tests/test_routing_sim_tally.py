"""routing_sim's tally of where a policy's time went (bench/routing_sim._where_time_went): how far
its picks leave the instances apart, and the TTFT of requests that found their prompt cached
against those that computed it."""

from __future__ import annotations

import pytest

from bench.routing_sim import _where_time_went

pytestmark = pytest.mark.unit


def _rec(ttft_s: float, blocks: int, reused: int, above: int, spread: int) -> dict:
    return {"ttft": ttft_s, "blocks": blocks, "reused": reused, "above_least": above, "spread": spread}


def test_cached_and_computed_requests_are_told_apart_and_the_spread_averaged():
    recs = [_rec(0.5, 32, 32, 0, 0), _rec(0.7, 32, 16, 2, 2),  # half reused counts as cached
            _rec(0.1, 32, 15, 0, 4), _rec(0.3, 32, 0, 1, 2),
            _rec(0.2, 0, 0, 0, 0)]  # a prompt shorter than a block is neither
    got = _where_time_went(recs)
    assert got["cached_share"] == 0.5
    assert got["cached_ttft_p50_ms"] == 600.0 and got["computed_ttft_p50_ms"] == 200.0
    assert got["spread_mean"] == 1.6
    assert got["above_least"] == 0.4


def test_no_request_leaves_no_figure():
    got = _where_time_went([])
    assert got["spread_mean"] is None and got["above_least"] is None
    assert got["cached_ttft_p90_ms"] is None and got["cached_share"] == 0.0
