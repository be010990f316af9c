"""Live restore under load (issue 23): the daemon killed, upgraded, or restarted with a
changed config while clients keep sending; what the clients saw, second by second.

    .venv/bin/python -m bench.live_restore_bench [--instances 4] [--concurrency 8]

Per case, one daemon (`up`, N instances x TP1 with `--assume-gpus N`, 2 data-plane workers),
steady closed-loop load of small `generate` requests through the public endpoint (one
aiohttp session, keep-alive; every answer's time and outcome kept), then:
  kill9     kill -9 of the daemon, the same `up` again 2 s later
  upgrade   `trtllm-orch upgrade` (detach, the installed code's daemon adopts)
  changed   kill -9 of the daemon, `up` with one more tritonserver argument: the groups are
            adopted, then replaced by a rolling restart, one at a time
Measured per case: requests answered and failed, engine (mpirun) pids kept, seconds from
the new daemon's start to every instance READY under it (`back_s`), for `changed` until
every engine was replaced, and the answers per 0.25 s around the fault (the plot).

Goals (the issue's): 0 failed requests and 0 engine restarts in kill9 and upgrade (changed
replaces engines on purpose: 0 failed, never all out at once); adopted and ready <= 2 s
after the new `up` with 4 instances.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import GENERATE, body, machine, table, use_uvloop, write_result
from tests.harness import Run

BIN_S = 0.25


async def _load(url: str, concurrency: int, stop: asyncio.Event, answers: list[tuple[float, bool]]) -> None:
    """Closed loop until `stop`; every answer as (epoch seconds, 200 or not)."""
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def worker(i: int) -> None:
            n = 0
            while not stop.is_set():
                n += 1
                try:
                    async with session.post(url, data=body(2, f"c{i}-{n % 31}"),
                                            headers={"Content-Type": "application/json"}) as r:
                        await r.read()
                        ok = r.status == 200
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    ok = False
                answers.append((time.time(), ok))
        await asyncio.gather(*(worker(i) for i in range(concurrency)))


def _engines(status: dict[str, Any]) -> dict[str, int]:
    return {i["id"]: i["mpirun_pid"] for i in status["instances"]}


def _kill_daemon(run: Run) -> None:
    os.kill(run.status()["daemon"]["pid"], signal.SIGKILL)
    run.proc.wait(timeout=10)  # type: ignore[union-attr]


def _fault(case: str, run: Run) -> float:
    """Apply the case's fault; returns when the new daemon was started (epoch seconds)."""
    if case == "upgrade":
        t = time.time()
        out = run.cli("upgrade", "--state-dir", str(run.state_dir), timeout=120)
        assert out.returncode == 0, out.stderr
        return t
    _kill_daemon(run)
    time.sleep(2.0)
    if case == "changed":
        run.args += ["--tritonserver-arg=--log-verbose=0"]
    t = time.time()
    run.start(wait_ready=False)
    return t


def _back(case: str, run: Run, old_daemon: int, engines: dict[str, int], timeout: float = 120) -> dict[str, Any]:
    """Wait for the case's end state; what status said on the way."""
    ready_seen: list[int] = []

    def back(st: dict[str, Any]) -> bool:
        if st["daemon"]["pid"] == old_daemon:
            return False
        ready = sum(i["state"] == "READY" for i in st["instances"])
        ready_seen.append(ready)
        replaced = not set(_engines(st).values()) & set(engines.values())
        return ready == len(engines) and (case != "changed" or replaced)

    st = run.wait_for(back, timeout, f"{case}: every instance READY under the new daemon")
    return {"status": st, "fewest_ready": min(ready_seen, default=len(engines))}


