"""Routing policies on the real twin (issue 24): a subset of bench/routing_cells.py's matrix,
every target side by side in ONE daemon per engine cell, and the simulator's numbers for the
same cells beside them (bench/routing_sim.py: is the simulator faithful?).

    .venv/bin/python -m bench.routing_bench --cells s8/room4/uniform/r1,s8/room4/uniform/closed
        [--seconds 20] [--rounds 1] [--targets cost-model,prefix-affinity,least-outstanding,round-robin,nginx]
        [--out DIR]
    .venv/bin/python -m bench.routing_bench --merge A.json B.json ... [--out DIR]   # one result of runs
        made side by side (bench/routing_matrix_device.sh: one process per engine cell)

Setup per engine cell (slots, KV room): ONE daemon, `trtllm-orch up --gpus 0-1 --tp 1
--assume-gpus 2 --proxy embedded --config FILE --canary-interval-s 0` (an overloaded segment's
queue outlasts the canary's timeout, and the instance would be restarted), serving a twin
repository (demo/fill_template.py) with the cell's engine: triton_max_batch_size = slots,
max_tokens_in_paged_kv_cache = the cell's KV tokens, twin_tokens_per_block 64, KV reuse on,
guaranteed_no_evict, twin_decode_ms 20, twin_prefill_ms_per_token 0.1 (routing_cells.py has the numbers).

Targets, in front of the same two instances:
  cost-model, prefix-affinity, least-outstanding, round-robin
      the daemon's embedded data plane; the policy switched by rewriting `lb_policy` in the
      --config file and `trtllm-orch reload` (nothing restarts; every visit's prompts are new, so
      caches left by an earlier visit do not help it)
  nginx
      a private NGINX from the config `--proxy nginx` renders (bench.common.SideNginx: same
      template, `least_conn`, keepalive, retries), pointed at the same instances

Load: the cell's workload (routing_cells.sessions), streamed (`generate_stream`, SSE): open loop
(Poisson session starts at the cell's rate; a chat's next turn THINK_S after its answer, the
answer text being the streamed tokens) for `--seconds`, then up to `--drain-s` for the requests
still running (those cut count with their elapsed time, column `cut`); or closed loop at the
cell's concurrency. Within a round every target gets the same arrival times and draws; rounds
visit the targets in rotated order.

Reported per cell and target (pooled over rounds): TTFT p50/p90/p99, end-to-end p99, output
tokens/s (tokens received in the load window / window), instance shares, the KV reuse hit rate
(delta of the twin's reused-block counter over the full prompt blocks of the requests admitted),
the embedded targets' routing reasons, and the simulator's TTFT p90 and tokens/s for the same
cell and seconds. Goals (issue 24): no cell where cost-model is worse than the best of
least-outstanding and nginx by more than 3% in TTFT p90 or tokens/s; where the caches cannot
hold every prefix on every instance, TTFT p90 <= 0.5 x nginx and tokens/s >= 1.3 x.

Noise: 2 shared cores run the instances, the proxies and this load generator; the twin's time
is modelled (sleep), its CPU cost is not, so the comparisons are inside one run.
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

from bench import routing_cells as rc
from bench.common import SideNginx, machine, pct, table, use_uvloop, write_result
from tests.harness import DEMO_REPO, Run

STREAM = "/v2/models/ensemble/generate_stream"
HEADERS = {"Content-Type": "application/json"}
EMBEDDED = ("cost-model", "prefix-affinity", "least-outstanding", "round-robin", "kv-aware")


# --- the model repository ----------------------------------------------------------------
def twin_repo(dest: Path, slots: int, kv_tokens: int) -> Path:
    sys.path.insert(0, str(DEMO_REPO.parent))
    import fill_template

    return fill_template.write_repo(dest / "model_repo", streaming=True, overrides={
        "triton_max_batch_size": str(slots),
        "max_tokens_in_paged_kv_cache": str(kv_tokens),
        "twin_tokens_per_block": str(rc.BLOCK),
        "enable_kv_cache_reuse": "true",
        "batch_scheduler_policy": "guaranteed_no_evict",
        "twin_decode_ms": str(rc.DECODE_MS),
        "twin_prefill_ms_per_token": str(rc.PREFILL_MS),
    })


def stream_body(prompt: str, max_tokens: int) -> bytes:
    return json.dumps({"text_input": prompt, "max_tokens": max_tokens, "bad_words": "",
                       "stop_words": "", "stream": True}).encode()


# --- load ----------------------------------------------------------------------------------
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


async def _one(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int, load: Load,
               t_end: float, perf=time.perf_counter) -> str | None:
    """One streamed request; returns the answer text (None on failure)."""
    rec = Rec((len(prompt.encode()) - 1) // rc.BLOCK)
    load.recs.append(rec)
    text: list[str] = []
    t0 = perf()
    try:
        async with session.post(url, data=stream_body(prompt, max_tokens), headers=HEADERS) as r:
            if r.status != 200:
                rec.error = f"http_{r.status}"
                await r.read()
                return None
            async for line in r.content:
                if not line.startswith(b"data:"):
                    continue
                now = perf()
                if line.startswith(b'data: {"error"'):
                    rec.error = "sse_error"
                    return None
                if rec.ttft is None:
                    rec.ttft = now - t0
                rec.tokens += 1
                if now <= t_end:
                    load.window_tokens += 1
                try:
                    text.append(json.loads(line[5:]).get("text_output", ""))
                except ValueError:
                    pass
        rec.e2e = perf() - t0
        return "".join(text)
    except asyncio.CancelledError:
        now = perf()
        rec.cut = True
        rec.e2e = now - t0
        if rec.ttft is None:
            rec.ttft = now - t0
        raise
    except Exception as exc:  # noqa: BLE001 - a failed request is a data point
        rec.error = type(exc).__name__
        return None


def _client() -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=120)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, skip_auto_headers=("User-Agent",))


async def run_load(url: str, cell: rc.Cell, salt: str, seq: str, seconds: float, drain_s: float) -> Load:
    load = Load(window_s=seconds)
    perf = time.perf_counter
    source = rc.sessions(cell, salt=salt, seed=seq)
    rate = cell.rate()
    async with _client() as client:
        start = perf() + 0.05
        t_end = start + seconds

        async def session_task(s: rc.Session, n: int, forever: bool) -> None:
            think = random.Random(f"{seq}/think{n}")
            while True:
                req = s.first()
                while req is not None and perf() < t_end:
                    answer = await _one(client, url, req[0], req[1], load, t_end)
                    if answer is None:
                        break
                    req = s.next(answer)
                    if req is not None and rate is not None and s.think_s:
                        await asyncio.sleep(think.expovariate(1.0 / s.think_s))
                if not forever or perf() >= t_end:
                    return
                s = next(source)

        tasks = []
        if rate is None:
            tasks = [asyncio.ensure_future(session_task(next(source), n, True)) for n in range(cell.concurrency)]
        else:
            arrivals = random.Random(f"{seq}/arrivals/{cell.name}")
            mean_turns = 5.0 if cell.workload == "chat" else 1.0
            t, n = 0.0, 0
            while True:
                t += arrivals.expovariate(rate / mean_turns)
                if t >= seconds:
                    break
                delay = start + t - perf()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.ensure_future(session_task(next(source), n, False)))
                n += 1
        left = t_end - perf()
        if left > 0:
            await asyncio.sleep(left)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=drain_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return load


# --- the instances' own metrics --------------------------------------------------------------
_SUCCESS = re.compile(r'^nv_inference_request_success\{model="ensemble",version="1"\} (\S+)', re.M)
_REUSED = re.compile(r'^nv_trt_llm_kv_cache_block_metrics\{kv_cache_block_type="reused"[^}]*\} (\S+)', re.M)
_ACTIVE = re.compile(r'^nv_trt_llm_request_metrics\{[^}]*request_type="active"[^}]*\} (\S+)', re.M)
_QUEUED = re.compile(r'^twin_executor_queued_requests\{[^}]*\} (\S+)', re.M)
_DECISION = re.compile(r'^trtllm_orch_proxy_routing_decisions_total\{([^}]*)\} (\S+)', re.M)


def _get(url: str, patience_s: float = 60.0) -> str:
    """A scrape; an instance the daemon is restarting (overload on two shared cores can fail its
    health checks) is waited for."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            return urllib.request.urlopen(url, timeout=5).read().decode()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def scrape(port: int) -> dict[str, float]:
    text = _get(f"http://127.0.0.1:{port}/metrics")
    out = {}
    for key, rx in (("success", _SUCCESS), ("reused", _REUSED), ("active", _ACTIVE), ("queued", _QUEUED)):
        m = rx.search(text)
        out[key] = float(m.group(1)) if m else 0.0
    return out


