"""configs/grafana-dashboard.json and configs/prometheus.yml.

- Every metric the dashboard queries exists in a live run: the real daemon's proxy
  metrics listener and each instance's tritonserver metrics port, after some traffic.
  Only Triton's GPU families (nv_gpu_*) may be missing, and only on a host without GPUs.
- The scrape config is valid for Prometheus (`promtool check config`), and every
  dashboard expression is valid PromQL (`promtool check rules` on them as recording rules).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest

from tests.harness import REPO

DASHBOARD = REPO / "configs" / "grafana-dashboard.json"
SCRAPE = REPO / "configs" / "prometheus.yml"
_METRIC = re.compile(r"\b((?:trtllm_orch|nv|twin)_[a-z0-9_]+)\b")
GPU_ONLY = re.compile(r"^nv_gpu_")  # Triton exports these only when it sees a GPU


def promtool() -> str | None:
    local = REPO / ".tools" / "bin" / "promtool"
    return shutil.which("promtool") or (str(local) if local.exists() else None)


def expressions() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 20
    return exprs


def queried_metrics() -> set[str]:
    return {m for e in expressions() for m in _METRIC.findall(e)}


def exposed(text: str) -> set[str]:
    """Names a query can use: every sample name, and what each declared family provides
    (a labelled counter or histogram without children yet still declares its family)."""
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()[:4]
            names.add(name)
            if kind == "histogram":
                names.update({f"{name}_bucket", f"{name}_sum", f"{name}_count"})
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, 1)[0])
    return names


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


@pytest.mark.unit
def test_dashboard_is_well_formed():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "trtllm-orch"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        assert {t["refId"] for t in p["targets"]} == {chr(65 + i) for i in range(len(p["targets"]))}
    metrics = queried_metrics()
    # covers the proxy's LLM metrics and both instance families
    for name in ("trtllm_orch_proxy_time_to_first_token_seconds_bucket", "trtllm_orch_proxy_inter_token_seconds_bucket",
                 "trtllm_orch_proxy_output_events_total", "trtllm_orch_proxy_held_requests",
                 "trtllm_orch_proxy_hold_seconds_bucket", "trtllm_orch_proxy_routing_decisions_total",
                 "trtllm_orch_proxy_retries_total", "nv_trt_llm_request_metrics",
                 "nv_trt_llm_kv_cache_block_metrics", "nv_inference_request_success",
                 "nv_inference_pending_request_count"):
        assert name in metrics, name


@pytest.mark.e2e
def test_every_dashboard_metric_exists_in_a_live_run(orch_run):
    run = orch_run(gpus="0-1", tp=1, assume_gpus=2, extra=("--canary-interval-s", "0"))
    run.start(timeout=120)
    for path, extra in (("generate", {}), ("generate_stream", {"stream": True})):
        body = json.dumps({"text_input": "dashboards", "max_tokens": 3, "bad_words": "", "stop_words": "",
                           **extra}).encode()
        for _ in range(2):
            with urllib.request.urlopen(urllib.request.Request(run.url(f"/v2/models/ensemble/{path}"),
                                                               data=body), timeout=30) as resp:
                resp.read()
    names = exposed(scrape(run.metrics_port))
    for inst in run.status()["instances"]:
        names |= exposed(scrape(inst["ports"]["metrics"]))
    has_gpu = any(n.startswith("nv_gpu_") for n in names)
    missing = sorted(m for m in queried_metrics() if m not in names and (has_gpu or not GPU_ONLY.match(m)))
    assert not missing, f"the dashboard queries metrics no live run exports: {missing}"


@pytest.mark.process
@pytest.mark.skipif(promtool() is None, reason="no promtool: scripts/setup-promtool (run by scripts/bootstrap) "
                    "puts Debian's into .tools/bin")
def test_promtool_accepts_the_scrape_config_and_every_expression(tmp_path):
    out = subprocess.run([promtool(), "check", "config", str(SCRAPE)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    # Grafana's variables, as Grafana substitutes them, then each expression as a recording rule.
    rules = [{"record": f"dashboard:expr{i}",
              "expr": e.replace("$__rate_interval", "1m").replace("$api", ".*")}
             for i, e in enumerate(expressions())]
    path = Path(tmp_path) / "rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))  # JSON is YAML
    out = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