async def _case(case: str, instances: int, concurrency: int) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix=f"bench-live-restore-{case}-"))
    run = Run(tmp, gpus=f"0-{instances - 1}", tp=1, assume_gpus=instances, extra=("--proxy-workers", "2"))
    answers: list[tuple[float, bool]] = []
    stop = asyncio.Event()
    out: dict[str, Any] = {"case": case}
    try:
        await asyncio.to_thread(run.start)
        before = await asyncio.to_thread(run.status)
        engines = _engines(before)
        load = asyncio.create_task(_load(run.url(GENERATE), concurrency, stop, answers))
        await asyncio.sleep(2.0)
        t_fault = time.time()
        t_new = await asyncio.to_thread(_fault, case, run)
        back = await asyncio.to_thread(_back, case, run, before["daemon"]["pid"], engines)
        t_back = time.time()
        await asyncio.sleep(2.0)
        stop.set()
        await load
        after = back["status"]
        kept = sum(_engines(after)[iid] == pid for iid, pid in engines.items())
        t0 = answers[0][0] if answers else t_fault
        out.update({
            "answered": sum(ok for _, ok in answers), "failed": sum(not ok for _, ok in answers),
            "engines_kept": kept, "engines": len(engines),
            "restarts": sum(i["restarts"] for i in after["instances"]),
            "adopted": sum(bool(i.get("adopted")) for i in after["instances"]),
            "back_s": round(t_back - t_new, 2), "fewest_ready_after_new_daemon": back["fewest_ready"],
            "t_fault_s": round(t_fault - t0, 2), "t_new_daemon_s": round(t_new - t0, 2),
            "t_back_s": round(t_back - t0, 2),
            "per_bin": _bins(answers, t0),
        })
    finally:
        stop.set()
        if case == "upgrade" and run.proc is not None and run.proc.poll() is not None:
            # the daemon serving now is the one `upgrade` started, not the harness's: `down` as a
            # user would (the harness stops only its own; what it must kill is a leak)
            await asyncio.to_thread(run.cli, "down", "--state-dir", str(run.state_dir), timeout=180)
        out["leaked_pids"] = await asyncio.to_thread(run.close)
    print(f"  [{case}] {out.get('answered')} answered, {out.get('failed')} failed; engines kept "
          f"{out.get('engines_kept')}/{out.get('engines')}; back {out.get('back_s')} s after the new daemon",
          flush=True)
    return out


def _bins(answers: list[tuple[float, bool]], t0: float) -> dict[str, list[int]]:
    n = int((answers[-1][0] - t0) / BIN_S) + 1 if answers else 0
    ok, failed = [0] * n, [0] * n
    for t, good in answers:
        (ok if good else failed)[int((t - t0) / BIN_S)] += 1
    return {"ok": ok, "failed": failed}


def plot(result: dict[str, Any], plt: Any) -> Any:
    cases = result["cases"]
    fig, axes = plt.subplots(len(cases), 1, figsize=(9, 2.4 * len(cases)), squeeze=False)
    for ax, c in zip(axes[:, 0], cases):
        bins = c.get("per_bin") or {"ok": [], "failed": []}
        xs = [i * BIN_S for i in range(len(bins["ok"]))]
        ax.plot(xs, [v / BIN_S for v in bins["ok"]], label="answered/s")
        ax.plot(xs, [v / BIN_S for v in bins["failed"]], label="failed/s", color="red")
        for key, style, label in (("t_fault_s", "k--", "fault"), ("t_new_daemon_s", "g:", "new daemon"),
                                  ("t_back_s", "b:", "all ready")):
            if key in c:
                ax.axvline(c[key], color=style[0], linestyle=style[1:], label=label)
        ax.set_title(f"{c['case']}: {c.get('answered')} answered, {c.get('failed')} failed, engines kept "
                     f"{c.get('engines_kept')}/{c.get('engines')}", fontsize=9)
        ax.set_ylabel("requests/s")
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("seconds")
    axes[0, 0].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    return fig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--cases", default="kill9,upgrade,changed")
    args = ap.parse_args()
    use_uvloop()
    cases = [asyncio.run(_case(c, args.instances, args.concurrency)) for c in args.cases.split(",")]
    result = {"bench": "live_restore_bench", "machine": machine(), "instances": args.instances,
              "concurrency": args.concurrency, "cases": cases}
    print(table([{k: c.get(k) for k in ("case", "answered", "failed", "engines_kept", "restarts", "adopted",
                                         "back_s", "fewest_ready_after_new_daemon")} for c in cases],
                ["case", "answered", "failed", "engines_kept", "restarts", "adopted", "back_s",
                 "fewest_ready_after_new_daemon"]))
    path = write_result("live_restore_bench", result, plot)
    print(f"wrote {path}")
    return 0 if all(c.get("failed") == 0 and not c.get("leaked_pids") for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main())
