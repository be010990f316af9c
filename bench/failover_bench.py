"""Failover under load (issue 4): kill -9 one instance's rank 0, measure what clients and the
orchestrator do, through the embedded proxy and through `--proxy nginx`.

    .venv/bin/python -m bench.failover_bench [--modes embedded,nginx] [--kills 3]

Per mode: one daemon (`--proxy MODE`, 2 instances x TP1, `--assume-gpus 2`,
DEMO_TOKEN_DELAY_MS=5, `--log-level debug`, `--stable-after-s 2`), steady closed-loop load
of small non-streaming `generate` requests (max_tokens 2, concurrency 8, one aiohttp
session, keep-alive) through the public endpoint. After 2 s, `--kills` times: SIGKILL
instance 0's rank 0 (the tritonserver whose environ has TRTLLM_ORCH_INSTANCE=0 and this
run's TRTLLM_ORCH_STATE_DIR, and whose cmdline has --http-port), wait until instance 0 is
READY again, let it run 3 s (longer than --stable-after-s, so every kill is a "first
failure" that restarts at once instead of a backoff repeat), and kill again.

Measured per kill (timestamps from the daemon log lines `instance=0 ... READY -> X` and
`X -> READY`, millisecond resolution, vs the wall-clock time just before os.kill; SIGKILL
makes the process die at once, so the kill time is the death time):
  leave_s    kill -> instance 0 leaves READY (out of the ready set = out of rotation for
             the embedded proxy). NGINX mode lists every instance and is not reloaded when
             one leaves (issue 9 item 10): the dead port refuses and nginx retries elsewhere
             at once. `nginx_reload_s` (kill -> "nginx reloaded") stays as a check: it must
             be empty, as the run's `nginx_reloads` count must be 0.
  ready_s    kill -> instance 0 READY again
  startup_s  `status` startup_s of the new run (launch -> READY)
  overhead_s ready_s - startup_s (detect + stop what is left + relaunch decision)
Per mode: requests sent / failed (client view), retried: the embedded proxy's
trtllm_orch_proxy_retries_total from its /metrics listener; for nginx the count of
[error] upstream lines in its error.log (each is one failed attempt that nginx retried on
the other instance if tries were left; the run of 20261121T050405Z also counted the
[warn] "temporarily disabled" lines).

Goals: 0 failed non-streaming requests through either proxy; leave rotation within
0.2 s of the process death (embedded); no nginx reload; overhead <= 0.5 s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from bench.common import GENERATE, body, latency_bars, machine, med, run_load, table, use_uvloop, write_result
from tests.harness import Run, log_times, transitions

_NGINX_UPSTREAM_ERR = re.compile(r"\[error\].*(upstream|connect\(\) failed)")


def rank0_pid(run: Run, instance: str = "0") -> int | None:
    for proc in psutil.process_iter(["pid", "name"]):
        try:
            if "tritonserver" not in (proc.info["name"] or "") and \
                    not any("tritonserver" in a for a in proc.cmdline()[:1]):
                continue
            env = proc.environ()
            if env.get("TRTLLM_ORCH_STATE_DIR") != str(run.state_dir) or \
                    env.get("TRTLLM_ORCH_INSTANCE") != instance:
                continue
            if any(a.startswith("--http-port") for a in proc.cmdline()) and \
                    proc.status() != psutil.STATUS_ZOMBIE:
                return proc.pid
        except (psutil.Error, OSError):
            continue
    return None


def _retries(run: Run) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{run.metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("trtllm_orch_proxy_retries_total"))


def _nginx_upstream_errors(run: Run) -> int:
    path = run.state_dir / "nginx" / "error.log"
    try:
        return sum(1 for line in path.read_text(errors="replace").splitlines()
                   if _NGINX_UPSTREAM_ERR.search(line))
    except OSError:
        return 0


async def _mode(mode: str, kills: int, concurrency: int) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix=f"bench-failover-{mode}-"))
    run = Run(tmp, gpus="0-1", tp=1, assume_gpus=2, proxy=mode,
              env_extra={"DEMO_TOKEN_DELAY_MS": "5"}, extra=("--stable-after-s", "2"))
    out: dict[str, Any] = {"mode": mode, "kills": []}
    stop = asyncio.Event()
    load_task = None
    try:
        await asyncio.to_thread(run.start)
        retries0 = _retries(run) if mode == "embedded" else _nginx_upstream_errors(run)
        load_task = asyncio.create_task(run_load(run.url(GENERATE), concurrency=concurrency,
                                                 bodies=lambda n: body(2, f"f{n % 97}"),
                                                 stop=stop, target=mode, warmup=concurrency))
        await asyncio.sleep(2.0)
        for k in range(kills):
            st = await asyncio.to_thread(run.status)
            inst0 = next(i for i in st["instances"] if i["id"] == "0")
            restarts_before = inst0["restarts"]
            pid = await asyncio.to_thread(rank0_pid, run)
            assert pid is not None, "instance 0 rank 0 not found"
            t_kill = time.time()
            os.kill(pid, signal.SIGKILL)
            st = await asyncio.to_thread(
                run.wait_for, lambda s: any(i["id"] == "0" and i["state"] == "READY" and
                                            i["restarts"] > restarts_before for i in s["instances"]),
                60, "instance 0 READY again")
            inst0 = next(i for i in st["instances"] if i["id"] == "0")
            log = run.daemon_log()
            tr = [t for t in transitions(log) if t[1] == "0" and t[0] >= t_kill - 0.005]
            leave = next((t for t in tr if t[2] == "READY"), None)
            ready = next((t for t in tr if t[3] == "READY"), None)
            row: dict[str, Any] = {
                "kill": k + 1, "killed_pid": pid, "t_kill": t_kill,
                "leave_s": round(leave[0] - t_kill, 3) if leave else None,
                "leave_to": f"{leave[3]}: {leave[4]}"[:120] if leave else None,
                "ready_s": round(ready[0] - t_kill, 3) if ready else None,
                "startup_s": inst0["startup_s"],
            }
            row["overhead_s"] = round(row["ready_s"] - row["startup_s"], 3) \
                if row["ready_s"] is not None and row["startup_s"] is not None else None
            if mode == "nginx":
                rel = log_times(log, "nginx reloaded", t_kill)
                row["nginx_reload_s"] = round(rel[0] - t_kill, 3) if rel else None
            out["kills"].append(row)
            print(f"  [{mode} kill {k + 1}] pid {pid}: leave {row['leave_s']} s, READY {row['ready_s']} s, "
                  f"startup {row['startup_s']} s, overhead {row['overhead_s']} s"
                  + (f", nginx reloaded {row.get('nginx_reload_s')} s" if mode == "nginx" else ""),
                  flush=True)
            await asyncio.sleep(3.0)
        stop.set()
        res = await load_task
        load_task = None
        out["load"] = res.summary()
        kill_ts = [r["t_kill"] for r in out["kills"]]
        log = run.daemon_log()
        reload_ts = log_times(log, "nginx reloaded", kill_ts[0]) if mode == "nginx" else []
        if mode == "nginx":
            out["nginx_reloads"] = len(reload_ts)
            proxies = (await asyncio.to_thread(run.status)).get("proxies", [])
            out["nginx_restarts"] = proxies[0].get("restarts") if proxies else None
        out["failures"] = []
        for t in res.failures_at:
            k = max((i for i, kt in enumerate(kill_ts) if kt <= t), default=None)
            near = min(reload_ts, key=lambda r: abs(r - t)) if reload_ts else None
            out["failures"].append({"after_kill": k + 1 if k is not None else None,
                                    "s_after_kill": round(t - kill_ts[k], 3) if k is not None else None,
                                    "s_from_nearest_nginx_reload": round(t - near, 3) if near else None})
        if mode == "embedded":
            out["retried"] = int(_retries(run) - retries0)
            out["retried_source"] = "trtllm_orch_proxy_retries_total (embedded /metrics)"
        else:
            out["retried"] = _nginx_upstream_errors(run) - retries0
            out["retried_source"] = "upstream errors in nginx error.log (failed attempts)"
        out["sent"], out["failed"] = res.sent, res.failed
        for key in ("leave_s", "ready_s", "startup_s", "overhead_s", "nginx_reload_s"):
            vals = [r.get(key) for r in out["kills"] if key in r]
            if vals:
                out[f"median_{key}"] = med(vals)
    finally:
        stop.set()
        if load_task is not None:
            load_task.cancel()
        out["leaked_pids"] = await asyncio.to_thread(run.close)
        out["daemon_log"] = str(run.log_path)
    return out


def plot(result: dict[str, Any], plt: Any) -> Any:
    """Per kill: time out of rotation and back to READY; per mode: the load's latency and failures."""
    modes = result["modes"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for name, mode in modes.items():
        kills = mode.get("kills", [])
        axes[0].plot([k["kill"] for k in kills], [k["ready_s"] for k in kills], marker="o",
                     label=f"{name}: ready again")
        axes[0].plot([k["kill"] for k in kills], [k["leave_s"] for k in kills], marker="x", linestyle="--",
                     label=f"{name}: out of rotation")
    axes[0].set_xlabel("kill -9 of a rank, #")
    axes[0].xaxis.get_major_locator().set_params(integer=True)
    axes[0].set_ylabel("s after the kill")
    axes[0].set_title("each kill under load", fontsize=10)
    axes[0].legend(fontsize=7)
    axes[0].grid(alpha=0.3)
    rows = [{**m["load"], "target": f"{n}\n{m['failed']} failed of {m['sent']}"} for n, m in modes.items()]
    latency_bars(axes[1], rows, "client latency during the kills")
    fig.suptitle("failover_bench: steady load while ranks are killed", fontsize=11)
    fig.tight_layout()
    return fig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="embedded,nginx")
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=8)
    a = ap.parse_args()
    uv = use_uvloop()
    t0 = time.time()
    result: dict[str, Any] = {"bench": "failover_bench", "machine": machine(),
                              "generator": {"uvloop": uv, "concurrency": a.concurrency,
                                            "request": "generate max_tokens 2, delay 5 ms/token"},
                              "modes": {}}
    for mode in a.modes.split(","):
        print(f"{mode}: 2 x TP1, load at concurrency {a.concurrency}, {a.kills} kills of instance 0 rank 0",
              flush=True)
        result["modes"][mode] = asyncio.run(_mode(mode, a.kills, a.concurrency))
    result["wall_s"] = round(time.time() - t0, 1)

    cols = ["mode", "kill", "leave_s", "nginx_reload_s", "ready_s", "startup_s", "overhead_s"]
    rows = []
    for mode, m in result["modes"].items():
        for r in m["kills"]:
            rows.append({"mode": mode, **r})
        rows.append({"mode": mode, "kill": "median", **{k: m.get(f"median_{k}") for k in cols[2:]}})
    print("\nper kill (seconds from the SIGKILL)")
    print(table(rows, cols))
    srows = [{"mode": mode, "sent": m.get("sent"), "failed": m.get("failed"), "retried": m.get("retried"),
              "rps": m.get("load", {}).get("rps"), "errors": m.get("load", {}).get("errors")}
             for mode, m in result["modes"].items()]
    for mode, m in result["modes"].items():
        if m.get("failures"):
            print(f"\n{mode}: failures (s after the kill / s from the nearest nginx reload): "
                  + ", ".join(f"kill {f['after_kill']}: {f['s_after_kill']} / {f['s_from_nearest_nginx_reload']}"
                              for f in m["failures"][:20]))
            print(f"  samples: {m['load'].get('error_samples')}")
    print("\nclient view")
    print(table(srows, ["mode", "sent", "failed", "retried", "rps", "errors"]))

    goals = {}
    emb = result["modes"].get("embedded")
    if emb:
        goals["0 failed through embedded"] = (emb.get("failed"), emb.get("failed") == 0)
        worst = max((r["leave_s"] for r in emb["kills"] if r["leave_s"] is not None), default=None)
        goals["leave rotation <= 0.2 s (embedded, worst kill)"] = (worst, worst is not None and worst <= 0.2)
        ov = emb.get("median_overhead_s")
        goals["overhead <= 0.5 s (embedded, median)"] = (ov, ov is not None and ov <= 0.5)
    ngx = result["modes"].get("nginx")
    if ngx:
        goals["0 failed through nginx"] = (ngx.get("failed"), ngx.get("failed") == 0)
        goals["no nginx reload on membership changes"] = (ngx.get("nginx_reloads"), ngx.get("nginx_reloads") == 0)
        ov = ngx.get("median_overhead_s")
        goals["overhead <= 0.5 s (nginx mode, median)"] = (ov, ov is not None and ov <= 0.5)
    print("\ngoals:")
    for k, (v, ok) in goals.items():
        print(f"  {'PASS' if ok else 'MISS'}  {k}: {v}")
    result["goals"] = {k: {"value": v, "met": ok} for k, (v, ok) in goals.items()}
    path = write_result("failover_bench", result, plot)
    print(f"\nwrote {path}")
    leaks = [p for m in result["modes"].values() for p in m.get("leaked_pids", [])]
    if leaks:
        print(f"LEAKED processes killed by the harness: {leaks}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    os.chdir(Path(__file__).resolve().parent.parent)
    sys.exit(main())
