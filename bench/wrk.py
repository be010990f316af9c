"""wrk (a C load generator) for the proxy benchmark, and the pieces its --wrk mode needs.

wrk (Debian: `apt-get install -y wrk`) is driven with a generated Lua script that POSTs one
body, optionally paces each connection (`delay()`: wrk has no fixed-rate mode, wrk2 is not
packaged), and prints its result as one JSON line from `done()`: requests, duration,
errors and latency percentiles straight from wrk's own histogram (microseconds).

Why wrk and not the Python generator of bench/common.py: on this 2-core box a Python
client spends more CPU per request than the proxies it measures, so it hid the
embedded proxy's cost (issue 12). The Python client stays where wrk cannot go: the time
to the first SSE event of a stream.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from bench.common import REPO, free_port, wait_port

_MARK = "WRKJSON "


def wrk_path() -> str | None:
    return shutil.which("wrk")


def _lua(body: bytes, pace_ms: float) -> str:
    # A Lua long string keeps the JSON body byte for byte (no escaping rules to get wrong).
    text = body.decode()
    assert "]==]" not in text
    lines = ['wrk.method = "POST"', f"wrk.body = [==[{text}]==]",
             'wrk.headers["Content-Type"] = "application/json"']
    if pace_ms:
        # Each connection waits this long after a response before its next request.
        lines.append(f"function delay() return {pace_ms:g} end")
    lines += [
        "function done(summary, latency, requests)",
        "  local e = summary.errors",
        f'  io.write(string.format("{_MARK}{{\\"requests\\":%d,\\"duration_us\\":%d,\\"bytes\\":%d,'
        '\\"connect\\":%d,\\"read\\":%d,\\"write\\":%d,\\"status\\":%d,\\"timeout\\":%d,'
        '\\"p50_us\\":%d,\\"p90_us\\":%d,\\"p99_us\\":%d,\\"mean_us\\":%.1f,\\"max_us\\":%d}\\n",',
        "    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status,",
        "    e.timeout, latency:percentile(50), latency:percentile(90), latency:percentile(99),",
        "    latency.mean, latency.max))",
        "end"]
    return "\n".join(lines) + "\n"


def run_wrk(url: str, body: bytes, *, connections: int, seconds: float, pace_ms: float = 0.0,
            timeout_s: float = 10.0, threads: int = 1, cpus: tuple[int, ...] = ()) -> dict[str, Any]:
    """One wrk run: one thread by default (against one single-threaded proxy); `threads`
    and `cpus` (the cores wrk may use) for the many-core data-plane bench."""
    wrk = wrk_path()
    if wrk is None:
        raise RuntimeError("wrk not found: apt-get install -y wrk")
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(_lua(body, pace_ms))
        script = f.name
    try:
        out = subprocess.run([wrk, f"-t{threads}", f"-c{connections}", f"-d{max(1, round(seconds))}s",
                              f"--timeout={timeout_s:g}s", "-s", script, url],
                             capture_output=True, text=True, timeout=seconds + timeout_s + 30,
                             preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    finally:
        Path(script).unlink(missing_ok=True)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith(_MARK)), None)
    if line is None:
        raise RuntimeError(f"wrk gave no result (rc {out.returncode}): {out.stdout[-500:]} {out.stderr[-500:]}")
    r = json.loads(line[len(_MARK):])
    dur = r["duration_us"] / 1e6
    errors = {k: r[k] for k in ("connect", "read", "write", "status", "timeout") if r[k]}
    return {"rps": round(r["requests"] / dur, 1) if dur else 0.0, "requests": r["requests"],
            "duration_s": round(dur, 3), "bytes": r["bytes"], "errors": errors,
            "failed": sum(errors.values()),
            "p50_ms": r["p50_us"] / 1000, "p90_ms": r["p90_us"] / 1000, "p99_ms": r["p99_us"] / 1000,
            "mean_ms": round(r["mean_us"] / 1000, 3), "max_ms": r["max_us"] / 1000}


# --- CPU time of the process(es) behind a target ----------------------------------------------
def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds used so far by these processes (gone ones count 0)."""
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def idle_cpu_rate(pids: list[int], seconds: float = 2.0) -> float:
    """CPU seconds per second these processes use with no traffic (a daemon's probes...)."""
    c0 = cpu_seconds(pids)
    time.sleep(seconds)
    return (cpu_seconds(pids) - c0) / seconds


