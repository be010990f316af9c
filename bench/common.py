"""Shared pieces of the benchmarks: load generator, stats, tables, results, side processes.

Load generator: closed loop, `concurrency` asyncio workers sharing ONE aiohttp
ClientSession (keep-alive, one pooled connection per worker), each posting the next
request as soon as the previous one answered. The same generator drives every target,
and it runs on the same 2 shared cores as the proxies and tritonservers: a target that
burns more CPU slows the generator down too. That is why every comparison is a ratio
taken inside one run, in interleaved rounds, reported as medians.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import aiohttp

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
GENERATE = "/v2/models/ensemble/generate"

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def body(max_tokens: int, prompt: str = "hello") -> bytes:
    return json.dumps({"text_input": prompt, "max_tokens": max_tokens, "bad_words": "",
                       "stop_words": ""}).encode()


def use_uvloop() -> bool:
    """The load generator uses uvloop when installed: less of the shared CPU for it."""
    try:
        import uvloop  # type: ignore[import-not-found]
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


# --- load -------------------------------------------------------------------------------
@dataclass
class LoadResult:
    target: str
    duration_s: float
    latencies_ms: list[float] = field(default_factory=list)  # successful requests only
    sent: int = 0
    failed: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    failures_at: list[float] = field(default_factory=list)  # epoch seconds of each failure
    error_samples: list[str] = field(default_factory=list)  # first few failure messages

    @property
    def ok(self) -> int:
        return len(self.latencies_ms)

    def summary(self) -> dict[str, Any]:
        return {"target": self.target, "duration_s": round(self.duration_s, 3), "sent": self.sent,
                "ok": self.ok, "failed": self.failed, "errors": self.errors,
                "rps": round(self.ok / self.duration_s, 1) if self.duration_s else 0.0,
                "error_samples": self.error_samples,
                "p50_ms": pct(self.latencies_ms, 50), "p90_ms": pct(self.latencies_ms, 90),
                "p99_ms": pct(self.latencies_ms, 99), "max_ms": round(max(self.latencies_ms), 3)
                if self.latencies_ms else None}


def pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return round(s[lo] + (s[hi] - s[lo]) * (k - lo), 3)


def med(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return round(statistics.median(vals), 3) if vals else None


async def run_load(urls: list[str] | str, *, concurrency: int, duration_s: float | None = None,
                   count: int | None = None, bodies: Callable[[int], bytes] | None = None,
                   target: str = "", stop: asyncio.Event | None = None,
                   warmup: int = 0, timeout_s: float = 30.0) -> LoadResult:
    """Closed-loop load: `concurrency` workers, until duration_s, count requests, or `stop`.

    `urls` may be a list: worker i uses urls[i % len] (client-side spreading).
    `bodies(n)` gives the n-th request body (fixed seed outside: deterministic).
    """
    if isinstance(urls, str):
        urls = [urls]
    bodies = bodies or (lambda n: body(1))
    res = LoadResult(target, 0.0)
    connector = aiohttp.TCPConnector(limit=concurrency * len(urls) + 4, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=connector, timeout=timeout,
                                     skip_auto_headers=("User-Agent",)) as session:
        # Warm-up: open the keep-alive connections (not counted).
        async def one(url: str, data: bytes) -> None:
            async with session.post(url, data=data, headers=headers) as r:
                await r.read()
        if warmup:
            await asyncio.gather(*(one(urls[i % len(urls)], bodies(0)) for i in range(warmup)),
                                 return_exceptions=True)
        seq = 0
        loop = asyncio.get_running_loop()
        t_start = loop.time()
        deadline = t_start + duration_s if duration_s is not None else None
        perf = time.perf_counter

        async def worker(i: int) -> None:
            nonlocal seq
            url = urls[i % len(urls)]
            while True:
                if stop is not None and stop.is_set():
                    return
                if deadline is not None and loop.time() >= deadline:
                    return
                if count is not None and seq >= count:
                    return
                n = seq
                seq += 1
                data = bodies(n)
                res.sent += 1
                t0 = perf()
                try:
                    async with session.post(url, data=data, headers=headers) as r:
                        await r.read()
                        status = r.status
                except Exception as exc:  # noqa: BLE001 - every failure is a data point
                    key = type(exc).__name__
                    res.failed += 1
                    res.errors[key] = res.errors.get(key, 0) + 1
                    res.failures_at.append(time.time())
                    if len(res.error_samples) < 5:
                        res.error_samples.append(f"{key}: {exc}"[:200])
                    continue
                if status == 200:
                    res.latencies_ms.append((perf() - t0) * 1000.0)
                else:
                    res.failed += 1
                    key = f"http_{status}"
                    res.errors[key] = res.errors.get(key, 0) + 1
                    res.failures_at.append(time.time())

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        res.duration_s = loop.time() - t_start
    return res


def mixed_bodies(seed: int, lo: int = 1, hi: int = 64) -> Callable[[int], bytes]:
    """Deterministic request mix: the n-th request has max_tokens from a seeded RNG."""
    rng = random.Random(seed)
    table = [body(rng.randint(lo, hi), prompt=f"p{n}") for n in range(20000)]
    return lambda n: table[n % len(table)]


# --- output -------------------------------------------------------------------------------
def table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    def fmt(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
        return str(v)
    cells = [[fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def tree_name(tree: Path) -> str:
    """What a baseline tree is: a checkout names its commit; an exported tree (git archive, carried
    to the GPU machine) its folder (`git -C` there would name the enclosing repository's commit)."""
    name = tree.resolve().name
    if (tree / ".git").exists():
        name = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True).stdout.strip() or name
    return name


