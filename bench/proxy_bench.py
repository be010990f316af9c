"""Proxy overhead and balancing (issue 3): direct vs NGINX vs the embedded proxy, in ONE run.

    .venv/bin/python -m bench.proxy_bench [--scenario small|mixed|all] [--rounds 3]

Setup (why it is fair): ONE daemon `trtllm-orch up --proxy embedded` with 2 instances x TP1
(`--assume-gpus 2`). Every target fronts exactly those two tritonservers:
  - direct      : instance 0's loopback HTTP port (one instance, no proxy)
  - direct-2    : the client itself spreads its workers over both instances' ports
                  (the no-proxy baseline for 2 instances; reference only)
  - nginx       : a private NGINX started from the config trtllm-orch renders for
                  `--proxy nginx` (orchestrator.proxy.nginx.render_nginx_config: same template,
                  least_conn, upstream keepalive, retries), pointed at the same instances.
                  `worker_processes auto` = 2 workers on this 2-core box.
  - nginx-1w    : the same config with `worker_processes 1` (the embedded proxy is one
                  single-threaded process: this is the like-for-like CPU budget).
  - embedded    : the daemon's own embedded proxy (least-outstanding), the product path.
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
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import (GENERATE, RESULTS, pct, SideEmbedded, SideNginx, bars, body, latency_bars, machine,
                          med, mixed_bodies, run_load, table, use_uvloop, write_result)
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


def _profile(pid: int, seconds: int, out: Path, url: str, concurrency: int) -> str | None:
    """py-spy record of `pid` while the same small load runs; returns the svg path or None."""
    spy = Path(sys.executable).parent / "py-spy"
    if not spy.exists():
        return None
    svg = out.with_suffix(".svg")
    raw = out.with_suffix(".txt")
    p = subprocess.Popen([str(spy), "record", "-d", str(seconds), "-r", "200", "-p", str(pid),
                          "-o", str(svg), "--nonblocking"], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    q = subprocess.Popen([str(spy), "record", "-d", str(seconds), "-r", "200", "-p", str(pid),
                          "-f", "raw", "-o", str(raw), "--nonblocking"], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    asyncio.run(run_load(url, concurrency=concurrency, duration_s=seconds - 1, target="profile"))
    p.wait(30)
    q.wait(30)
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
        ngx = SideNginx(st).start()
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
            svg = _profile(int(st["daemon"]["pid"]), 8, prof, run.url(GENERATE), 16)
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
        ngx = SideNginx(st).start()
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


def plot(result: dict[str, Any], plt: Any) -> Any:
    """Latency percentiles per target for each scenario run, and c16 throughput."""
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
    ap.add_argument("--profile", action="store_true", help="py-spy the daemon under the small load")
    a = ap.parse_args()
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


if __name__ == "__main__":
    os.chdir(Path(__file__).resolve().parent.parent)
    sys.exit(main())