# --- a compiled token source ---------------------------------------------------------------
class SseSource:
    """bench/sse_source.c, compiled on first use (cc), serving SSE streams on a free port:
    `procs` processes on that one port (SO_REUSEPORT), one instance with `procs` cores' worth
    of capacity."""

    _binary: Path | None = None

    def __init__(self, events: int, gap_us: int, procs: int = 1) -> None:
        self.port = free_port()
        self.events = events
        self.gap_us = gap_us
        self.nprocs = procs
        self.procs: list[subprocess.Popen] = []

    @property
    def proc(self) -> subprocess.Popen | None:
        """The first process (the only one unless `procs` > 1)."""
        return self.procs[0] if self.procs else None

    @property
    def dead(self) -> bool:
        """Whether any of its processes exited."""
        return any(p.poll() is not None for p in self.procs)

    @classmethod
    def build(cls) -> Path:
        if cls._binary is None:
            cc = shutil.which("cc") or shutil.which("gcc")
            if cc is None:
                raise RuntimeError("no C compiler (cc) for bench/sse_source.c")
            out = Path(tempfile.mkdtemp(prefix="bench-sse-")) / "sse_source"
            subprocess.run([cc, "-O2", "-o", str(out), str(REPO / "bench" / "sse_source.c")], check=True)
            cls._binary = out
        return cls._binary

    def start(self) -> "SseSource":
        for _ in range(self.nprocs):
            proc = subprocess.Popen([str(self.build()), str(self.port), str(self.events), str(self.gap_us)],
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, start_new_session=True)
            self.procs.append(proc)
            # each one listening before the next starts and before any load: a process that joined
            # the port's group late would get none of the connections opened before it
            if proc.stdout is None or not proc.stdout.readline().startswith(b"listening"):
                self.stop()
                raise RuntimeError(f"sse_source on port {self.port} exited before listening")
        wait_port(self.port, proc=self.proc)
        return self

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            proc.wait(5)
            if proc.stdout is not None:
                proc.stdout.close()


def fake_status(ports: list[int]) -> dict[str, Any]:
    """The part of `trtllm-orch status --json` that SideNginx/SideEmbedded read, for sources."""
    return {"instances": [{"id": str(i), "bind_address": "127.0.0.1",
                           "ports": {"http": p, "grpc": p, "metrics": p}} for i, p in enumerate(ports)]}


# --- time to first token, with a Python SSE client ------------------------------------------
async def ttft_load(urls: list[str], body: bytes, *, streams: int, seconds: float) -> dict[str, Any]:
    """`streams` closed-loop SSE clients (stream i on urls[i % len]); TTFT = POST sent to the
    first `data:` event read. Light load (a few streams at ms per token): the Python
    client's own cost is small next to the token times it measures."""
    import aiohttp

    ttft: list[float] = []
    failed = 0
    events = 0
    connector = aiohttp.TCPConnector(limit=streams * len(urls) + 4)
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as s:
        deadline = loop.time() + seconds

        async def worker(i: int) -> None:
            nonlocal failed, events
            url = urls[i % len(urls)]
            while loop.time() < deadline:
                t0 = time.perf_counter()
                first = None
                n = 0
                try:
                    async with s.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
                        if r.status != 200:
                            failed += 1
                            await r.read()
                            continue
                        while True:
                            chunk = await r.content.readany()
                            if not chunk:
                                break
                            if first is None and b"data:" in chunk:
                                first = time.perf_counter() - t0
                            n += chunk.count(b"\n\n")
                except aiohttp.ClientError:
                    failed += 1
                    continue
                if first is None:
                    failed += 1
                else:
                    ttft.append(first * 1000)
                    events += n

        await asyncio.gather(*(worker(i) for i in range(streams)))
    from bench.common import pct
    return {"n": len(ttft), "failed": failed, "events": events, "ttft_ms": ttft,
            "p50_ms": pct(ttft, 50), "p90_ms": pct(ttft, 90), "p99_ms": pct(ttft, 99)}


__all__ = ["SseSource", "cpu_seconds", "fake_status", "idle_cpu_rate", "run_wrk", "ttft_load", "wrk_path"]