def decisions(metrics_port: int) -> dict[str, float]:
    """The embedded data plane's routing decisions by reason."""
    out: dict[str, float] = {}
    for labels, value in _DECISION.findall(_get(f"http://127.0.0.1:{metrics_port}/metrics")):
        reason = dict(re.findall(r'(\w+)="([^"]*)"', labels)).get("reason", "")
        out[reason] = out.get(reason, 0.0) + float(value)
    return out


def wait_idle(ports: list[int], timeout: float = 60.0) -> bool:
    """Until every engine has nothing active or queued, so a segment's metric deltas are its own."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(s["active"] == 0 and s["queued"] == 0 for s in (scrape(p) for p in ports)):
            return True
        time.sleep(0.2)
    return False


def segment(url: str, ports: list[int], cell: rc.Cell, salt: str, seq: str, a: argparse.Namespace,
            proxy_metrics_port: int | None) -> dict[str, Any]:
    before = [scrape(p) for p in ports]
    d0 = decisions(proxy_metrics_port) if proxy_metrics_port else {}
    t0 = time.time()
    load = asyncio.run(run_load(url, cell, salt, seq, a.seconds, a.drain_s))
    wall = time.time() - t0
    idle = wait_idle(ports)
    after = [scrape(p) for p in ports]
    d1 = decisions(proxy_metrics_port) if proxy_metrics_port else {}
    started = [r for r in load.recs if r.ttft is not None and not (r.cut and r.tokens == 0)]
    return {
        "ttft_s": [r.ttft for r in load.recs if r.ttft is not None],
        "e2e_s": [r.e2e for r in load.recs if r.e2e is not None and r.error is None],
        "sent": len(load.recs), "failed": sum(1 for r in load.recs if r.error is not None),
        "errors": sorted({r.error for r in load.recs if r.error}), "cut": sum(1 for r in load.recs if r.cut),
        "window_tokens": load.window_tokens, "window_s": load.window_s, "wall_s": round(wall, 1),
        "served_per_instance": [int(y["success"] - x["success"]) for x, y in zip(before, after)],
        "kv_reused_blocks": int(sum(max(0.0, y["reused"] - x["reused"]) for x, y in zip(before, after))),
        "prompt_blocks_admitted": sum(r.prompt_blocks for r in started), "idle_after": idle,
        "routing_decisions": {k: int(v - d0.get(k, 0.0)) for k, v in d1.items() if v - d0.get(k, 0.0) > 0},
    }


def summarize(segs: list[dict[str, Any]]) -> dict[str, Any]:
    ttft = [x * 1000 for s in segs for x in s["ttft_s"]]
    e2e = [x * 1000 for s in segs for x in s["e2e_s"]]
    served = [sum(s["served_per_instance"][i] for s in segs) for i in range(len(segs[0]["served_per_instance"]))]
    total = sum(served)
    potential = sum(s["prompt_blocks_admitted"] for s in segs)
    reasons: dict[str, int] = {}
    for s in segs:
        for k, v in s["routing_decisions"].items():
            reasons[k] = reasons.get(k, 0) + v
    return {
        "n": len(ttft), "failed": sum(s["failed"] for s in segs), "cut": sum(s["cut"] for s in segs),
        "ttft_p50_ms": pct(ttft, 50), "ttft_p90_ms": pct(ttft, 90), "ttft_p99_ms": pct(ttft, 99),
        "e2e_p99_ms": pct(e2e, 99),
        "out_tok_s": round(sum(s["window_tokens"] for s in segs) / sum(s["window_s"] for s in segs), 1),
        "share": [round(x / total, 3) if total else None for x in served],
        "kv_hit_rate": round(sum(s["kv_reused_blocks"] for s in segs) / potential, 3) if potential else None,
        "routing_decisions": reasons,
    }


# --- targets ---------------------------------------------------------------------------------
class Targets:
    def __init__(self, run: Run, config: Path, nginx: SideNginx) -> None:
        self.run, self.config, self.nginx = run, config, nginx
        self.policy: str | None = None

    def url(self, target: str) -> str:
        if target == "nginx":
            return self.nginx.url(STREAM)
        self.set_policy(target)
        return self.run.url(STREAM)

    def set_policy(self, policy: str) -> None:
        if policy == self.policy:
            return
        gen = self.run.status()["daemon"]["config_generation"]
        self.config.write_text(f'lb_policy = "{policy}"\n')
        self.run.cli("reload", "--state-dir", str(self.run.state_dir), check=True)
        self.run.wait_for(lambda st: st["daemon"]["config_generation"] > gen and not st["daemon"]["rolling_restart"]
                          and st["ready"] == st["total"] and all(
                              (i.get("engine") or {}).get("age_s", 9) < 0.5 for i in st["instances"]),
                          timeout=60, what=f"reload to {policy}")
        self.policy = policy


def _rotate(xs: list[Any], k: int) -> list[Any]:
    k %= len(xs)
    return xs[k:] + xs[:k]


def run_engine_cell(slots: int, room: float, cells: list[rc.Cell], targets: list[str], a: argparse.Namespace,
                    raw: dict[str, dict[str, list]]) -> list[int]:
    """One daemon for the cells of one engine shape and KV room; returns leaked pids."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-routing-"))
    repo = twin_repo(tmp, slots, cells[0].kv_tokens)
    config = tmp / "trtllm-orch.toml"
    config.write_text('lb_policy = "least-outstanding"\n')
    # No canary: in an overloaded segment its generate waits behind the queue past its timeout
    # and the daemon restarts the instance (seen at 20 req/s on least-outstanding's segments).
    run = Run(tmp, gpus="0-1", tp=1, assume_gpus=2, proxy="embedded",
              extra=("--config", str(config), "--canary-interval-s", "0"),
              env_extra={"DEMO_TOKEN_DELAY_MS": str(rc.DECODE_MS)}, model_repo=repo)
    ngx = None
    try:
        run.start()
        st = run.status()
        ports = [i["ports"]["metrics"] for i in st["instances"]]
        ngx = SideNginx(st).start()
        tg = Targets(run, config, ngx)
        tg.policy = "least-outstanding"
        for cell in cells:
            for rnd in range(a.rounds):
                for target in _rotate(targets, rnd):
                    url = tg.url(target)
                    seg = segment(url, ports, cell, f"r{rnd}-{target}-{cell.workload}", f"round{rnd}", a,
                                  None if target == "nginx" else run.metrics_port)
                    raw[cell.name][target].append(seg)
                    s = summarize([seg])
                    print(f"  [{cell.name} round {rnd + 1}] {target:<17} TTFT p50 {s['ttft_p50_ms']} p90 "
                          f"{s['ttft_p90_ms']} ms  {s['out_tok_s']} tok/s  share {s['share']}  hit {s['kv_hit_rate']}  "
                          f"n {s['n']} cut {s['cut']} failed {s['failed']}  wall {seg['wall_s']} s  "
                          f"{s['routing_decisions'] if target != 'nginx' else ''}", flush=True)
    finally:
        if ngx is not None:
            ngx.stop()
        leaked = run.close()
    return leaked