def machine() -> dict[str, Any]:
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "loadavg_at_start": load, "aiohttp": aiohttp.__version__}


def write_result(name: str, data: dict[str, Any], plot: Callable[[dict[str, Any], Any], Any] | None = None,
                 results: Path | None = None) -> Path:
    """bench/results/<name>-<UTC stamp>.json (or in `results`), and with `plot` the same stem as .png."""
    results = results or RESULTS
    results.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = results / f"{name}-{stamp}.json"
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    if plot is not None:
        png = write_plot(path, data, plot)
        if png is not None:
            print(f"plot: {png}")
    return path


def write_result_md(name: str, data: dict[str, Any], plot: Callable[[dict[str, Any], Any], Any] | None,
                    results: Path | None, note: str, report: str) -> Path:
    """`report` printed; `write_result`, and beside it <stem>.md: a title, `note` and `report`."""
    print(report)
    path = write_result(name, data, plot, results=results)
    path.with_suffix(".md").write_text(f"# {name} ({path.stem})\n\n{note}\n\n{report}\n")
    print("wrote", path)
    return path


# --- pictures (matplotlib: the `bench` extra) ----------------------------------------------
def write_plot(json_path: Path, data: dict[str, Any], draw: Callable[[dict[str, Any], Any], Any]) -> Path | None:
    """Draw `data` with `draw(data, pyplot) -> figure` into a PNG next to its JSON.

    None (and one line on stderr) without matplotlib: a benchmark's numbers never
    depend on its picture. `python -m bench.plot FILE.json` redraws a committed run.
    """
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib (pip install -e '.[bench]'): no plot written", file=sys.stderr)
        return None
    fig = draw(data, plt)
    png = json_path.with_suffix(".png")
    fig.savefig(png, dpi=110, bbox_inches="tight")
    plt.close(fig)
    _to_palette(png)
    return png


def _to_palette(png: Path) -> None:
    """The picture in 256 colours: a third of matplotlib's bytes (a chart has a few colours, and
    its anti-aliased edges lose nothing one can see). Every run commits one, and the tracked files
    travel to the GPU machine with each call, 64 MiB in all (docs/gpus.md)."""
    from PIL import Image  # matplotlib's own dependency
    with Image.open(png) as image:
        small = image.convert("RGB").quantize(colors=256, dither=Image.Dither.NONE)
    small.save(png, optimize=True)


