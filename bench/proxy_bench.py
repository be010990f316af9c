"""Proxy overhead and balancing (issue 3): direct vs NGINX vs the embedded proxy, in ONE run.

    .venv/bin/python -m bench.proxy_bench [--scenario small|mixed|all] [--rounds 3]

Setup (why it is fair): ONE daemon `trtllm-orch up --proxy embedded` with 2 instances x TP1
(`--assume-gpus 2`). Every target fronts exactly those two tritonservers:
  - direct      : instance 0's loopback HTTP port (one instance, no proxy)
  - direct-2    : the client itself spreads its workers over both instances' ports
                  (the no-proxy baseline for 2 instances; reference only)
  - nginx       : a private NGINX started from the config trtllm-orch renders for
                  `--proxy nginx` (orchestrator.nginx.proxy.render_nginx_config: same template,
                  least_conn, upstream keepalive, retries), pointed at the same instances.
                  `worker_processes` one per core (2 on this 2-core box).
  - nginx-1w    : the same config with `worker_processes 1`: on this box both proxies'
                  default count (`--proxy-workers auto`, a quarter of the CPUs, at least 1),
                  the like-for-like CPU budget for the embedded data plane's one worker.
  - embedded    : the product path: `up --proxy embedded`'s data-plane worker(s) (least-outstanding).
  - emb-uvloop  : (diagnostic) the same EmbeddedProxy code in its own process on uvloop.
  - emb-rr      : (mixed scenario) the same EmbeddedProxy code in its own process, round-robin.
Starting NGINX beside the embedded daemon (instead of a second `--proxy nginx` daemon)
keeps the backends identical and the machine load the same for every target.

Scenario "small": `generate` with max_tokens 1 and DEMO_TOKEN_DELAY_MS=0, closed loop at
concurrency 16 (throughput and latency) and at concurrency 1 (pure added latency per hop:
at concurrency 16 on 2 shared cores the p50 is mostly CPU queueing, not the proxy hop).
Scenario "mixed": a second daemon with DEMO_TOKEN_DELAY_MS=5 and max_tokens uniformly
1..64 from a fixed seed (the same sequence for every target), concurrency 16: p99 of the
embedded proxy (least-outstanding) vs NGINX least_conn, and embedded round-robin.

Noise: the box has 2 cores shared with other engineers' tests, and the load generator
(asyncio + aiohttp on uvloop, one ClientSession, keep-alive) runs on the same cores. Every
scenario runs `--rounds` rounds, each round visiting every target once in rotated order;
the table shows per-target medians over rounds, and the ratios are computed per round and
then the median taken.

Goals: embedded/nginx throughput >= 0.8; embedded p50 - direct p50 <= 0.3 ms;
mixed p99: embedded least-outstanding < nginx least_conn.

`--wrk` (issue 12): the same comparison with wrk, a C load generator (`apt-get install -y
wrk`), which costs the shared cores far less per request than the Python generator above
and so does not hide the proxy's cost. Targets: direct (instance 0), nginx-1w (the
rendered config, 1 worker: least_conn, keepalive), embedded (the product's: `up --proxy
embedded`, its data-plane workers at the default count, 1 on 2 cores; their CPU and the
daemon's is the proxy's) and,
with `--compare-tree DIR`, emb-before (the embedded proxy of another checkout, e.g. the
commit before a change, in its own process on the asyncio loop as that daemon ran it).
  - tiny `generate` (max_tokens 1, DEMO_TOKEN_DELAY_MS=0): req/s at 16 and 64 connections,
    p50 at 1 connection, and proxy CPU seconds per 10k requests at a fixed rate (wrk
    paced by a per-connection delay, over the time ~3000 requests take; the CPU time of the
    proxy's processes over the run, less their idle rate measured just before);
  - streaming relay capacity: two instances of a compiled token source
    (bench/sse_source.c: 32 SSE events per stream, one write each, 1 ms apart) behind
    direct / nginx-1w / embedded (the same EmbeddedProxy code in its own process, on
    uvloop as the daemon runs it), wrk with 64 concurrent streams: SSE events/s relayed,
    and events per CPU-second of the proxy;
  - time to first token at 8 concurrent streams (a second daemon, 5 ms per token, 128
    prompt characters, 32 tokens), a Python SSE client: direct-2 (streams spread over
    both instances by the client) vs nginx-1w vs embedded.
Goals: embedded/nginx-1w req/s >= 1.0 at 16 and 64 connections; p50 added at 1
connection <= 0.3 ms; SSE events/s >= nginx-1w's; TTFT added <= nginx-1w's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import (GENERATE, REPO, RESULTS, pct, SideEmbedded, SideNginx, bars, body, dataplane_pids,
                          embedded_proxy_pids, free_port, latency_bars, machine, med, mixed_bodies, run_load,
                          table, use_uvloop, wait_port, write_result)
from bench.wrk import SseSource, cpu_seconds, fake_status, idle_cpu_rate, run_wrk, ttft_load, wrk_path
from tests.harness import DEMO_REPO, Run

COLS = ["target", "rps", "p50_ms", "p90_ms", "p99_ms", "p99_pooled_ms", "n", "failed"]


def _rotate(xs: list[Any], k: int) -> list[Any]:
    k %= len(xs)
    return xs[k:] + xs[:k]


def _rounds(targets: dict[str, list[str] | str], *, rounds: int, concurrency: int, seconds: float,
            bodies, label: str) -> dict[str, Any]:
    per_round: list[dict[str, dict[str, Any]]] = []
    names = list(targets)
    pooled: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        got: dict[str, dict[str, Any]] = {}
        for name in _rotate(names, r):
            res = asyncio.run(run_load(targets[name], concurrency=concurrency, duration_s=seconds,
                                       bodies=bodies, target=name, warmup=concurrency))
            got[name] = res.summary()
            pooled[name] += res.latencies_ms
            s = got[name]
            print(f"  [{label} round {r + 1}] {name:<11} {s['rps']:>8} req/s  p50 {s['p50_ms']} ms  "
                  f"p99 {s['p99_ms']} ms  failed {s['failed']}", flush=True)
        per_round.append(got)
    medians = []
    for name in names:
        rows = [rd[name] for rd in per_round]
        medians.append({"target": name, **{k: med([x[k] for x in rows]) for k in
                                           ("rps", "p50_ms", "p90_ms", "p99_ms")},
                        "failed": sum(x["failed"] for x in rows),
                        "n": len(pooled[name]), "p99_pooled_ms": pct(pooled[name], 99)})
    return {"concurrency": concurrency, "seconds_per_target_round": seconds, "rounds": per_round,
            "medians": medians}


def _ratio(block: dict[str, Any], a: str, b: str, key: str, op: str) -> float | None:
    vals = []
    for rd in block["rounds"]:
        if a in rd and b in rd and rd[a][key] is not None and rd[b][key]:
            vals.append(rd[a][key] / rd[b][key] if op == "/" else rd[a][key] - rd[b][key])
    return med(vals)


def _pooled(block: dict[str, Any], a: str, b: str) -> float | None:
    m = {r["target"]: r["p99_pooled_ms"] for r in block["medians"]}
    return round(m[a] / m[b], 3) if m.get(a) and m.get(b) else None


def _profile(pid: int, seconds: int, out: Path, load) -> str | None:
    """py-spy record of `pid` (SVG flame graph + raw folded stacks) while `load(seconds)`
    runs; returns the svg path or None."""
    spy = Path(sys.executable).parent / "py-spy"
    if not spy.exists():
        print("no py-spy in the venv (pip install py-spy): no flame graph", file=sys.stderr)
        return None
    svg, raw = out.with_suffix(".svg"), out.with_suffix(".txt")
    procs = [subprocess.Popen([str(spy), "record", "-d", str(seconds), "-r", "200", "-p", str(pid), *fmt,
                               "-o", str(path), "--nonblocking"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
             for fmt, path in (((), svg), (("-f", "raw"), raw))]
    time.sleep(0.5)
    load(seconds - 1)
    for p in procs:
        p.wait(60)
    return str(svg) if svg.exists() else None


def scenario_small(rounds: int, c16_s: float, c1_s: float, profile: bool) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-proxy-small-"))
    run = Run(tmp, gpus="0-1", tp=1, assume_gpus=2, proxy="embedded",
              env_extra={"DEMO_TOKEN_DELAY_MS": "0"})
    ngx = ngx1 = side = None
    out: dict[str, Any] = {}
    try:
        run.start()
        st = run.status()
        ngx = SideNginx(st, workers=os.cpu_count()).start()
        ngx1 = SideNginx(st, workers=1).start()
        side = SideEmbedded(st, "least-outstanding", uvloop=True).start()
        inst = [f"http://127.0.0.1:{i['ports']['http']}{GENERATE}" for i in st["instances"]]
        targets: dict[str, Any] = {"direct": inst[0], "direct-2": inst, "nginx": ngx.url(GENERATE),
                                   "nginx-1w": ngx1.url(GENERATE), "embedded": run.url(GENERATE),
                                   "emb-uvloop": side.url(GENERATE)}
        small = lambda n: body(1)  # noqa: E731
        print(f"small: max_tokens 1, delay 0 ms, concurrency 16, {rounds} rounds x {c16_s}s", flush=True)
        out["c16"] = _rounds(targets, rounds=rounds, concurrency=16, seconds=c16_s, bodies=small,
                             label="c16")
        print(f"small: concurrency 1, {rounds} rounds x {c1_s}s", flush=True)
        out["c1"] = _rounds({k: targets[k] for k in ("direct", "nginx", "embedded")}, rounds=rounds,
                            concurrency=1, seconds=c1_s, bodies=small, label="c1")
        out["ratios"] = {
            "embedded_over_nginx_rps_c16": _ratio(out["c16"], "embedded", "nginx", "rps", "/"),
            "embedded_over_nginx1w_rps_c16": _ratio(out["c16"], "embedded", "nginx-1w", "rps", "/"),
            "embedded_minus_direct_p50_ms_c16": _ratio(out["c16"], "embedded", "direct", "p50_ms", "-"),
            "embedded_minus_direct2_p50_ms_c16": _ratio(out["c16"], "embedded", "direct-2", "p50_ms", "-"),
            "embedded_minus_direct_p50_ms_c1": _ratio(out["c1"], "embedded", "direct", "p50_ms", "-"),
            "nginx_minus_direct_p50_ms_c1": _ratio(out["c1"], "nginx", "direct", "p50_ms", "-"),
            "embuvloop_over_nginx_rps_c16": _ratio(out["c16"], "emb-uvloop", "nginx", "rps", "/"),
        }
        if profile:
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
            RESULTS.mkdir(parents=True, exist_ok=True)
            prof = RESULTS / f"proxy_bench-{stamp}-embedded-daemon"
            svg = _profile(dataplane_pids(st)[0], 8, prof, lambda sec: asyncio.run(
                run_load(run.url(GENERATE), concurrency=16, duration_s=sec, target="profile")))
            out["profile"] = {"svg": svg, "raw": str(prof.with_suffix(".txt"))}
    finally:
        for p in (side, ngx1, ngx):
            if p is not None:
                p.stop()
        leaked = run.close()
        out["leaked_pids"] = leaked
    return out


def capacity_repo(dest: Path, slots: int) -> Path:
    """A demo repository (the TRT-LLM twin) with `slots` in-flight batch slots per
    instance: the rest queue in the engine, as in a real one, so balancing policies
    change latency."""
    sys.path.insert(0, str(DEMO_REPO.parent))
    import fill_template

    return fill_template.write_repo(dest / "model_repo", streaming=True,
                                    overrides={"triton_max_batch_size": str(slots)})


def scenario_mixed(rounds: int, seconds: float, seed: int, slots: int) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-proxy-mixed-"))
    env = {"DEMO_TOKEN_DELAY_MS": "5"}
    kw: dict[str, Any] = {}
    if slots:
        kw["model_repo"] = capacity_repo(tmp, slots)
    run = Run(tmp, gpus="0-1", tp=1, assume_gpus=2, proxy="embedded", env_extra=env, **kw)
    ngx = rr = None
    out: dict[str, Any] = {"token_delay_ms": 5, "max_tokens": [1, 64], "seed": seed,
                           "model_slots_per_instance": slots or "unlimited (demo model as is)"}
    try:
        run.start()
        st = run.status()
        ngx = SideNginx(st, workers=os.cpu_count()).start()
        rr = SideEmbedded(st, "round-robin").start()
        targets = {"embedded": run.url(GENERATE), "nginx": ngx.url(GENERATE), "emb-rr": rr.url(GENERATE)}
        print(f"mixed: delay 5 ms x max_tokens 1..64 (seed {seed}), slots/instance {slots or 'unlimited'}, "
              f"concurrency 16, "
              f"{rounds} rounds x {seconds}s", flush=True)
        out.update(_rounds(targets, rounds=rounds, concurrency=16, seconds=seconds,
                           bodies=mixed_bodies(seed), label="mixed"))
        out["ratios"] = {
            "embedded_over_nginx_p99_mixed": _ratio(out, "embedded", "nginx", "p99_ms", "/"),
            "embedded_over_nginx_p99_pooled_mixed": _pooled(out, "embedded", "nginx"),
            "embrr_over_embedded_p99_pooled_mixed": _pooled(out, "emb-rr", "embedded"),
            "embedded_minus_nginx_p99_ms_mixed": _ratio(out, "embedded", "nginx", "p99_ms", "-"),
            "embrr_over_embedded_p99_mixed": _ratio(out, "emb-rr", "embedded", "p99_ms", "/"),
        }
    finally:
        for p in (rr, ngx):
            if p is not None:
                p.stop()
        out["leaked_pids"] = run.close()
    return out


# --- --wrk (issue 12) ------------------------------------------------------------------------
STREAM = "/v2/models/ensemble/generate_stream"
# NGINX's least_conn, like for like: the daemon's default (prefix-affinity) parses every
# body and, with the bench's one repeated prompt, would keep it on one instance.
LIKE_NGINX = ("--lb-policy", "least-outstanding")
WRK_COLS = ["target", "rps", "p50_ms", "p90_ms", "p99_ms", "requests", "failed"]


def _wrk_rounds(names: list[str], measure, *, rounds: int, label: str, show: str) -> dict[str, Any]:
    """`measure(name)` per target per round, targets in rotated order; medians of numbers."""
    per_round: list[dict[str, dict[str, Any]]] = []
    for r in range(rounds):
        got: dict[str, dict[str, Any]] = {}
        for name in _rotate(names, r):
            got[name] = res = measure(name)
            print(f"  [{label} round {r + 1}] {name:<11} " +
                  "  ".join(f"{k} {res.get(k)}" for k in show.split()), flush=True)
        per_round.append(got)
    medians = []
    for name in names:
        rows = [rd[name] for rd in per_round]
        row: dict[str, Any] = {"target": name}
        for k, v in rows[0].items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                row[k] = med([x.get(k) for x in rows])
        row["failed"] = sum(x.get("failed", 0) for x in rows)
        medians.append(row)
    return {"rounds": per_round, "medians": medians}


def _cpu_run(url: str, pids: list[int], data: bytes, *, requests: int, rate: float,
             connections: int = 8) -> dict[str, Any]:
    """CPU seconds of `pids` per 10k requests at about `rate` req/s (each of `connections`
    waits connections/rate after its response), less their idle use, over the time
    `requests` take at that rate. (Not wrk stopped at a count: wrk runs, and reports, its
    whole -d duration whenever its thread stops.)"""
    idle = idle_cpu_rate(pids, 2.0)
    c0 = cpu_seconds(pids)
    res = run_wrk(url, data, connections=connections, seconds=max(2, round(requests / rate)),
                  pace_ms=connections / rate * 1000)
    used = cpu_seconds(pids) - c0 - idle * res["duration_s"]
    return {**res, "cpu_s": round(used, 3), "idle_cpu_per_s": round(idle, 4),
            "cpu_s_per_10k": round(used / res["requests"] * 10000, 3) if res["requests"] else None}


class MinRelay:
    """bench/_min_relay.py (a bound: the least a Python relay does per request) in its own process."""

    def __init__(self, ports: list[int]) -> None:
        self.port = free_port()
        self.args = [sys.executable, "-m", "bench._min_relay", str(self.port), *map(str, ports)]
        self.proc: subprocess.Popen | None = None

    def start(self) -> "MinRelay":
        self.proc = subprocess.Popen(self.args, cwd=REPO, stdin=subprocess.DEVNULL, start_new_session=True)
        wait_port(self.port, proc=self.proc)
        return self

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


def wrk_small(rounds: int, seconds: float, c1_seconds: float, cpu_requests: int, cpu_rate: float,
              compare_tree: Path | None, profile: bool, bound: bool = False, front: str = "aiohttp") -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-proxy-wrk-"))
    run = Run(tmp, gpus="0-1", tp=1, assume_gpus=2, proxy="embedded", extra=LIKE_NGINX + ("--front", front),
              env_extra={"DEMO_TOKEN_DELAY_MS": "0"})
    ngx1 = before = relay = None
    out: dict[str, Any] = {"token_delay_ms": 0, "max_tokens": 1}
    try:
        run.start()
        st = run.status()
        ngx1 = SideNginx(st, workers=1).start()
        urls = {"direct": f"http://127.0.0.1:{st['instances'][0]['ports']['http']}{GENERATE}",
                "nginx-1w": ngx1.url(GENERATE), "embedded": run.url(GENERATE)}
        pids = {"direct": [], "nginx-1w": ngx1.pids(), "embedded": embedded_proxy_pids(st)}
        if compare_tree is not None:
            before = SideEmbedded(st, "least-outstanding", tree=compare_tree).start()
            urls["emb-before"] = before.url(GENERATE)
            pids["emb-before"] = [before.proc.pid]
        if bound:
            relay = MinRelay([i["ports"]["http"] for i in st["instances"]]).start()
            urls["py-bound"] = relay.url(GENERATE)
            pids["py-bound"] = [relay.proc.pid]
        names = list(urls)
        data = body(1)
        for name in names:  # warm-up: keep-alive connections and the instances' first requests
            run_wrk(urls[name], data, connections=16, seconds=1)
        show = "rps p50_ms p99_ms failed"
        for conns in (16, 64):
            print(f"wrk small: {conns} connections, {rounds} rounds x {seconds:g}s", flush=True)
            out[f"c{conns}"] = _wrk_rounds(names, lambda n, c=conns: run_wrk(urls[n], data, connections=c,
                                                                               seconds=seconds),
                                           rounds=rounds, label=f"c{conns}", show=show)
        print(f"wrk small: 1 connection, {rounds} rounds x {c1_seconds:g}s", flush=True)
        out["c1"] = _wrk_rounds(names, lambda n: run_wrk(urls[n], data, connections=1, seconds=c1_seconds),
                                rounds=rounds, label="c1", show="rps p50_ms p90_ms p99_ms")
        # The hop alone: one instance behind every target. With two, a proxy alternates and
        # each request finds its instance idle since the one before last; the twin's engine
        # loop then takes ~1 ms longer than on the instance `direct` keeps busy (measured:
        # nginx-1w +1.0 to +1.4 ms with two instances, +0.0 with one).
        one = {"instances": st["instances"][:1]}
        singles = [SideNginx(one, workers=1).start(), SideEmbedded(one, "least-outstanding", uvloop=True).start()]
        if compare_tree is not None:
            singles.append(SideEmbedded(one, "least-outstanding", tree=compare_tree).start())
        try:
            urls1 = {"direct": urls["direct"], "nginx-1w": singles[0].url(GENERATE),
                     "embedded": singles[1].url(GENERATE)}
            if compare_tree is not None:
                urls1["emb-before"] = singles[2].url(GENERATE)
            for name in urls1:
                run_wrk(urls1[name], data, connections=1, seconds=1)
            print(f"wrk small: 1 connection, one instance behind every target, {rounds} rounds x "
                  f"{c1_seconds:g}s", flush=True)
            out["c1_one"] = _wrk_rounds(list(urls1), lambda n: run_wrk(urls1[n], data, connections=1,
                                                                        seconds=c1_seconds),
                                        rounds=rounds, label="c1 one", show="rps p50_ms p90_ms p99_ms")
            out["c1_one"]["note"] = ("one instance behind every target; embedded = the daemon's EmbeddedProxy "
                                     "code in its own process on uvloop (bench/_side_proxy.py)")
        finally:
            for p in singles:
                p.stop()
        proxied = [n for n in names if pids[n]]
        print(f"wrk small: proxy CPU over ~{cpu_requests} requests paced at ~{cpu_rate:g} req/s, {rounds} rounds",
              flush=True)
        out["cpu"] = _wrk_rounds(proxied, lambda n: _cpu_run(urls[n], pids[n], data, requests=cpu_requests,
                                                              rate=cpu_rate),
                                 rounds=rounds, label="cpu", show="rps cpu_s_per_10k idle_cpu_per_s failed")
        out["cpu"]["rate_asked"] = cpu_rate
        out["ratios"] = {
            "embedded_over_nginx1w_rps_c16": _ratio(out["c16"], "embedded", "nginx-1w", "rps", "/"),
            "embedded_over_nginx1w_rps_c64": _ratio(out["c64"], "embedded", "nginx-1w", "rps", "/"),
            "embedded_minus_direct_p50_ms_c1": _ratio(out["c1"], "embedded", "direct", "p50_ms", "-"),
            "nginx1w_minus_direct_p50_ms_c1": _ratio(out["c1"], "nginx-1w", "direct", "p50_ms", "-"),
            "embedded_minus_direct_p50_ms_c1_one": _ratio(out["c1_one"], "embedded", "direct", "p50_ms", "-"),
            "nginx1w_minus_direct_p50_ms_c1_one": _ratio(out["c1_one"], "nginx-1w", "direct", "p50_ms", "-"),
            "embedded_over_nginx1w_cpu_per_10k": _ratio(out["cpu"], "embedded", "nginx-1w", "cpu_s_per_10k", "/"),
        }
        if before is not None:
            out["ratios"].update({
                "before_over_nginx1w_rps_c16": _ratio(out["c16"], "emb-before", "nginx-1w", "rps", "/"),
                "before_over_nginx1w_rps_c64": _ratio(out["c64"], "emb-before", "nginx-1w", "rps", "/"),
                "before_minus_direct_p50_ms_c1": _ratio(out["c1"], "emb-before", "direct", "p50_ms", "-"),
                "before_minus_direct_p50_ms_c1_one": _ratio(out["c1_one"], "emb-before", "direct", "p50_ms", "-"),
                "before_over_nginx1w_cpu_per_10k": _ratio(out["cpu"], "emb-before", "nginx-1w",
                                                          "cpu_s_per_10k", "/"),
            })
        if profile:
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
            RESULTS.mkdir(parents=True, exist_ok=True)
            prof = RESULTS / f"proxy_bench-{stamp}-embedded-wrk-c16"
            svg = _profile(dataplane_pids(st)[0], 10, prof,
                           lambda sec: run_wrk(urls["embedded"], data, connections=16, seconds=sec))
            out["profile"] = {"svg": svg, "raw": str(prof.with_suffix(".txt")), "load": "wrk c16, 9 s"}
        if relay is not None:
            out["ratios"]["bound_over_nginx1w_rps_c16"] = _ratio(out["c16"], "py-bound", "nginx-1w", "rps", "/")
            out["ratios"]["bound_over_nginx1w_rps_c64"] = _ratio(out["c64"], "py-bound", "nginx-1w", "rps", "/")
            out["ratios"]["bound_over_nginx1w_cpu_per_10k"] = _ratio(out["cpu"], "py-bound", "nginx-1w",
                                                                     "cpu_s_per_10k", "/")
    finally:
        for p in (relay, before, ngx1):
            if p is not None:
                p.stop()
        out["leaked_pids"] = run.close()
    return out


def wrk_stream(rounds: int, seconds: float, events: int, gap_us: int, connections: int) -> dict[str, Any]:
    sources = [SseSource(events, gap_us).start() for _ in range(2)]
    fake = fake_status([s.port for s in sources])
    ngx1 = emb = None
    out: dict[str, Any] = {"source": "bench/sse_source.c x 2", "events_per_stream": events,
                           "event_gap_us": gap_us, "streams": connections}
    try:
        ngx1 = SideNginx(fake, workers=1).start()
        emb = SideEmbedded(fake, "least-outstanding", uvloop=True).start()
        urls = {"direct": f"http://127.0.0.1:{sources[0].port}{STREAM}", "nginx-1w": ngx1.url(STREAM),
                "embedded": emb.url(STREAM)}
        pids = {"direct": [], "nginx-1w": ngx1.pids(), "embedded": [emb.proc.pid]}
        data = b'{"text_input": "hello", "max_tokens": %d, "stream": true}' % events

        def measure(name: str) -> dict[str, Any]:
            c0 = cpu_seconds(pids[name])
            res = run_wrk(urls[name], data, connections=connections, seconds=seconds)
            cpu = cpu_seconds(pids[name]) - c0
            res["events_per_s"] = round(res["rps"] * events, 1)
            res["proxy_cpu_s"] = round(cpu, 3) if pids[name] else None
            res["events_per_cpu_s"] = round(res["requests"] * events / cpu) if pids[name] and cpu > 0 else None
            return res

        for name in urls:
            run_wrk(urls[name], data, connections=connections, seconds=1)
        print(f"wrk stream: {connections} streams x {events} events, {gap_us} us apart, "
              f"{rounds} rounds x {seconds:g}s", flush=True)
        out.update(_wrk_rounds(list(urls), measure, rounds=rounds, label="stream",
                               show="events_per_s events_per_cpu_s p50_ms failed"))
        out["ratios"] = {
            "embedded_over_nginx1w_events_per_s": _ratio(out, "embedded", "nginx-1w", "events_per_s", "/"),
            "embedded_over_nginx1w_events_per_cpu_s": _ratio(out, "embedded", "nginx-1w", "events_per_cpu_s", "/"),
        }
    finally:
        for p in (emb, ngx1, *sources):
            if p is not None:
                p.stop()
    return out


def wrk_ttft(rounds: int, seconds: float, streams: int, front: str = "aiohttp") -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-proxy-ttft-"))
    run = Run(tmp, gpus="0-1", tp=1, assume_gpus=2, proxy="embedded", extra=LIKE_NGINX + ("--front", front),
              env_extra={"DEMO_TOKEN_DELAY_MS": "5"})
    ngx1 = None
    out: dict[str, Any] = {"token_delay_ms": 5, "prompt_chars": 128, "max_tokens": 32, "streams": streams,
                           "client": "Python (aiohttp on uvloop), TTFT = request sent -> first data: event"}
    try:
        run.start()
        st = run.status()
        ngx1 = SideNginx(st, workers=1).start()
        urls = {"direct-2": [f"http://127.0.0.1:{i['ports']['http']}{STREAM}" for i in st["instances"]],
                "nginx-1w": [ngx1.url(STREAM)], "embedded": [run.url(STREAM)]}
        data = json.dumps({"text_input": "x" * 128, "max_tokens": 32, "bad_words": "", "stop_words": "",
                           "stream": True}).encode()
        for name in urls:
            asyncio.run(ttft_load(urls[name], data, streams=streams, seconds=1))

        def measure(name: str) -> dict[str, Any]:
            res = asyncio.run(ttft_load(urls[name], data, streams=streams, seconds=seconds))
            res.pop("ttft_ms")
            return res

        print(f"ttft: {streams} streams, {rounds} rounds x {seconds:g}s", flush=True)
        out.update(_wrk_rounds(list(urls), measure, rounds=rounds, label="ttft",
                               show="n p50_ms p90_ms p99_ms failed"))
        out["ratios"] = {
            "embedded_minus_direct2_ttft_p50_ms": _ratio(out, "embedded", "direct-2", "p50_ms", "-"),
            "nginx1w_minus_direct2_ttft_p50_ms": _ratio(out, "nginx-1w", "direct-2", "p50_ms", "-"),
            "embedded_minus_nginx1w_ttft_p50_ms": _ratio(out, "embedded", "nginx-1w", "p50_ms", "-"),
            "embedded_minus_nginx1w_ttft_p99_ms": _ratio(out, "embedded", "nginx-1w", "p99_ms", "-"),
        }
    finally:
        if ngx1 is not None:
            ngx1.stop()
        out["leaked_pids"] = run.close()
    return out


def wrk_goals(result: dict[str, Any]) -> dict[str, tuple[Any, bool]]:
    goals: dict[str, tuple[Any, bool]] = {}
    small = result.get("small") or {}
    r = small.get("ratios") or {}
    for c in (16, 64):
        v = r.get(f"embedded_over_nginx1w_rps_c{c}")
        goals[f"embedded/nginx-1w req/s >= 1.0 (c{c})"] = (v, v is not None and v >= 1.0)
    v = r.get("embedded_minus_direct_p50_ms_c1_one")
    goals["embedded p50 - direct p50 <= 0.3 ms (c1, one instance behind every target)"] = (
        v, v is not None and v <= 0.3)
    s = (result.get("stream") or {}).get("ratios") or {}
    v = s.get("embedded_over_nginx1w_events_per_s")
    goals["SSE events/s embedded/nginx-1w >= 1.0"] = (v, v is not None and v >= 1.0)
    t = (result.get("ttft") or {}).get("ratios") or {}
    v = t.get("embedded_minus_nginx1w_ttft_p50_ms")
    goals["TTFT p50 added by embedded <= nginx-1w's (embedded - nginx-1w <= 0)"] = (v, v is not None and v <= 0)
    return goals


def wrk_report(result: dict[str, Any]) -> None:
    small = result.get("small")
    if small:
        for key, title in (("c16", "16 connections"), ("c64", "64 connections"), ("c1", "1 connection"),
                           ("c1_one", "1 connection, one instance behind every target")):
            print(f"\ntiny generate, {title} (wrk; medians over rounds)")
            print(table(small[key]["medians"], WRK_COLS))
        print("\nproxy CPU per 10k requests at a fixed rate (medians over rounds)")
        print(table(small["cpu"]["medians"], ["target", "rps", "requests", "cpu_s_per_10k", "idle_cpu_per_s",
                                              "failed"]))
        for k, v in small["ratios"].items():
            print(f"  {k:<40} {v}")
    stream = result.get("stream")
    if stream:
        print("\nstreaming relay capacity (wrk, compiled token source; medians over rounds)")
        print(table(stream["medians"], ["target", "events_per_s", "events_per_cpu_s", "rps", "p50_ms", "p99_ms",
                                        "failed"]))
        for k, v in stream["ratios"].items():
            print(f"  {k:<40} {v}")
    ttft = result.get("ttft")
    if ttft:
        print("\ntime to first token, 8 concurrent streams (medians over rounds)")
        print(table(ttft["medians"], ["target", "n", "p50_ms", "p90_ms", "p99_ms", "failed"]))
        for k, v in ttft["ratios"].items():
            print(f"  {k:<40} {v}")


def plot_wrk(result: dict[str, Any], plt: Any) -> Any:
    small, stream, ttft = result.get("small") or {}, result.get("stream") or {}, result.get("ttft") or {}
    panels = []
    if small:
        panels += ["rps", "c1", "cpu"]
    if stream:
        panels.append("stream")
    if ttft:
        panels.append("ttft")
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 3.0 * len(panels)), squeeze=False)
    for ax, key in zip(axes[:, 0], panels):
        if key == "rps":
            names = [r["target"] for r in small["c16"]["medians"]]
            bars(ax, names, {f"c{c}": [r["rps"] for r in small[f"c{c}"]["medians"]] for c in (16, 64)},
                 ylabel="req/s", title="tiny generate: throughput (wrk)")
        elif key == "c1":
            latency_bars(ax, small["c1_one"]["medians"],
                         "tiny generate, 1 connection, one instance behind each: latency (the hop's cost)")
        elif key == "cpu":
            rows = small["cpu"]["medians"]
            bars(ax, [r["target"] for r in rows], {"CPU s / 10k req": [r["cpu_s_per_10k"] for r in rows]},
                 ylabel="CPU s", title=f"proxy CPU per 10k requests at ~{small['cpu'].get('rate_asked')} req/s",
                 fmt="{:.2f}")
        elif key == "stream":
            rows = stream["medians"]
            bars(ax, [r["target"] for r in rows], {"SSE events/s": [r["events_per_s"] for r in rows]},
                 ylabel="events/s", title=f"streaming relay: {stream['streams']} streams from a compiled source")
        else:
            latency_bars(ax, ttft["medians"], "time to first token, 8 streams, 5 ms/token")
    fig.suptitle("proxy_bench --wrk: medians of rounds (same upstreams behind every target)", fontsize=11)
    fig.tight_layout()
    return fig


def plot(result: dict[str, Any], plt: Any) -> Any:
    """Latency percentiles per target for each scenario run, and c16 throughput."""
    if result.get("mode") == "wrk":
        return plot_wrk(result, plt)
    panels = []
    small = result.get("small") or {}
    if small.get("c16"):
        panels.append(("c16", "small, concurrency 16: latency"))
        panels.append(("rps", "small, concurrency 16: throughput"))
    if small.get("c1"):
        panels.append(("c1", "small, concurrency 1: latency (the hop's cost)"))
    if (result.get("mixed") or {}).get("medians"):
        panels.append(("mixed", "mixed lengths, 4 slots/instance, concurrency 16: latency"))
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 3.2 * len(panels)), squeeze=False)
    for ax, (key, title) in zip(axes[:, 0], panels):
        if key == "rps":
            rows = small["c16"]["medians"]
            bars(ax, [r["target"] for r in rows], {"req/s": [r["rps"] for r in rows]}, ylabel="req/s", title=title)
        elif key == "mixed":
            latency_bars(ax, result["mixed"]["medians"], title)
        else:
            latency_bars(ax, small[key]["medians"], title)
    fig.suptitle("proxy_bench: medians of rounds (same instances behind every target)", fontsize=11)
    fig.tight_layout()
    return fig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", choices=("small", "mixed", "all"), default="all")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--c16-seconds", type=float, default=4.0)
    ap.add_argument("--c1-seconds", type=float, default=3.0)
    ap.add_argument("--mixed-seconds", type=float, default=7.0)
    ap.add_argument("--slots", type=int, default=4, help="mixed: generations per instance at once "
                    "(0: the demo model as is, unlimited)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--profile", action="store_true", help="py-spy a data-plane worker under the small load")
    ap.add_argument("--wrk", action="store_true", help="issue 12: measure with wrk (see the module doc)")
    ap.add_argument("--wrk-parts", default="small,stream,ttft", help="--wrk: which parts (comma-separated)")
    ap.add_argument("--wrk-seconds", type=float, default=5.0, help="--wrk: seconds per target per round")
    ap.add_argument("--front", choices=("aiohttp", "compiled"), default="compiled",
                    help="--wrk: the daemon's workers' --front (small and ttft parts)")
    ap.add_argument("--cpu-requests", type=int, default=3000, help="--wrk: requests per CPU measurement")
    ap.add_argument("--cpu-rate", type=float, default=400.0, help="--wrk: about this many req/s for CPU")
    ap.add_argument("--compare-tree", type=Path, help="--wrk: also measure the embedded proxy of this "
                    "checkout (emb-before), e.g. a `git worktree` of the commit before a change")
    ap.add_argument("--bound", action="store_true", help="--wrk: also measure py-bound (bench/_min_relay.py: "
                    "the least a Python relay does per request, no proxy features)")
    a = ap.parse_args()
    if a.wrk:
        return main_wrk(a)
    uv = use_uvloop()
    t0 = time.time()
    result: dict[str, Any] = {"bench": "proxy_bench", "machine": machine(), "generator": {
        "kind": "asyncio closed loop, one aiohttp ClientSession, keep-alive", "uvloop": uv,
        "same_cores_as_targets": True}, "instances": "2 x TP1 (--assume-gpus 2)"}
    if a.scenario in ("small", "all"):
        result["small"] = scenario_small(a.rounds, a.c16_seconds, a.c1_seconds, a.profile)
    if a.scenario in ("mixed", "all"):
        result["mixed"] = scenario_mixed(a.rounds, a.mixed_seconds, a.seed, a.slots)
    result["wall_s"] = round(time.time() - t0, 1)

    goals: dict[str, Any] = {}
    if "small" in result:
        s = result["small"]
        print("\nsmall requests, concurrency 16 (medians over rounds)")
        print(table(s["c16"]["medians"], COLS))
        print("\nsmall requests, concurrency 1 (medians over rounds)")
        print(table(s["c1"]["medians"], COLS))
        r = s["ratios"]
        goals["embedded/nginx rps >= 0.8"] = (r["embedded_over_nginx_rps_c16"],
                                              (r["embedded_over_nginx_rps_c16"] or 0) >= 0.8)
        goals["embedded p50 - direct p50 <= 0.3 ms (c16)"] = (
            r["embedded_minus_direct_p50_ms_c16"], (r["embedded_minus_direct_p50_ms_c16"] or 99) <= 0.3)
        goals["embedded p50 - direct p50 <= 0.3 ms (c1)"] = (
            r["embedded_minus_direct_p50_ms_c1"], (r["embedded_minus_direct_p50_ms_c1"] or 99) <= 0.3)
        print("\nratios (median of per-round values):")
        for k, v in r.items():
            print(f"  {k:<36} {v}")
    if "mixed" in result:
        m = result["mixed"]
        print("\nmixed lengths, concurrency 16 (medians over rounds)")
        print(table(m["medians"], COLS))
        for k, v in m["ratios"].items():
            print(f"  {k:<36} {v}")
        v = m["ratios"]["embedded_over_nginx_p99_pooled_mixed"]
        goals["mixed p99 (pooled) embedded(LO) < nginx(least_conn)"] = (v, v is not None and v < 1.0)
    print("\ngoals:")
    for k, (v, ok) in goals.items():
        print(f"  {'PASS' if ok else 'MISS'}  {k}: {v}")
    result["goals"] = {k: {"value": v, "met": ok} for k, (v, ok) in goals.items()}
    path = write_result("proxy_bench", result, plot)
    print(f"\nwrote {path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path}")
    leaks = [p for k in ("small", "mixed") for p in result.get(k, {}).get("leaked_pids", [])]
    if leaks:
        print(f"LEAKED processes killed by the harness: {leaks}", file=sys.stderr)
        return 1
    return 0


def main_wrk(a: argparse.Namespace) -> int:
    if wrk_path() is None:
        print("wrk not found: apt-get install -y wrk", file=sys.stderr)
        return 2
    use_uvloop()  # the TTFT client
    parts = set(a.wrk_parts.split(","))
    t0 = time.time()
    result: dict[str, Any] = {"bench": "proxy_bench", "mode": "wrk", "machine": machine(), "front": a.front,
                              "generator": {"kind": "wrk 1 thread (C); TTFT: Python SSE client",
                                            "same_cores_as_targets": True},
                              "instances": "2 x TP1 (--assume-gpus 2)"}
    if "small" in parts:
        result["small"] = wrk_small(a.rounds, a.wrk_seconds, a.wrk_seconds, a.cpu_requests, a.cpu_rate,
                                    a.compare_tree, a.profile, a.bound, front=a.front)
    if "stream" in parts:
        result["stream"] = wrk_stream(a.rounds, a.wrk_seconds, events=32, gap_us=1000, connections=64)
    if "ttft" in parts:
        result["ttft"] = wrk_ttft(a.rounds, a.wrk_seconds + 1, streams=8, front=a.front)
    result["wall_s"] = round(time.time() - t0, 1)
    wrk_report(result)
    goals = wrk_goals(result)
    print("\ngoals:")
    for k, (v, ok) in goals.items():
        print(f"  {'PASS' if ok else 'MISS'}  {k}: {v}")
    result["goals"] = {k: {"value": v, "met": ok} for k, (v, ok) in goals.items()}
    path = write_result("proxy_bench", result, plot)
    prof = (result.get("small") or {}).get("profile")
    if prof and prof.get("svg"):
        # Named after the run it belongs to (it was recorded before the run's file existed).
        for key, suffix in (("svg", ".svg"), ("raw", ".txt")):
            old = Path(prof[key])
            new = path.with_name(f"{path.stem}-embedded-wrk-c16{suffix}")
            if old.exists():
                old.rename(new)
                prof[key] = str(new.relative_to(REPO))
        path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {path}")
    leaks = [p for k in ("small", "ttft") for p in (result.get(k) or {}).get("leaked_pids", [])]
    if leaks:
        print(f"LEAKED processes killed by the harness: {leaks}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    os.chdir(Path(__file__).resolve().parent.parent)
    sys.exit(main())
