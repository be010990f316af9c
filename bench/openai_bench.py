"""What the OpenAI API costs (issue 13): NVIDIA AIPerf through /v1/chat/completions vs native generate_stream.

    .venv/bin/python -m bench.openai_bench --aiperf /tmp/aiperf-venv/bin/aiperf [--rounds 3] [--requests 200]

AIPerf is not a dependency of the project (it pulls a large tree): install it into a
throwaway venv, `python3 -m venv /tmp/aiperf-venv && /tmp/aiperf-venv/bin/pip install aiperf`.

Setup (why it is fair): ONE daemon `trtllm-orch up --proxy embedded`, one instance of the
twin (TP1), and both targets go through the same endpoint, proxy and instance:
  - native : `aiperf profile --endpoint-type template --custom-endpoint
             /v2/models/ensemble/generate_stream --streaming`, the payload rendering the
             SAME prompt the chat template produces (so both prefill the same bytes)
  - openai : `aiperf profile --endpoint-type chat --streaming` (/v1/chat/completions:
             validation, chat template, translation both ways, OpenAI chunks)
The twin's repository is filled with `enable_kv_cache_reuse:false`: AIPerf's prompts
repeat between runs with the same seed, and a cached prefix would make whichever target
runs second look faster; and with no prefill cost by default, so that TTFT is the path
plus one decode step and a sub-millisecond difference is not lost in the model's noise.
Each round uses its own seed and visits the targets in rotated order; tables show
per-target medians over rounds, and the TTFT delta is the median of per-round deltas
(p50 openai - p50 native).

AIPerf's token-based numbers (ITL, tokens/s) count tokens with the client tokenizer,
which for the twin encodes generated words as bytes: the table shows the inter-chunk
latency instead (one SSE chunk per token here) and requests/s.

Goal: the OpenAI path adds at most 0.5 ms to TTFT p50.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, bars, embedded_proxy_pids, free_port, machine, med, table, wait_port, write_result
from bench.wrk import cpu_seconds
from tests.harness import Run

# The demo tokenizer's chat template for one user turn (demo/twin/tokenizer_files.py).
NATIVE_TEMPLATE = ('{"text_input": {{ ("<|user|>\\n" ~ text ~ "</s>\\n<|assistant|>\\n") | tojson }}, '
                   '"max_tokens": {{ max_tokens }}, "stream": true, "exclude_input_in_output": true, '
                   '"return_num_input_tokens": true, "return_num_output_tokens": true}')
TARGETS = ("native", "openai")
COLS = ["target", "concurrency", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "chunk_p50_ms", "latency_p50_ms",
        "req_per_s", "proxy_cpu_ms_per_req", "n", "errors"]


def aiperf_args(target: str, port: int, concurrency: int, requests: int, seed: int, out: Path,
                native_template: Path, isl: int, osl: int, tokenizer: Path) -> list[str]:
    common = ["--model", "ensemble", "--tokenizer", str(tokenizer), "--url", f"http://127.0.0.1:{port}",
              "--streaming", "--concurrency", str(concurrency), "--request-count", str(requests),
              "--warmup-request-count", str(max(5, concurrency * 2)), "--isl", str(isl), "--isl-stddev", "0",
              "--osl", str(osl), "--random-seed", str(seed), "--ui", "none", "--no-server-metrics",
              "--no-gpu-telemetry", "--artifact-dir", str(out)]
    if target == "openai":
        return ["--endpoint-type", "chat", *common]
    return ["--endpoint-type", "template", "--custom-endpoint", "/v2/models/ensemble/generate_stream",
            "--extra-inputs", f"payload_template:{native_template}", "--extra-inputs", "response_field:text_output",
            *common]


def summary(out: Path) -> dict[str, Any]:
    d = json.loads((out / "profile_export_aiperf.json").read_text())

    def stat(name: str, key: str) -> float | None:
        v = d.get(name) or {}
        return v.get(key)

    return {"ttft_p50_ms": stat("time_to_first_token", "p50"), "ttft_p90_ms": stat("time_to_first_token", "p90"),
            "ttft_p99_ms": stat("time_to_first_token", "p99"), "chunk_p50_ms": stat("inter_chunk_latency", "p50"),
            "latency_p50_ms": stat("request_latency", "p50"), "req_per_s": stat("request_throughput", "avg"),
            "n": stat("request_count", "avg"), "errors": len(d.get("error_summary") or [])}


async def paired(port: int, n: int, isl: int, osl: int) -> dict[str, Any]:
    """Request by request, native and OpenAI alternating (order flipped every pair), TTFT each.

    The box's other load drifts over seconds; AIPerf runs of one target after the other
    take that drift into their difference. Pairs a few ms apart do not, so the median of
    per-pair differences is the path's own cost. Same client for both: one aiohttp
    session, keep-alive, time to the first SSE chunk that carries text.
    """
    import random

    import aiohttp

    rng = random.Random(7)
    words = "the of and to in is was for on that with as by at from his her it an were".split()
    url = f"http://127.0.0.1:{port}"
    ttft: dict[str, list[float]] = {"native": [], "openai": []}
    diffs: list[float] = []

    async def one(session: aiohttp.ClientSession, target: str, text: str) -> float:
        if target == "native":
            prompt = "<|user|>\n" + text + "</s>\n<|assistant|>\n"
            path, body, key = "/v2/models/ensemble/generate_stream", {
                "text_input": prompt, "max_tokens": osl, "stream": True, "exclude_input_in_output": True,
                "return_num_input_tokens": True, "return_num_output_tokens": True}, b'"text_output"'
        else:
            path, body, key = "/v1/chat/completions", {
                "model": "ensemble", "messages": [{"role": "user", "content": text}], "max_tokens": osl,
                "stream": True}, b'"content"'
        t0 = time.perf_counter()
        first = None
        async with session.post(url + path, json=body) as r:
            assert r.status == 200, (target, r.status, await r.text())
            async for chunk in r.content.iter_any():
                if first is None and key in chunk:
                    first = time.perf_counter() - t0
        assert first is not None
        return first * 1000

    async with aiohttp.ClientSession() as session:
        for i in range(n + 10):
            text = " ".join(rng.choice(words) for _ in range(isl // 4))[:isl]
            order = ("native", "openai") if i % 2 else ("openai", "native")
            got = {t: await one(session, t, text + str(i)) for t in order}
            if i < 10:
                continue  # warm-up
            for t, v in got.items():
                ttft[t].append(v)
            diffs.append(got["openai"] - got["native"])
    return {"n_pairs": n, "native_ttft_p50_ms": med(ttft["native"]), "openai_ttft_p50_ms": med(ttft["openai"]),
            "delta_p50_ms": med(diffs), "delta_mean_ms": sum(diffs) / len(diffs)}


# For proxy_cpu: an instance that streams its tokens at once, and a sequential client; both
# in processes of their own, so this process's CPU time is the proxy's alone.
FAKE_INSTANCE = """
import asyncio, json, sys
from aiohttp import web
async def h(request):
    n = (await request.json())["max_tokens"]
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await resp.prepare(request)
    for _ in range(n):
        await resp.write(b"data: " + json.dumps({"model_name": "ensemble", "model_version": "1",
            "text_output": " the", "num_input_tokens": 150, "num_output_tokens": 1}).encode() + b"\\n\\n")
    await resp.write_eof()
    return resp
