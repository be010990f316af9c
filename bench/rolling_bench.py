"""Rolling restart under load (issue 5): `trtllm-orch reload` while clients keep sending.

    .venv/bin/python -m bench.rolling_bench [--concurrency 8]

One daemon (`--proxy embedded`, 2 instances x TP1, `--assume-gpus 2`,
DEMO_TOKEN_DELAY_MS=5), steady closed-loop load of small non-streaming `generate`
requests (max_tokens 4 = ~20 ms each, one aiohttp session, keep-alive) through the
embedded proxy. After 2 s of load, `trtllm-orch reload`; the bench waits until the
daemon reports the rolling restart done with every instance READY and restarted, keeps the
load 1 s more, then stops it.

Reported: requests sent / failed (with failure times relative to the reload), whether every
instance was restarted exactly once (rank pids before vs after all different, restarts +1),
total reload duration (daemon log "rolling restart (" -> "rolling restart done", and the
client's view: `reload` command -> status shows it done), and each instance's out-of-
rotation window (READY -> ... -> READY from the daemon log).

Goal: 0 failed requests, every instance restarted once.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import GENERATE, body, latency_bars, machine, run_load, table, use_uvloop, write_result
from tests.harness import Run, log_times, transitions


async def _bench(concurrency: int) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-rolling-"))
    run = Run(tmp, gpus="0-1", tp=1, assume_gpus=2, proxy="embedded",
              env_extra={"DEMO_TOKEN_DELAY_MS": "5"})
    out: dict[str, Any] = {}
    stop = asyncio.Event()
    load_task = None
    try:
        await asyncio.to_thread(run.start)
        before = await asyncio.to_thread(run.status)
        load_task = asyncio.create_task(run_load(run.url(GENERATE), concurrency=concurrency,
                                                 bodies=lambda n: body(4, f"r{n % 97}"), stop=stop,
                                                 target="embedded", warmup=concurrency))
        await asyncio.sleep(2.0)
        t_reload = time.time()
        rc = await asyncio.to_thread(run.cli, "reload", "--state-dir", str(run.state_dir))
        out["reload_rc"] = rc.returncode
        out["reload_cli_s"] = round(time.time() - t_reload, 3)
        restarts0 = {i["id"]: i["restarts"] for i in before["instances"]}
        after = await asyncio.to_thread(
            run.wait_for, lambda s: not s["daemon"]["rolling_restart"] and s["ready"] == s["total"] and
            all(i["restarts"] > restarts0[i["id"]] for i in s["instances"]), 120, "rolling restart done")
        t_done_client = time.time()
        await asyncio.sleep(1.0)
        stop.set()
        res = await load_task
        load_task = None
        log = run.daemon_log()
        started = log_times(log, "rolling restart (", t_reload)
        done = log_times(log, "rolling restart done", t_reload)
        out["reload_duration_s_daemon_log"] = round(done[0] - started[0], 3) if started and done else None
        out["reload_duration_s_client"] = round(t_done_client - t_reload, 3)
        per = []
        b = {i["id"]: i for i in before["instances"]}
        for i in after["instances"]:
            tr = [t for t in transitions(log) if t[1] == i["id"] and t[0] >= t_reload]
            leave = next((t for t in tr if t[2] == "READY"), None)
            back = next((t for t in tr if t[3] == "READY"), None)
            pids_b, pids_a = set(b[i["id"]]["pids"]), set(i["pids"])
            per.append({"instance": i["id"], "restarts_delta": i["restarts"] - b[i["id"]]["restarts"],
                        "pids_before": sorted(pids_b), "pids_after": sorted(pids_a),
                        "all_pids_new": not (pids_b & pids_a),
                        "left_at_s": round(leave[0] - t_reload, 3) if leave else None,
                        "back_at_s": round(back[0] - t_reload, 3) if back else None,
                        "out_of_rotation_s": round(back[0] - leave[0], 3) if leave and back else None,
                        "leave_reason": leave[4][:100] if leave else None,
                        "startup_s": i["startup_s"]})
        out["instances"] = per
        out["load"] = res.summary()
        out["sent"], out["failed"] = res.sent, res.failed
        out["failures_rel_reload_s"] = [round(t - t_reload, 3) for t in res.failures_at][:50]
        out["every_instance_restarted_once"] = all(p["restarts_delta"] == 1 and p["all_pids_new"] for p in per)
    finally:
        stop.set()
        if load_task is not None:
            load_task.cancel()
        out["leaked_pids"] = await asyncio.to_thread(run.close)
        out["daemon_log"] = str(run.log_path)
    return out


def plot(result: dict[str, Any], plt: Any) -> Any:
    """When each instance was out of rotation during the reload, and the load's latency."""
    insts = result["instances"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.2), gridspec_kw={"width_ratios": [2, 1]})
    ax = axes[0]
    for y, inst in enumerate(insts):
        if inst.get("left_at_s") is not None and inst.get("back_at_s") is not None:
            ax.broken_barh([(inst["left_at_s"], inst["back_at_s"] - inst["left_at_s"])], (y - 0.3, 0.6),
                           color="tab:orange")
            ax.annotate(f"{inst['out_of_rotation_s']:.2f} s", (inst["back_at_s"], y), xytext=(4, -3),
                        textcoords="offset points", fontsize=8)
    ax.set_yticks(range(len(insts)))
    ax.set_yticklabels([f"instance {i['instance']}" for i in insts])
    ax.set_xlabel("s after `reload`")
    ax.set_title(f"out of rotation, one at a time ({result['sent']} requests, {result['failed']} failed)",
                 fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    latency_bars(axes[1], [result["load"]], "client latency during the reload")
    fig.suptitle("rolling_bench: rolling restart under load", fontsize=11)
    fig.tight_layout()
    return fig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=8)
    a = ap.parse_args()
    uv = use_uvloop()
    t0 = time.time()
    print(f"rolling restart of 2 x TP1 under load (concurrency {a.concurrency}) through the embedded proxy",
          flush=True)
    r = asyncio.run(_bench(a.concurrency))
    result = {"bench": "rolling_bench", "machine": machine(),
              "generator": {"uvloop": uv, "concurrency": a.concurrency,
                            "request": "generate max_tokens 4, delay 5 ms/token"}, **r,
              "wall_s": round(time.time() - t0, 1)}
    print("\nper instance (seconds from the reload command)")
    print(table(r.get("instances", []), ["instance", "restarts_delta", "all_pids_new", "left_at_s",
                                          "back_at_s", "out_of_rotation_s", "startup_s"]))
    print("\nsummary")
    print(table([{"sent": r.get("sent"), "failed": r.get("failed"), "rps": r.get("load", {}).get("rps"),
                  "p99_ms": r.get("load", {}).get("p99_ms"),
                  "reload_s(daemon log)": r.get("reload_duration_s_daemon_log"),
                  "reload_s(client)": r.get("reload_duration_s_client"),
                  "all restarted once": r.get("every_instance_restarted_once")}],
                ["sent", "failed", "rps", "p99_ms", "reload_s(daemon log)", "reload_s(client)",
                 "all restarted once"]))
    if r.get("failed"):
        print(f"errors: {r['load']['errors']}, at (s after reload): {r['failures_rel_reload_s']}")
    goals = {"0 failed requests": (r.get("failed"), r.get("failed") == 0),
             "every instance restarted once": (r.get("every_instance_restarted_once"),
                                               bool(r.get("every_instance_restarted_once")))}
    print("\ngoals:")
    for k, (v, ok) in goals.items():
        print(f"  {'PASS' if ok else 'MISS'}  {k}: {v}")
    result["goals"] = {k: {"value": v, "met": ok} for k, (v, ok) in goals.items()}
    path = write_result("rolling_bench", result, plot)
    print(f"\nwrote {path}")
    if r.get("leaked_pids"):
        print(f"LEAKED processes killed by the harness: {r['leaked_pids']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    os.chdir(Path(__file__).resolve().parent.parent)
    sys.exit(main())
