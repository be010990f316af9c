"""Routing policies on LLM workloads (issue 11): shared prefixes and mixed lengths, in ONE run.

    .venv/bin/python -m bench.routing_bench [--rounds 2] [--rates 6,14,22] [--seconds 8]

Setup: ONE daemon, `trtllm-orch up --gpus 0-1 --tp 1 --assume-gpus 2 --proxy embedded
--config FILE`, serving a twin repository (demo/fill_template.py) with KV reuse on, a
paged KV cache too small for every tenant's prefix on one instance, a per-token prefill
cost that makes a cached prefix clearly cheaper, and a few in-flight batch slots:

    triton_max_batch_size 8, max_tokens_in_paged_kv_cache 16384 (256 blocks of
    twin_tokens_per_block 64), enable_kv_cache_reuse true, twin_decode_ms 20,
    twin_prefill_ms_per_token 0.1 (a 2048-token prefix: 205 ms uncached, 0 cached)

Targets, all in front of the same two instances:
  round-robin, least-outstanding, kv-aware, prefix-affinity
      the daemon's embedded proxy; the policy is switched by rewriting `lb_policy` in the
      --config file and `trtllm-orch reload` (applied at once, nothing restarts; each
      visit's tenants have prefixes of their own, so caches left by earlier visits do
      not help it)
  nginx
      a private NGINX from the config `--proxy nginx` renders (bench.common.SideNginx:
      same template, `least_conn`, keepalive, retries), pointed at the same instances

Workload A, shared prefixes: `--tenants` tenants, each with a system prompt of its own of
`--prefix-tokens` bytes (the twin's tokenizer is byte-level: one char = one token),
followed by a short unique question (40..120 bytes); tenant uniform at random;
max_tokens uniform 8..32; Poisson arrivals (open loop) at each of `--rates` req/s for
`--seconds`, then up to `--drain-s` for the requests still running (those cut there
count with their elapsed time as a lower bound, column `cut`).
Workload B, mixed lengths, no sharing (proxy_bench's mixed scenario, with prompts of
mixed length too): every prompt unique from its first byte, 32..1024 bytes, max_tokens
uniform 1..64 (seed 1234), closed loop at concurrency `--b-concurrency`.

Every request is `generate_stream` (SSE); TTFT is the time to the first `data:` event,
end-to-end the time to the end of the stream, output tokens the events (one per token).
A visit = one target: A at each rate in ascending order (the tenants' prefixes are new
for each visit, so each visit starts cold and warms as a deployment would), then B.
Rounds visit the targets in rotated order; within a round every target gets the same
arrival times, tenants, question lengths and max_tokens (and B the same request sequence).

Reported per workload/rate/target (pooled over rounds): TTFT p50/p90/p99, end-to-end
p99, output tokens/s (tokens received during the load window / window), each instance's
share of requests (delta of its own `nv_inference_request_success{model="ensemble"}`),
KV reuse hit rate (delta of the twin's `nv_trt_llm_kv_cache_block_metrics
{kv_cache_block_type="reused"}` over the full prompt blocks of the requests admitted:
sum of (prompt_len - 1) // 64, the most the engine can reuse).

Goals (issue 11): on A at the saturating (highest) rate, the best LLM policy's TTFT p90
<= 0.5 x NGINX least_conn's and its output tokens/s >= 1.3 x; on B its end-to-end p99
within 5% of least-outstanding's; on A and B no instance below half the mean share.

Noise: 2 shared cores run the instances, the proxies and this load generator (asyncio +
aiohttp, one ClientSession); the twin's time is modelled (sleep), its CPU cost is not,
so the goals compare targets inside this one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import SideNginx, machine, pct, table, use_uvloop, write_result
from tests.harness import DEMO_REPO, Run

STREAM = "/v2/models/ensemble/generate_stream"
EMBEDDED = ("round-robin", "least-outstanding", "kv-aware", "prefix-affinity")
TARGETS = ("round-robin", "nginx", "least-outstanding", "kv-aware", "prefix-affinity")
LLM_POLICIES = ("kv-aware", "prefix-affinity")
HEADERS = {"Content-Type": "application/json"}
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
         "november oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee "
         "zulu policy tenant invoice ledger refund account billing support clause").split()


# --- the model repository ----------------------------------------------------------------
def twin_repo(dest: Path, a: argparse.Namespace) -> Path:
    sys.path.insert(0, str(DEMO_REPO.parent))
    import fill_template

    return fill_template.write_repo(dest / "model_repo", streaming=True, overrides={
        "triton_max_batch_size": str(a.slots),
        "max_tokens_in_paged_kv_cache": str(a.kv_tokens),
        "twin_tokens_per_block": str(a.block),
        "enable_kv_cache_reuse": "true",
        "batch_scheduler_policy": "guaranteed_no_evict",
        "twin_decode_ms": str(a.decode_ms),
        "twin_prefill_ms_per_token": str(a.prefill_ms),
    })


# --- requests ----------------------------------------------------------------------------
def _text(rng: random.Random, n: int) -> str:
    out: list[str] = []
    size = 0
    while size < n:
        w = rng.choice(WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n].ljust(n)


def stream_body(prompt: str, max_tokens: int) -> bytes:
    return json.dumps({"text_input": prompt, "max_tokens": max_tokens, "bad_words": "",
                       "stop_words": "", "stream": True}).encode()


@dataclass
class Req:
    at: float  # offset of the arrival (open loop), seconds
    body: bytes
    prompt_blocks: int  # full prompt blocks the engine could reuse: (len - 1) // block


def tenant_prefixes(salt: str, tenants: int, tokens: int) -> list[str]:
    """Each tenant's system prompt: `tokens` bytes, distinct from the first block on."""
    out = []
    for t in range(tenants):
        rng = random.Random(f"{salt}/tenant{t}")
        head = f"[{salt} tenant {t}] You are the assistant of tenant {t}. Rules: "
        out.append((head + _text(rng, tokens))[:tokens])
    return out


