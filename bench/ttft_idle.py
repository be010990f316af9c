"""Is the hop's added time to first event at one stream the cost of waking idle cores?

    python3 -m bench.ttft_idle [--workers 1] [--seconds 4] [--rounds 3] [--out DIR]

dataplane_bench's TTFT measurement (1 stream, 10 ms between events, so every core the request
crosses has slept ~10 ms before it arrives) run twice per round: as the machine is, then with
a spinner on every core at SCHED_IDLE. A SCHED_IDLE task runs only when nothing else wants
the core and is preempted at once by any woken task, so the relays, sources and client keep
their cores; but no core ever goes idle: no idle state to leave, and in a VM no halted vCPU
that the host must schedule again (on whatever physical core, with whatever cache). If the
extra time of the Python hop over NGINX's is wake-up, it shrinks with the spinners; if it is
the interpreter's work, it stays. (/dev/cpu_dma_latency, the usual knob, does nothing where
the guest has no cpuidle driver, as on the GPU machine: it always halts.) Writes
<out>/ttft_idle-<stamp>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import dataplane_bench as dp  # noqa: E402
from bench.wrk import SseSource  # noqa: E402

SPIN = "while True: pass"


@contextlib.contextmanager
def busy_cores(on: bool, ncpu: int) -> Iterator[bool]:
    """One SCHED_IDLE spinner per core while inside; yields whether they run."""
    if not on:
        yield False
        return
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN], preexec_fn=_idle_on(c), stdin=subprocess.DEVNULL)
                for c in range(ncpu)]
    try:
        yield True
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def _idle_on(core: int) -> Any:
    def setup() -> None:
        os.sched_setaffinity(0, [core])
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    return setup


def cpuidle_driver() -> str:
    try:
        return Path("/sys/devices/system/cpu/cpuidle/current_driver").read_text().strip()
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = ap.parse_args(argv)
    for tool in ("nginx", "sse_source"):
        if shutil.which(tool) is None:
            print(f"ttft_idle: {tool} not on PATH (../shared/tools/relay-kit packs it)", file=sys.stderr)
            return 2
    SseSource._binary = Path(shutil.which("sse_source"))  # type: ignore[arg-type]
    ncpu = len(os.sched_getaffinity(0))
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    rows: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        for spin in (False, True):  # alternated: drift over the run hits both alike
            with busy_cores(spin, ncpu) as took:
                t = dp.ttft(args.workers, args.seconds, ncpu, (1,))
            row = {"round": rnd, "idle_spinners": took,
                   **{name: {k: r.get(k) for k in ("p50_ms", "p99_ms", "added_p50_ms", "added_p99_ms")}
                      for name, r in t["streams_1"].items()}}
            rows.append(row)
            dp.log(json.dumps(row))
    result = {"stamp": stamp, "machine": f"{ncpu} cores, {os.uname().release}", "cpuidle_driver": cpuidle_driver(),
              "workers": args.workers,
              "streams": 1, "event_gap_ms": 10, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"ttft_idle-{stamp}.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