# --- output ----------------------------------------------------------------------------------
COLS = ["target", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "e2e_p99_ms", "out_tok_s", "share", "kv_hit_rate",
        "n", "cut", "failed", "sim_ttft_p90_ms", "sim_out_tok_s"]
STYLES = {"round-robin": "tab:gray", "nginx": "tab:red", "least-outstanding": "tab:blue", "kv-aware": "tab:purple",
          "prefix-affinity": "tab:olive", "cost-model": "tab:green"}


def plot(result: dict[str, Any], plt: Any) -> Any:
    """Per cell: TTFT p90 and output tokens/s of every target, real twin (bars) and simulator (dots)."""
    cells = result["cells"]
    targets = result["targets"]
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 2.2 * len(cells)), 8))
    width = 0.8 / len(targets)
    for k, (key, sim_key, title) in enumerate((("ttft_p90_ms", "sim_ttft_p90_ms", "TTFT p90 (ms, log)"),
                                               ("out_tok_s", "sim_out_tok_s", "output tokens/s"))):
        ax = axes[k]
        for j, t in enumerate(targets):
            xs = [i + (j - len(targets) / 2 + 0.5) * width for i in range(len(cells))]
            ax.bar(xs, [result["summary"][c][t][key] or 0 for c in cells], width, color=STYLES.get(t, "k"),
                   label=t if k == 0 else None)
            ax.plot(xs, [result["summary"][c][t].get(sim_key) or float("nan") for c in cells], "k.", markersize=6,
                    label="simulator" if (k == 0 and j == 0) else None)
        ax.set_xticks(range(len(cells)))
        ax.set_xticklabels(cells, fontsize=8)
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
        if k == 0:
            ax.set_yscale("log")
            ax.legend(fontsize=8, ncol=3)
    fig.suptitle(f"routing_bench: real twin, 2 instances x TP1, {result['params']['seconds']:g} s per visit, "
                 f"{result['params']['rounds']} round(s); dots: bench/routing_sim.py on the same cells", fontsize=10)
    fig.tight_layout()
    return fig


