"""A worker's metric values, written to its multiprocess file once per loop turn
(orchestrator/dataplane/metric_values.py): what another process's scrape reads, and when."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, values
from prometheus_client.multiprocess import MultiProcessCollector

from orchestrator.dataplane import metric_values

pytestmark = pytest.mark.unit


def scraped(directory: Path) -> dict[str, float]:
    """What any other worker's scrape reads from the files."""
    out = {}
    for family in MultiProcessCollector(None, path=str(directory)).collect():
        for s in family.samples:
            if s.name in ("c_total", "g", "h_count", "h_sum"):
                out[s.name] = s.value
    return out


async def test_a_turns_increments_reach_the_files_when_the_turn_ends_and_none_is_lost(tmp_path, monkeypatch):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setattr(values, "ValueClass", values.ValueClass)  # restored after the test
    batched = metric_values.install(os.getpid())
    r = CollectorRegistry()
    c = Counter("c", "", registry=r)
    g = Gauge("g", "", registry=r, multiprocess_mode="livesum")
    h = Histogram("h", "", registry=r, buckets=(0.1, 1.0))
    c.inc(2)  # not bound to a loop yet: written at once
    assert scraped(tmp_path)["c_total"] == 2.0

    batched.bind(asyncio.get_running_loop())
    for _ in range(1000):
        c.inc()
        g.inc()
        h.observe(0.5)
    g.dec(400)
    # Inside the turn the process sees its own counts; the files do not have them yet.
    assert c._value.get() == 1002.0
    assert scraped(tmp_path)["c_total"] == 2.0
    await asyncio.sleep(0)  # the turn ends (the flush runs in the next one)
    await asyncio.sleep(0)
    assert scraped(tmp_path) == {"c_total": 1002.0, "g": 600.0, "h_count": 1000.0, "h_sum": 500.0}

    c.inc(5)
    batched.flush()  # the worker's stop: the last turn's counts are not lost
    assert scraped(tmp_path)["c_total"] == 1007.0


async def test_a_value_set_from_another_thread_is_written_at_once(tmp_path, monkeypatch):
    """The render thread (or any thread but the loop's) has no turn to wait for."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setattr(values, "ValueClass", values.ValueClass)
    batched = metric_values.install(os.getpid())
    batched.bind(asyncio.get_running_loop())
    g = Gauge("g", "", registry=CollectorRegistry(), multiprocess_mode="livesum")
    await asyncio.to_thread(g.set, 7)
    assert scraped(tmp_path)["g"] == 7.0