async def main():
    r = web.ServerRunner(web.Server(h)); await r.setup()
    await web.TCPSite(r, "127.0.0.1", int(sys.argv[1])).start(); await asyncio.Event().wait()
asyncio.run(main())
"""
CLIENT = """
import asyncio, sys, aiohttp
async def main():
    port, target, n, osl = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    async with aiohttp.ClientSession() as s:
        for i in range(n):
            if target == "native":
                path, body = "/v2/models/ensemble/generate_stream", {"text_input": "<|user|>\\nhello %d</s>\\n"
                    "<|assistant|>\\n" % i, "max_tokens": osl, "stream": True}
            else:
                path, body = "/v1/chat/completions", {"model": "ensemble", "max_completion_tokens": osl,
                    "messages": [{"role": "user", "content": "hello %d" % i}], "stream": True,
                    "stream_options": {"include_usage": True}}
            async with s.post(f"http://127.0.0.1:{port}{path}", json=body) as r:
                assert r.status == 200, await r.text()
                await r.read()
asyncio.run(main())
"""


async def proxy_cpu(repo: Path, requests: int, rounds: int, osl: int) -> dict[str, Any]:
    """The embedded proxy's CPU time per request, native vs OpenAI, in this very process.

    Latencies on this shared box move by milliseconds; CPU time spent by the proxy does
    not depend on the neighbours, so this is the translation's cost itself.
    """
    from orchestrator.config import Settings
    from orchestrator.routing.backends import Backend, ReadyBackends
    from orchestrator.dataplane.embedded import EmbeddedProxy

    port = free_port()
    inst = await asyncio.create_subprocess_exec(sys.executable, "-c", FAKE_INSTANCE, str(port))
    backends = ReadyBackends()
    proxy = EmbeddedProxy(Settings(listen="127.0.0.1:0", metrics_listen="", model_repo=str(repo),
                                   lb_policy="least-outstanding"), backends)
    per: dict[str, list[float]] = {t: [] for t in TARGETS}
    try:
        wait_port(port)
        await proxy.start()
        backends.publish((Backend("0", "127.0.0.1", port, 1, 2),))
        for r in range(rounds + 1):
            for target in TARGETS if r % 2 else TARGETS[::-1]:
                client = await asyncio.create_subprocess_exec(sys.executable, "-c", CLIENT, str(proxy.bound_port),
                                                              target, str(requests), str(osl))
                c0 = time.process_time()
                assert await client.wait() == 0
                if r:  # round 0 warms up both paths
                    per[target].append((time.process_time() - c0) / requests * 1e6)
    finally:
        await proxy.stop(1.0)
        inst.kill()
        await inst.wait()
    return {"requests_per_round": requests, "rounds": rounds, "osl": osl,
            **{f"{t}_us_per_req": med(v) for t, v in per.items()}, "per_round_us": per}


def summarise(data: dict[str, Any]) -> dict[str, Any]:
    """Per-target medians over rounds, per-round TTFT deltas and the verdict, from the raw runs."""
    runs, levels = data["runs"], sorted({x["concurrency"] for x in data["runs"]})
    rounds = sorted({x["round"] for x in runs})
    rows = []
    deltas: dict[str, list[float]] = {}
    for conc in levels:
        for target in TARGETS:
            mine = [x for x in runs if x["target"] == target and x["concurrency"] == conc]
            rows.append({"target": target, "concurrency": conc,
                         **{c: med([x.get(c) for x in mine]) for c in COLS[2:] if c not in ("n", "errors")},
                         "n": sum(x["n"] or 0 for x in mine), "errors": sum(x["errors"] for x in mine)})
        for r in rounds:
            pair = {x["target"]: x for x in runs if x["round"] == r and x["concurrency"] == conc}
            deltas.setdefault(str(conc), []).append(pair["openai"]["ttft_p50_ms"] - pair["native"]["ttft_p50_ms"])
    # The verdict: the interleaved pairs when measured (drift between AIPerf runs on a shared
    # box is of the order of a millisecond per round), else AIPerf's median round delta.
    pairs = data.get("interleaved_pairs")
    measure = pairs["delta_p50_ms"] if pairs else (med(deltas["1"]) if "1" in deltas else None)
    return {"rows": rows, "ttft_p50_delta_per_round_ms": deltas,
            "ttft_p50_delta_ms": {c: med(d) for c, d in deltas.items()},
            "goal_ttft_p50_delta_ms": measure, "goal_met": measure is not None and measure <= 0.5}


def report(data: dict[str, Any]) -> str:
    a = data["args"]
    lines = [f"concurrency {c}: AIPerf openai - native TTFT p50, median of rounds {med(d):+.3f} ms (per round: "
             f"{', '.join(f'{x:+.3f}' for x in d)})" for c, d in data["ttft_p50_delta_per_round_ms"].items()]
    i = data.get("interleaved_pairs")
    if i:
        lines.append(f"interleaved pairs at concurrency 1 ({i['n_pairs']} pairs, same client for both): native "
                     f"TTFT p50 {i['native_ttft_p50_ms']:.3f} ms, openai {i['openai_ttft_p50_ms']:.3f} ms; median "
                     f"per-pair difference {i['delta_p50_ms']:+.3f} ms (mean {i['delta_mean_ms']:+.3f} ms)")
    c = data.get("proxy_cpu")
    if c:
        lines.append(f"proxy CPU per request, in process against a fake instance ({c['rounds']} x "
                     f"{c['requests_per_round']} requests per target, {c['osl']} tokens each): native "
                     f"{c['native_us_per_req']:.0f} us, openai {c['openai_us_per_req']:.0f} us "
                     f"({c['openai_us_per_req'] - c['native_us_per_req']:+.0f} us)")
    verdict = ("met" if data["goal_met"] else "NOT met") + f" ({data['goal_ttft_p50_delta_ms']:+.3f} ms, " + \
        ("interleaved pairs" if i else "AIPerf rounds") + ")"
    consoles = data.get("aiperf_consoles_last_round") or {}
    return ("# openai_bench: AIPerf, /v1/chat/completions vs native generate_stream\n\n"
            f"{len(data['runs'])} AIPerf runs, {a['rounds']} rounds; one instance of the twin, decode "
            f"{a['token_delay_ms']} ms, prefill {a['prefill_ms_per_token']} ms/token, KV reuse off; ISL {a['isl']} "
            f"(bytes), OSL {a['osl']}, {a['requests']} requests per run. `bench/openai_bench.py` says how.\n\n"
            "Medians over rounds (proxy_cpu_ms_per_req: the data-plane workers' and the daemon's CPU time "
            "over a run per request, background work included):\n\n```\n" + table(data["rows"], COLS) + "\n```\n\n"
            + "\n".join(f"- {x}" for x in lines)
            + f"\n\nGoal, the OpenAI path adds <= 0.5 ms to TTFT p50: {verdict}\n\n"
            "## AIPerf's own tables (last round)\n\n"
            + "\n".join(f"### {k}\n\n```\n{v.strip()}\n```\n" for k, v in consoles.items()))


def plot(result: dict[str, Any], plt: Any) -> Any:
    """TTFT p50/p90/p99 per path at each concurrency, inter-chunk p50, the TTFT p50 deltas, proxy CPU."""
    if "rows" not in result:  # a raw run: the same medians the report shows
        result = {**result, **summarise(result)}
    rows = result["rows"]
    levels = sorted({r["concurrency"] for r in rows})
    cpu = result.get("proxy_cpu")
    fig, axes = plt.subplots(1, len(levels) + 2 + (1 if cpu else 0), figsize=(4.4 * (len(levels) + 3), 4.4))
    for ax, conc in zip(axes, levels):
        mine = {r["target"]: r for r in rows if r["concurrency"] == conc}
        targets = [t for t in TARGETS if t in mine]
        bars(ax, targets, {p: [mine[t][f"ttft_{p}_ms"] for t in targets] for p in ("p50", "p90", "p99")},
             ylabel="ms", title=f"TTFT, concurrency {conc} (AIPerf, median of rounds)", fmt="{:.1f}")
    ax = axes[len(levels)]
    bars(ax, [f"c{c}" for c in levels],
         {t: [next((r["chunk_p50_ms"] for r in rows if r["target"] == t and r["concurrency"] == c), None)
              for c in levels] for t in TARGETS},
         ylabel="ms", title="inter-chunk p50 (AIPerf; at c>1 chunks can arrive together)", fmt="{:.2f}")
    # openai - native TTFT p50: AIPerf's per-round deltas, the interleaved pairs, the goal.
    ax = axes[len(levels) + 1]
    per_round = result.get("ttft_p50_delta_per_round_ms") or {}
    labels = [f"AIPerf c{c}" for c in per_round]
    for x, (conc, ds) in enumerate(per_round.items()):
        ax.scatter([x] * len(ds), ds, color="tab:blue", alpha=0.6, s=18, label="per round" if x == 0 else None)
        ax.scatter([x], [med(ds)], color="tab:blue", marker="_", s=400, label="median of rounds" if x == 0 else None)
    pairs = result.get("interleaved_pairs")
    if pairs:
        x = len(labels)
        labels.append(f"{pairs['n_pairs']} pairs, c1")
        ax.scatter([x], [pairs["delta_p50_ms"]], color="tab:green", marker="D", s=40,
                   label="median per-pair difference")
        ax.annotate(f"{pairs['delta_p50_ms']:+.2f} ms", (x, pairs["delta_p50_ms"]), xytext=(-6, 6), ha="right",
                    textcoords="offset points", fontsize=8)
    ax.axhline(0.5, color="tab:red", linestyle="--", linewidth=1, label="goal: <= +0.5 ms")
    ax.axhline(0, color="k", linewidth=0.5)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_xlim(-0.5, len(labels) - 0.5)
    ax.set_ylabel("ms")
    ax.set_title("TTFT p50, openai - native", fontsize=10)
    ax.legend(fontsize=7, loc="lower left")
    ax.grid(axis="y", alpha=0.3)
    if cpu:
        ax = axes[-1]
        bars(ax, list(TARGETS), {"median": [cpu[f"{t}_us_per_req"] for t in TARGETS]}, ylabel="us per request",
             title=f"embedded proxy CPU per streamed request ({cpu['osl']} tokens)", fmt="{:.0f}")
        for x, t in enumerate(TARGETS):
            ys = cpu["per_round_us"][t]
            ax.scatter([x] * len(ys), ys, color="k", s=12, zorder=3, label="per round" if x == 0 else None)
        ax.legend(fontsize=7)
    a = result["args"]
    goal = result.get("goal_ttft_p50_delta_ms")
    fig.suptitle(f"openai_bench: /v1/chat/completions vs native generate_stream, one twin instance (TP1), "
                 f"{a['rounds']} rounds, ISL {a['isl']}, OSL {a['osl']}, decode {a['token_delay_ms']} ms; goal "
                 + ("met" if result.get("goal_met") else "NOT met")
                 + (f" ({goal:+.3f} ms)" if goal is not None else ""), fontsize=10)
    fig.tight_layout()
    return fig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--aiperf", default="aiperf", help="the aiperf executable")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=200, help="requests per run")
    ap.add_argument("--concurrency", default="1,8", help="comma list")
    ap.add_argument("--pairs", type=int, default=500, help="interleaved native/openai request pairs (0: skip)")
    ap.add_argument("--cpu-requests", type=int, default=1000, help="requests per target and round of the "
                    "in-process proxy CPU measurement (0: skip)")
    ap.add_argument("--isl", type=int, default=128)
    ap.add_argument("--osl", type=int, default=16)
    ap.add_argument("--token-delay-ms", default="2", help="the twin's decode step (DEMO_TOKEN_DELAY_MS)")
    ap.add_argument("--prefill-ms-per-token", default="0", help="the twin's prefill cost (0: TTFT is the "
                    "path plus one decode step, so the path's cost is not lost in the model's noise)")
    ap.add_argument("--report", metavar="JSON", help="only re-render the .md of a recorded run")
    args = ap.parse_args()
    if args.report:
        data = json.loads(Path(args.report).read_text())
        data.update(summarise(data))
        Path(args.report).with_suffix(".md").write_text(report(data))
        print(report(data).split("## AIPerf")[0])
        return 0
    levels = [int(c) for c in args.concurrency.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="openai-bench-"))
    repo = tmp / "repo"
    subprocess.run([sys.executable, str(REPO / "demo" / "fill_template.py"), "--repo", str(repo), "--streaming",
                    f"enable_kv_cache_reuse:false,twin_prefill_ms_per_token:{args.prefill_ms_per_token}"],
                   check=True, cwd=REPO)
    tokenizer = tmp / "repo-tokenizer"
    native_template = tmp / "native.j2"
    native_template.write_text(NATIVE_TEMPLATE + "\n")
    (tmp / "run").mkdir()
    run = Run(tmp / "run", gpus="0", tp=1, assume_gpus=1, proxy="embedded", model_repo=repo,
              extra=("--canary-interval-s", "0", "--log-level", "info"),
              env_extra={"DEMO_TOKEN_DELAY_MS": args.token_delay_ms})
    runs: list[dict[str, Any]] = []
    interleaved: dict[str, Any] | None = None
    consoles: dict[str, str] = {}
    try:
        run.start(timeout=120)
        assert run.proc is not None
        proxy = embedded_proxy_pids(run.status())  # the data-plane workers translate; the daemon feeds them
        for r in range(args.rounds):
            for conc in levels:
                order = TARGETS if (r + conc) % 2 == 0 else TARGETS[::-1]
                for target in order:
                    out = tmp / f"r{r}-c{conc}-{target}"
                    cmd = [args.aiperf, "profile", *aiperf_args(target, run.listen_port, conc, args.requests,
                                                                  1000 + r, out, native_template, args.isl,
                                                                  args.osl, tokenizer)]
                    t0 = time.monotonic()
                    cpu0 = cpu_seconds(proxy)
                    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
                    cpu1 = cpu_seconds(proxy)
                    if res.returncode != 0:
                        print(res.stdout[-3000:], res.stderr[-3000:], file=sys.stderr)
                        raise SystemExit(f"aiperf failed for {target} c{conc} round {r}")
                    row = {"round": r, "target": target, "concurrency": conc, **summary(out)}
                    # The proxy's own cost, whatever the box's other load does to latencies: its
                    # processes' CPU time over the run (warm-up included) per request.
                    sent = args.requests + max(5, conc * 2)
                    row["proxy_cpu_ms_per_req"] = 1000 * (cpu1 - cpu0) / sent
                    runs.append(row)
                    consoles[f"{target} c{conc}"] = (out / "profile_export_console.txt").read_text()
                    print(f"round {r} c{conc} {target}: ttft p50 {row['ttft_p50_ms']:.2f} ms "
                          f"({time.monotonic() - t0:.0f}s)", flush=True)
        interleaved = asyncio.run(paired(run.listen_port, args.pairs, args.isl, args.osl)) if args.pairs else None
    finally:
        leaked = run.close()
        if leaked:
            print(f"leaked processes: {leaked}", file=sys.stderr)
    cpu = asyncio.run(proxy_cpu(repo, args.cpu_requests, 3, args.osl)) if args.cpu_requests else None
    data = {"machine": machine(), "args": vars(args), "runs": runs, "interleaved_pairs": interleaved,
            "proxy_cpu": cpu,
            "aiperf_consoles_last_round": consoles}
    data.update(summarise(data))
    path = write_result("openai_bench", data, plot)
    md = path.with_suffix(".md")
    md.write_text(report(data))
    print(f"\nwrote {path} and {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