def merge(paths: list[str], out_dir: Path | None) -> int:
    """Results of the same targets and parameters on other cells (processes run side by side),
    as one result."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    first = parts[0]
    for p, part in zip(paths, parts):
        if part["targets"] != first["targets"] or part["params"] != first["params"]:
            raise SystemExit(f"{p}: other targets or parameters than {paths[0]}")
    result: dict[str, Any] = {k: first[k] for k in ("bench", "machine", "params", "targets", "generator")}
    for key in ("cells", "leaked_pids"):
        result[key] = [x for part in parts for x in part[key]]
    for key in ("cell_params", "summary", "segments"):
        result[key] = {k: v for part in parts for k, v in part[key].items()}
    result["goals"] = rc.verdicts([{"cell": c, "target": t, **s} for c, block in result["summary"].items()
                                   for t, s in block.items()])  # judged again: a part may judge another policy
    result["goals_policy"] = rc.default_policy()
    result["wall_s"] = max(part["wall_s"] for part in parts)
    result["merged_from"] = [Path(p).name for p in paths]
    for name in result["cells"]:
        rows = [{"target": t, **s, "share": "/".join(f"{x:.2f}" for x in s["share"] if x is not None)}
                for t, s in result["summary"][name].items()]
        print(f"\n{name}")
        print(table(rows, COLS))
    if result["goals"]:
        print(table(result["goals"], ["cell", "ttft_p90_vs_best", "tok_s_vs_best", "ttft_p90_vs_nginx",
                                      "tok_s_vs_nginx", "no_worse"]))
    print("wrote", write_result("routing_bench", result, plot, out_dir))
    return 1 if result["leaked_pids"] else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", help="comma-separated cell names (routing_cells.py), e.g. s8/room4/uniform/r1")
    ap.add_argument("--targets", default=",".join(rc.TARGETS))
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--drain-s", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--no-sim", action="store_true", help="skip the simulator's numbers")
    ap.add_argument("--out", help="write the result (JSON, PNG) into this directory instead of bench/results")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="merge these results of other cells into one")
    a = ap.parse_args()
    out_dir = Path(a.out) if a.out else None
    if a.merge:
        return merge(a.merge, out_dir)
    if not a.cells:
        ap.error("--cells or --merge")
    by_name = {c.name: c for c in rc.cells()}
    cells = [by_name[n] for n in a.cells.split(",")]
    targets = a.targets.split(",")
    uv = use_uvloop()
    t_start = time.time()
    raw: dict[str, dict[str, list]] = {c.name: {t: [] for t in targets} for c in cells}
    leaked: list[int] = []
    groups: dict[tuple[int, float], list[rc.Cell]] = {}
    for c in cells:
        groups.setdefault((c.slots, c.room), []).append(c)
    for (slots, room), group in groups.items():
        leaked += run_engine_cell(slots, room, group, targets, a, raw)
    summary = {c: {t: summarize(segs) for t, segs in block.items() if segs} for c, block in raw.items()}
    if not a.no_sim:
        from bench import routing_sim
        for c in cells:
            for t in targets:
                sim = routing_sim.simulate(c, t, a.seconds, tuple(range(1, a.rounds + 1)))
                summary[c.name][t]["sim_ttft_p90_ms"] = sim["ttft_p90_ms"]
                summary[c.name][t]["sim_out_tok_s"] = sim["out_tok_s"]
    result: dict[str, Any] = {
        "bench": "routing_bench", "machine": machine(),
        "params": {"seconds": a.seconds, "drain_s": a.drain_s, "rounds": a.rounds, "decode_ms": rc.DECODE_MS,
                   "prefill_ms": rc.PREFILL_MS, "block": rc.BLOCK, "prefix_tokens": rc.PREFIX_TOKENS},
        "cells": [c.name for c in cells], "targets": targets,
        "cell_params": {c.name: {"slots": c.slots, "room": c.room, "kv_tokens": c.kv_tokens, "tenants": c.tenants,
                                 "rate": c.rate(), "concurrency": None if c.rate() else c.concurrency} for c in cells},
        "generator": {"kind": "asyncio, one aiohttp ClientSession; generate_stream SSE", "uvloop": uv,
                      "same_cores_as_targets": True},
        "summary": summary,
        "segments": {c: {t: [{k: v for k, v in s.items() if k not in ("ttft_s", "e2e_s")} for s in segs]
                         for t, segs in block.items()} for c, block in raw.items()},
        "leaked_pids": leaked,
    }
    for c in cells:
        print(f"\n{c.name} (KV {c.kv_tokens} tokens, tenants {c.tenants}, "
              f"{'rate ' + str(c.rate()) + ' req/s' if c.rate() else 'closed c' + str(c.concurrency)})")
        rows = [{"target": t, **s, "share": "/".join(f"{x:.2f}" for x in s["share"] if x is not None)}
                for t, s in summary[c.name].items()]
        print(table(rows, COLS))
    result["goals"] = rc.verdicts([{"cell": c, "target": t, **s} for c, block in summary.items()
                                   for t, s in block.items()])
    result["goals_policy"] = rc.default_policy()
    if result["goals"]:
        print(f"\n{rc.default_policy()} (the default) against the best of least-outstanding and nginx, "
              "and against nginx:")
        print(table(result["goals"], ["cell", "ttft_p90_vs_best", "tok_s_vs_best", "ttft_p90_vs_nginx",
                                      "tok_s_vs_nginx", "no_worse"]))
    result["wall_s"] = round(time.time() - t_start, 1)
    path = write_result("routing_bench", result, plot, out_dir)
    print(f"wrote {path} (wall {result['wall_s']} s)")
    if leaked:
        print(f"LEAKED processes killed by the harness: {leaked}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    os.chdir(Path(__file__).resolve().parent.parent)
    sys.exit(main())