def finish(fig: Any, ax: Any, xlabel: str, ylabel: str, title: str) -> Any:
    """One chart's labels, grid, legend and layout: the figure, for write_plot."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def bench_parser(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's command line: its docstring as help, and --out."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="write the result here instead of bench/results")
    return ap


def bars(ax: Any, groups: list[str], series: dict[str, list[float | None]], *, ylabel: str,
         title: str, fmt: str = "{:.0f}") -> None:
    """Grouped bars: one group per x label, one bar per series, values written on top."""
    n = max(len(series), 1)
    width = 0.8 / n
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        ys = [v if v is not None else 0.0 for v in values]
        rects = ax.bar(xs, ys, width, label=name)
        for rect, v in zip(rects, values):
            if v is not None:
                ax.annotate(fmt.format(v), (rect.get_x() + rect.get_width() / 2, rect.get_height()),
                            ha="center", va="bottom", fontsize=7, xytext=(0, 1), textcoords="offset points")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if len(series) > 1:
        ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)


def latency_bars(ax: Any, rows: list[dict[str, Any]], title: str,
                 keys: tuple[str, ...] = ("p50_ms", "p90_ms", "p99_ms"), label: str = "target") -> None:
    """Latency percentiles per target (rows as the benches' tables have them)."""
    bars(ax, [str(r[label]) for r in rows], {k.replace("_ms", ""): [r.get(k) for r in rows] for k in keys},
         ylabel="ms", title=title, fmt="{:.1f}")


# --- side processes (NGINX / standalone embedded proxy on the same instances) ----------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 15.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process {proc.args!r} exited with {proc.returncode}")
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


def backends_of(status: dict[str, Any]):
    from orchestrator.routing.backends import Backend
    return tuple(Backend(i["id"], i["bind_address"], i["ports"]["http"], i["ports"]["grpc"],
                         i["ports"]["metrics"]) for i in status["instances"])


class SideNginx:
    """A private NGINX with the config trtllm-orch renders for --proxy nginx (same template,
    same least_conn upstream, keepalive and retry settings), pointed at the instances of an
    already running daemon. `workers`: its worker_processes, as `--proxy-workers` sets them
    (None: the product's default, `auto`, the count the embedded data plane runs too)."""

    def __init__(self, status: dict[str, Any], workers: int | None = None) -> None:
        from orchestrator.config import Settings
        from orchestrator.nginx.proxy import render_nginx_config
        import pwd
        self.dir = Path(tempfile.mkdtemp(prefix="bench-nginx-"))
        (self.dir / "temp").mkdir()
        self.port = free_port()
        settings = Settings(listen=f"127.0.0.1:{self.port}", grpc_listen="", metrics_listen="",
                            **({} if workers is None else {"proxy_workers": str(workers)}))
        user = pwd.getpwuid(os.geteuid()).pw_name if os.geteuid() == 0 else None
        text = render_nginx_config(settings, backends_of(status), self.dir, listen_port=self.port,
                                   worker_user=user)
        self.workers = settings.worker_count()
        self.conf = self.dir / "nginx.conf"
        self.conf.write_text(text)
        self.proc: subprocess.Popen | None = None

    def start(self) -> "SideNginx":
        from shutil import which
        nginx = which("nginx") or "/usr/sbin/nginx"
        self.proc = subprocess.Popen([nginx, "-p", str(self.dir), "-c", str(self.conf), "-e",
                                      str(self.dir / "error.log"), "-g", "daemon off;"],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=open(self.dir / "stderr.log", "wb"), start_new_session=True)
        wait_port(self.port, proc=self.proc)
        return self

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def pids(self) -> list[int]:
        import psutil
        if self.proc is None:
            return []
        try:
            p = psutil.Process(self.proc.pid)
            return [p.pid] + [c.pid for c in p.children()]
        except psutil.Error:
            return []

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGQUIT)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class SideEmbedded:
    """The embedded proxy (orchestrator.dataplane.embedded.EmbeddedProxy, same code as the
    daemon's) in its own process, with a fixed ready set: used where the benchmark needs a
    policy other than the daemon's (round-robin for reference)."""

    def __init__(self, status: dict[str, Any], policy: str, uvloop: bool = False,
                 tree: Path | None = None) -> None:
        """`tree`: run the proxy code of another checkout (e.g. the commit before a change)."""
        self.port = free_port()
        spec = [f"{i['id']}:{i['bind_address']}:{i['ports']['http']}:{i['ports']['grpc']}:"
                f"{i['ports']['metrics']}" for i in status["instances"]]
        self.args = [sys.executable, "-m", "bench._side_proxy", "--listen", f"127.0.0.1:{self.port}",
                     "--policy", policy, *(["--uvloop"] if uvloop else []), *spec]
        self.tree = Path(tree) if tree is not None else REPO
        self.proc: subprocess.Popen | None = None

    def start(self) -> "SideEmbedded":
        env = {**os.environ, "PYTHONPATH": str(self.tree)}
        self.proc = subprocess.Popen(self.args, cwd=self.tree, stdin=subprocess.DEVNULL, env=env,
                                     start_new_session=True)
        wait_port(self.port, proc=self.proc)
        return self

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def daemon_pid(status: dict[str, Any]) -> int:
    return int(status["daemon"]["pid"])


def dataplane_pids(status: dict[str, Any]) -> list[int]:
    """The data-plane worker processes serving the endpoint (`up --proxy embedded`): where its
    requests cost CPU, not the daemon."""
    return [int(w["pid"]) for p in status.get("proxies", []) for w in p.get("workers", []) if w.get("alive")]


def embedded_proxy_pids(status: dict[str, Any]) -> list[int]:
    """What `up --proxy embedded` spends its CPU in: the data-plane workers, and the daemon that
    feeds them (a benchmark's proxy CPU)."""
    return [daemon_pid(status), *dataplane_pids(status)]


# --- row benchmarks: one run's rows, or several runs' rows merged (a tree against another) --------
def missing_tools(bench: str, tools: tuple[str, ...]) -> bool:
    """True (and one line on stderr) when a tool is not on PATH; points sse_source's runner at it."""
    for tool in tools:
        if shutil.which(tool) is None:
            print(f"{bench}: {tool} not on PATH (../shared/tools/relay-kit packs it)", file=sys.stderr)
            return True
    if "sse_source" in tools:
        from bench.wrk import SseSource
        SseSource._binary = Path(shutil.which("sse_source"))  # type: ignore[arg-type]
    return False


def merged_rows(paths: list[Path]) -> list[dict[str, Any]]:
    return [r for path in paths for r in json.loads(path.read_text())["rows"]]


def write_rows(bench: str, rows: list[dict[str, Any]], out: Path, report: Callable[[dict[str, Any]], str],
               draw: Callable[[dict[str, Any], Any], Any]) -> None:
    """<out>/<bench>-<stamp>.{json,md,png} of `rows` measured on this machine; the report printed."""
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    machine = f"{len(os.sched_getaffinity(0))} cores, {os.uname().release}, Python {sys.version.split()[0]}"
    result = {"stamp": stamp, "machine": machine, "rows": rows}
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{bench}-{stamp}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    path.with_suffix(".md").write_text(report(result))
    write_plot(path, result, draw)
    print(report(result))