def workload_a(salt: str, rate: float, seconds: float, a: argparse.Namespace, seq: str = "") -> list[Req]:
    """Arrival times, tenants, questions and max_tokens come from `seq` (the same for every
    target of a round); the tenants' prefixes from `salt` (new for every visit)."""
    rng = random.Random(f"{seq or salt}/arrivals/{rate}")
    prefixes = tenant_prefixes(salt, a.tenants, a.prefix_tokens)
    reqs, t, n = [], 0.0, 0
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return reqs
        tenant = rng.randrange(a.tenants)
        q = f" Question {n} ({rate}): " + _text(rng, rng.randint(40, 120)) + "?"
        prompt = prefixes[tenant] + q
        reqs.append(Req(t, stream_body(prompt, rng.randint(8, 32)), (len(prompt) - 1) // a.block))
        n += 1


def workload_b(salt: str, a: argparse.Namespace, count: int = 2000) -> list[Req]:
    rng = random.Random(a.seed)  # max_tokens and lengths: the same sequence for every target
    reqs = []
    for n in range(count):
        length = rng.randint(32, 1024)
        max_tokens = rng.randint(1, 64)
        prompt = (f"{n:05d}:{salt} " + _text(random.Random(f"{salt}/b{n}"), length))[:length]
        reqs.append(Req(0.0, stream_body(prompt, max_tokens), (len(prompt) - 1) // a.block))
    return reqs


# --- load generators -----------------------------------------------------------------------
@dataclass
class Rec:
    prompt_blocks: int
    ttft: float | None = None
    e2e: float | None = None
    tokens: int = 0
    error: str | None = None
    cut: bool = False  # still running when the drain deadline came (times are lower bounds)


@dataclass
class Load:
    recs: list[Rec] = field(default_factory=list)
    window_tokens: int = 0
    window_s: float = 0.0
    wall_s: float = 0.0


async def _one(session: aiohttp.ClientSession, url: str, req: Req, rec: Rec, load: Load,
               t_end: float, perf=time.perf_counter) -> None:
    t0 = perf()
    try:
        async with session.post(url, data=req.body, headers=HEADERS) as r:
            if r.status != 200:
                rec.error = f"http_{r.status}"
                await r.read()
                return
            async for line in r.content:
                if not line.startswith(b"data:"):
                    continue
                now = perf()
                if line.startswith(b'data: {"error"'):
                    rec.error = "sse_error"
                    return
                if rec.ttft is None:
                    rec.ttft = now - t0
                rec.tokens += 1
                if now <= t_end:
                    load.window_tokens += 1
        rec.e2e = perf() - t0
    except asyncio.CancelledError:
        now = perf()
        rec.cut = True
        rec.e2e = now - t0
        if rec.ttft is None:
            rec.ttft = now - t0
        raise
    except Exception as exc:  # noqa: BLE001 - a failed request is a data point
        rec.error = type(exc).__name__


def _session() -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=60)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, skip_auto_headers=("User-Agent",))


async def open_loop(url: str, reqs: list[Req], seconds: float, drain_s: float) -> Load:
    """Poisson arrivals (precomputed offsets): each request starts on time, whatever is running."""
    load = Load(window_s=seconds)
    perf = time.perf_counter
    async with _session() as session:
        tasks = []
        start = perf() + 0.05
        t_end = start + seconds
        for req in reqs:
            delay = start + req.at - perf()
            if delay > 0:
                await asyncio.sleep(delay)
            rec = Rec(req.prompt_blocks)
            load.recs.append(rec)
            tasks.append(asyncio.ensure_future(_one(session, url, req, rec, load, t_end)))
        left = t_end - perf()
        if left > 0:
            await asyncio.sleep(left)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=drain_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        load.wall_s = perf() - start
    return load


async def closed_loop(url: str, reqs: list[Req], seconds: float, concurrency: int) -> Load:
    """`concurrency` workers, each sending the next request when its previous one ended;
    no new request after `seconds`, the ones running then finish."""
    load = Load(window_s=seconds)
    perf = time.perf_counter
    seq = 0
    async with _session() as session:
        start = perf()
        t_end = start + seconds

        async def worker() -> None:
            nonlocal seq
            while perf() < t_end:
                req = reqs[seq % len(reqs)]
                seq += 1
                rec = Rec(req.prompt_blocks)
                load.recs.append(rec)
                await _one(session, url, req, rec, load, t_end)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        load.wall_s = perf() - start
    return load


# --- the instances' own metrics --------------------------------------------------------------
_SUCCESS = re.compile(r'^nv_inference_request_success\{model="ensemble",version="1"\} (\S+)', re.M)
_REUSED = re.compile(r'^nv_trt_llm_kv_cache_block_metrics\{kv_cache_block_type="reused"[^}]*\} (\S+)', re.M)
_ACTIVE = re.compile(r'^nv_trt_llm_request_metrics\{[^}]*request_type="active"[^}]*\} (\S+)', re.M)
_QUEUED = re.compile(r'^twin_executor_queued_requests\{[^}]*\} (\S+)', re.M)


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for key, rx in (("success", _SUCCESS), ("reused", _REUSED), ("active", _ACTIVE), ("queued", _QUEUED)):
        m = rx.search(text)
        out[key] = float(m.group(1)) if m else 0.0
    return out


_DECISION = re.compile(r'^trtllm_orch_proxy_routing_decisions_total\{([^}]*)\} (\S+)', re.M)


def decisions(metrics_port: int) -> dict[str, float]:
    """The embedded proxy's routing decisions by reason (prefix, prefix-miss, prefix-overloaded...)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for labels, value in _DECISION.findall(text):
        reason = dict(re.findall(r'(\w+)="([^"]*)"', labels)).get("reason", "")
        out[reason] = out.get(reason, 0.0) + float(value)
    return out


def wait_idle(ports: list[int], timeout: float = 20.0) -> bool:
    """Until every engine has nothing active or queued (cancelled requests leave at the next
    iteration), so a segment's metric deltas are its own."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snaps = [scrape(p) for p in ports]
        if all(s["active"] == 0 and s["queued"] == 0 for s in snaps):
            return True
        time.sleep(0.1)
    return False


# --- one segment ---------------------------------------------------------------------------
def run_segment(url: str, ports: list[int], kind: str, reqs: list[Req], a: argparse.Namespace,
                seconds: float, proxy_metrics_port: int | None = None) -> dict[str, Any]:
    before = [scrape(p) for p in ports]
    d0 = decisions(proxy_metrics_port) if proxy_metrics_port else {}
    if kind == "A":
        load = asyncio.run(open_loop(url, reqs, seconds, a.drain_s))
    else:
        load = asyncio.run(closed_loop(url, reqs, seconds, a.b_concurrency))
    idle = wait_idle(ports)
    after = [scrape(p) for p in ports]
    d1 = decisions(proxy_metrics_port) if proxy_metrics_port else {}
    served = [int(y["success"] - x["success"]) for x, y in zip(before, after)]
    reused = sum(max(0.0, y["reused"] - x["reused"]) for x, y in zip(before, after))
    started = [r for r in load.recs if r.ttft is not None and not (r.cut and r.tokens == 0)]
    potential = sum(r.prompt_blocks for r in started)
    return {
        "ttft_s": [r.ttft for r in load.recs if r.ttft is not None],
        "e2e_s": [r.e2e for r in load.recs if r.e2e is not None and r.error is None],
        "sent": len(load.recs),
        "ok": sum(1 for r in load.recs if r.error is None and not r.cut),
        "failed": sum(1 for r in load.recs if r.error is not None),
        "errors": sorted({r.error for r in load.recs if r.error}),
        "cut": sum(1 for r in load.recs if r.cut),
        "tokens": sum(r.tokens for r in load.recs),
        "window_tokens": load.window_tokens,
        "window_s": load.window_s,
        "wall_s": round(load.wall_s, 3),
        "served_per_instance": served,
        "kv_reused_blocks": int(reused),
        "prompt_blocks_admitted": potential,
        "idle_after": idle,
        "routing_decisions": {k: int(v - d0.get(k, 0.0)) for k, v in d1.items() if v - d0.get(k, 0.0) > 0},
    }


def summarize(segs: list[dict[str, Any]]) -> dict[str, Any]:
    """Pool a target's segments of one workload/rate over the rounds."""
    ttft = [x * 1000 for s in segs for x in s["ttft_s"]]
    e2e = [x * 1000 for s in segs for x in s["e2e_s"]]
    served = [sum(s["served_per_instance"][i] for s in segs) for i in range(len(segs[0]["served_per_instance"]))]
    total = sum(served)
    potential = sum(s["prompt_blocks_admitted"] for s in segs)
    tps = [s["window_tokens"] / s["window_s"] for s in segs]
    return {
        "ttft_ms": [round(x, 1) for x in ttft], "e2e_ms": [round(x, 1) for x in e2e],  # moved to "samples"
        "n": len(ttft), "failed": sum(s["failed"] for s in segs), "cut": sum(s["cut"] for s in segs),
        "ttft_p50_ms": pct(ttft, 50), "ttft_p90_ms": pct(ttft, 90), "ttft_p99_ms": pct(ttft, 99),
        "e2e_p50_ms": pct(e2e, 50), "e2e_p99_ms": pct(e2e, 99),
        "out_tok_s": round(sum(s["window_tokens"] for s in segs) / sum(s["window_s"] for s in segs), 1),
        "out_tok_s_rounds": [round(x, 1) for x in tps],
        "ttft_p90_ms_rounds": [pct([x * 1000 for x in s["ttft_s"]], 90) for s in segs],
        "e2e_p99_ms_rounds": [pct([x * 1000 for x in s["e2e_s"]], 99) for s in segs],
        "share": [round(x / total, 3) if total else None for x in served],
        "served_per_instance": served,
        "min_share_over_mean": round(min(served) / (total / len(served)), 3) if total else None,
        "kv_hit_rate": round(sum(s["kv_reused_blocks"] for s in segs) / potential, 3) if potential else None,
        "routing_decisions": {k: sum(s.get("routing_decisions", {}).get(k, 0) for s in segs)
                              for k in sorted({k for s in segs for k in s.get("routing_decisions", {})})},
    }


# --- targets ---------------------------------------------------------------------------------
class Targets:
    def __init__(self, run: Run, config: Path, nginx: SideNginx) -> None:
        self.run, self.config, self.nginx = run, config, nginx
        self.policy: str | None = None
        self.reload_s: list[float] = []

    def url(self, target: str) -> str:
        if target == "nginx":
            return self.nginx.url(STREAM)
        self.set_policy(target)
        return self.run.url(STREAM)

    def set_policy(self, policy: str) -> None:
        if policy == self.policy:
            return
        t0 = time.monotonic()
        gen = self.run.status()["daemon"]["config_generation"]
        self.config.write_text(f'lb_policy = "{policy}"\n')
        self.run.cli("reload", "--state-dir", str(self.run.state_dir), check=True)
        self.run.wait_for(lambda st: st["daemon"]["config_generation"] > gen and not st["daemon"]["rolling_restart"]
                          and st["ready"] == st["total"] and all(
                              (i.get("engine") or {}).get("age_s", 9) < 0.5 for i in st["instances"]),
                          timeout=60, what=f"reload to {policy}")
        self.policy = policy
        self.reload_s.append(round(time.monotonic() - t0, 2))


def _rotate(xs: list[Any], k: int) -> list[Any]:
    k %= len(xs)
    return xs[k:] + xs[:k]


# --- output ----------------------------------------------------------------------------------
COLS = ["target", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "e2e_p99_ms", "out_tok_s", "share",
        "kv_hit_rate", "n", "cut", "failed"]


def rows_of(block: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for target, s in block.items():
        row = {"target": target, **s}
        row["share"] = "/".join(f"{x:.2f}" for x in s["share"] if x is not None)
        out.append(row)
    return out


def plot(result: dict[str, Any], plt: Any) -> Any:
    """A: TTFT p90/p50, output tokens/s and KV hit rate against the offered rate; B: p99s."""
    rates = result["rates"]
    targets = result["targets"]
    fig, axes = plt.subplots(1, 5, figsize=(24, 4.8))
    styles = {"round-robin": ("tab:gray", "o"), "nginx": ("tab:red", "s"),
              "least-outstanding": ("tab:blue", "^"), "kv-aware": ("tab:purple", "v"),
              "prefix-affinity": ("tab:green", "D")}
    for t in targets:
        color, marker = styles.get(t, ("k", "x"))
        for ax, key in ((axes[0], "ttft_p90_ms"), (axes[1], "ttft_p50_ms"), (axes[2], "out_tok_s"),
                        (axes[3], "kv_hit_rate")):
            ys = [result["A"][str(r)][t][key] for r in rates]
            ax.plot(rates, ys, marker=marker, color=color, label=t)
    axes[0].set_title("A (shared prefixes): TTFT p90")
    axes[1].set_title("A: TTFT p50")
    axes[2].set_title("A: output tokens/s")
    for ax in axes[:2]:
        ax.set_yscale("log")
        ax.set_ylabel("ms")
    axes[2].set_ylabel("tokens/s")
    axes[3].set_title("A: KV reuse hit rate (reused / reusable prompt blocks)")
    axes[3].set_ylim(0, 1)
    for ax in axes[:4]:
        ax.set_xlabel("offered load, req/s (Poisson)")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    b = result["B"]
    xs = range(len(targets))
    axes[4].bar([x - 0.2 for x in xs], [b[t]["e2e_p99_ms"] for t in targets], 0.4, label="end-to-end p99")
    axes[4].bar([x + 0.2 for x in xs], [b[t]["ttft_p99_ms"] for t in targets], 0.4, label="TTFT p99")
    axes[4].set_xticks(list(xs))
    axes[4].set_xticklabels(targets, rotation=20, fontsize=8)
    axes[4].set_ylabel("ms")
    axes[4].set_title(f"B (mixed lengths, no sharing, c{result['params']['b_concurrency']})")
    axes[4].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"routing_bench: 2 instances x TP1 (TRT-LLM twin), {result['params']['rounds']} rounds; "
                 f"{result['params']['tenants']} tenants x {result['params']['prefix_tokens']}-token prefixes, "
                 f"KV {result['params']['kv_tokens']} tokens/instance", fontsize=10)
    fig.tight_layout()
    return fig


def ratio_ci(a: list[float], b: list[float], q: float, n: int = 2000, seed: int = 7) -> list[float]:
    """95% bootstrap interval of percentile q of `a` over that of `b` (requests resampled)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    xa, xb = np.asarray(a), np.asarray(b)
    qa = np.percentile(xa[rng.integers(0, len(xa), (n, len(xa)))], q, axis=1)
    qb = np.percentile(xb[rng.integers(0, len(xb), (n, len(xb)))], q, axis=1)
    r = qa / qb
    return [round(float(np.percentile(r, 2.5)), 3), round(float(np.percentile(r, 97.5)), 3)]


def goals(result: dict[str, Any]) -> dict[str, Any]:
    top = str(result["rates"][-1])
    a_top = result["A"][top]
    ngx = a_top["nginx"]
    lo_b = result["B"]["least-outstanding"]["e2e_p99_ms"]
    sa, sb = result["samples"]["A"][top], result["samples"]["B"]
    noise = {  # the same policy twice (least_conn = least-outstanding): how far apart noise puts them
        "B_e2e_p99_nginx_over_least_outstanding": round(result["B"]["nginx"]["e2e_p99_ms"] / lo_b, 3),
        "B_e2e_p99_nginx_over_least_outstanding_ci95": ratio_ci(sb["nginx"]["e2e_ms"],
                                                                sb["least-outstanding"]["e2e_ms"], 99),
    }
    per_policy = {}
    for p in LLM_POLICIES:
        s = a_top[p]
        ttft_ratio = round(s["ttft_p90_ms"] / ngx["ttft_p90_ms"], 3)
        tps_ratio = round(s["out_tok_s"] / ngx["out_tok_s"], 3)
        b_ratio = round(result["B"][p]["e2e_p99_ms"] / lo_b, 3)
        noise[f"A_ttft_p90_{p}_over_nginx_ci95"] = ratio_ci(sa[p]["ttft_ms"], sa["nginx"]["ttft_ms"], 90)
        noise[f"B_e2e_p99_{p}_over_least_outstanding_ci95"] = ratio_ci(sb[p]["e2e_ms"],
                                                                     sb["least-outstanding"]["e2e_ms"], 99)
        shares = {f"A@{r}": result["A"][str(r)][p]["min_share_over_mean"] for r in result["rates"]}
        shares["B"] = result["B"][p]["min_share_over_mean"]
        per_policy[p] = {
            "A_ttft_p90_over_nginx": (ttft_ratio, ttft_ratio <= 0.5),
            "A_out_tok_s_over_nginx": (tps_ratio, tps_ratio >= 1.3),
            "B_e2e_p99_over_least_outstanding": (b_ratio, b_ratio <= 1.05),
            "min_share_over_mean": (shares, all(v is not None and v >= 0.5 for v in shares.values())),
        }
    # The best LLM policy: the most goals met, then the lowest TTFT p90 on A at the top rate.
    best = min(LLM_POLICIES, key=lambda p: (-sum(ok for _, ok in per_policy[p].values()),
                                            a_top[p]["ttft_p90_ms"]))
    return {"saturating_rate": float(top), "best_llm_policy": best, "per_policy": {
        p: {k: {"value": v, "met": ok} for k, (v, ok) in g.items()} for p, g in per_policy.items()},
        "bootstrap": noise}


# --- main ------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--rates", default="6,14,22", help="workload A: Poisson rates, req/s, ascending")
    ap.add_argument("--seconds", type=float, default=8.0, help="workload A: arrival window per rate")
    ap.add_argument("--drain-s", type=float, default=10.0, help="workload A: wait for running requests")
    ap.add_argument("--b-seconds", type=float, default=20.0)
    ap.add_argument("--b-concurrency", type=int, default=16)
    ap.add_argument("--tenants", type=int, default=12)
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--slots", type=int, default=8, help="in-flight batch slots per instance")
    ap.add_argument("--kv-tokens", type=int, default=16384, help="max_tokens_in_paged_kv_cache per instance")
    ap.add_argument("--block", type=int, default=64, help="twin_tokens_per_block")
    ap.add_argument("--decode-ms", type=float, default=20.0)
    ap.add_argument("--prefill-ms", type=float, default=0.1, help="per uncached prompt token")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--no-b", action="store_true", help="skip workload B (tuning runs)")
    a = ap.parse_args()
    rates = [float(x) for x in a.rates.split(",")]
    targets = a.targets.split(",")
    uv = use_uvloop()
    t_start = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="bench-routing-"))
    repo = twin_repo(tmp, a)
    config = tmp / "trtllm-orch.toml"
    config.write_text('lb_policy = "least-outstanding"\n')
    run = Run(tmp, gpus="0-1", tp=1, assume_gpus=2, proxy="embedded", extra=("--config", str(config)),
              env_extra={"DEMO_TOKEN_DELAY_MS": str(a.decode_ms)}, model_repo=repo)
    params = {k: getattr(a, k) for k in ("rounds", "seconds", "drain_s", "b_seconds", "b_concurrency", "tenants",
                                         "prefix_tokens", "slots", "kv_tokens", "block", "decode_ms",
                                         "prefill_ms", "seed")}
    result: dict[str, Any] = {
        "bench": "routing_bench", "machine": machine(), "params": params, "rates": rates, "targets": targets,
        "generator": {"kind": "asyncio, one aiohttp ClientSession; A open loop (Poisson), B closed loop; "
                      "generate_stream SSE", "uvloop": uv, "same_cores_as_targets": True},
        "instances": "2 x TP1 (--assume-gpus 2), one daemon; embedded policies by reload, nginx beside it",
    }
    raw: dict[str, Any] = {"A": {str(r): {t: [] for t in targets} for r in rates},
                           "B": {t: [] for t in targets}}
    ngx = None
    try:
        run.start()
        st = run.status()
        ports = [i["ports"]["metrics"] for i in st["instances"]]
        ngx = SideNginx(st).start()
        tg = Targets(run, config, ngx)
        tg.policy = "least-outstanding"
        for rnd in range(a.rounds):
            for target in _rotate(targets, rnd):
                url = tg.url(target)
                pm = None if target == "nginx" else run.metrics_port
                salt = f"r{rnd}-{target}"
                for rate in rates:
                    reqs = workload_a(salt, rate, a.seconds, a, seq=f"round{rnd}")
                    seg = run_segment(url, ports, "A", reqs, a, a.seconds, pm)
                    raw["A"][str(rate)][target].append(seg)
                    s = summarize([seg])
                    print(f"  [round {rnd + 1}] A {rate:>5} req/s {target:<17} TTFT p50 {s['ttft_p50_ms']} "
                          f"p90 {s['ttft_p90_ms']} ms  {s['out_tok_s']} tok/s  share {s['share']}  "
                          f"hit {s['kv_hit_rate']}  n {s['n']} cut {s['cut']} failed {s['failed']}  "
                          f"{s['routing_decisions'] if target == 'prefix-affinity' else ''}", flush=True)
                if not a.no_b:
                    seg = run_segment(url, ports, "B", workload_b(salt, a), a, a.b_seconds, pm)
                    raw["B"][target].append(seg)
                    s = summarize([seg])
                    print(f"  [round {rnd + 1}] B c{a.b_concurrency}        {target:<17} e2e p99 {s['e2e_p99_ms']} "
                          f"TTFT p99 {s['ttft_p99_ms']} ms  {s['out_tok_s']} tok/s  share {s['share']}  "
                          f"n {s['n']} failed {s['failed']}", flush=True)
        result["reload_s"] = tg.reload_s
    finally:
        if ngx is not None:
            ngx.stop()
        result["leaked_pids"] = run.close()
    result["wall_s"] = round(time.time() - t_start, 1)
    result["A"] = {r: {t: summarize(segs) for t, segs in block.items()} for r, block in raw["A"].items()}
    if not a.no_b:
        result["B"] = {t: summarize(segs) for t, segs in raw["B"].items()}
    result["samples"] = {"A": {r: {t: {k: s.pop(k) for k in ("ttft_ms", "e2e_ms")} for t, s in block.items()}
                               for r, block in result["A"].items()},
                         "B": {t: {k: s.pop(k) for k in ("ttft_ms", "e2e_ms")} for t, s in result.get("B", {}).items()}}
    result["segments"] = {"A": {r: {t: [{k: v for k, v in s.items() if k not in ("ttft_s", "e2e_s")}
                                        for s in segs] for t, segs in block.items()}
                                for r, block in raw["A"].items()},
                          "B": {t: [{k: v for k, v in s.items() if k not in ("ttft_s", "e2e_s")} for s in segs]
                                for t, segs in raw["B"].items()}}
    for r in rates:
        print(f"\nA: shared prefixes, Poisson {r} req/s ({a.rounds} rounds x {a.seconds}s, pooled)")
        print(table(rows_of(result["A"][str(r)]), COLS))
    if not a.no_b:
        print(f"\nB: mixed lengths, no sharing, closed loop c{a.b_concurrency} ({a.rounds} rounds x {a.b_seconds}s)")
        print(table(rows_of(result["B"]), COLS))
    if not a.no_b and all(t in targets for t in ("nginx", "least-outstanding", *LLM_POLICIES)):
        result["goals"] = goals(result)
        print(f"\ngoals (A at {result['goals']['saturating_rate']} req/s; best LLM policy: "
              f"{result['goals']['best_llm_policy']}):")
        for p, g in result["goals"]["per_policy"].items():
            for k, v in g.items():
                print(f"  {'PASS' if v['met'] else 'MISS'}  {p:<16} {k}: {v['value']}")
        print("bootstrap 95% intervals (requests resampled):")
        for k, v in result["goals"]["bootstrap"].items():
            print(f"  {k}: {v}")
    path = write_result("routing_bench", result, None if a.no_b else plot)
    print(f"wrote {path} (wall {result['wall_s']} s)")
    if result["leaked_pids"]:
        print(f"LEAKED processes killed by the harness: {result['leaked_pids']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    os.chdir(Path(__file__).resolve().parent.parent)
    sys.exit(main())
