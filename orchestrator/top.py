"""`trtllm-orch top`: the running daemon at a glance, refreshed twice a second.

Everything shown comes from `status` over the control socket (the daemon computes
the last minute's TTFT and tokens/s itself, orchestrator/dataplane/recent.py); this
module only renders. `render()` is pure (status dict in, rich renderable out) and
unit-tested; `run()` is the terminal part: rich's Live on the alternate screen,
keys read in cbreak mode through the event loop (never a blocking read), the
terminal restored on every way out. When stdout is not a terminal it prints one
table and returns, like `status`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from orchestrator.controlplane.control_socket import call
from orchestrator.errors import EXIT_OK, DaemonNotRunning, OrchError
from orchestrator.routing.llm_policies import ROUTE_KINDS

REFRESH_S = 0.5
_STATE_STYLE = {"READY": "bold green", "UNHEALTHY": "bold yellow", "STARTING": "cyan",
                "BACKOFF": "yellow", "STOPPING": "magenta", "FAILED": "bold red", "STOPPED": "dim"}
COLUMNS = ("ID", "STATE", "REASON", "GPUS", "UPTIME", "RESTARTS", "INFLIGHT", "WAITING", "ACTIVE",
           "KV", "REUSE", "TTFT p50", "TTFT p99", "TOK/s", "ROUTE h/m/s", "EST ERR", "GPU MEM", "GPU UTIL")
# What a narrow terminal gives up first: the rest keep their full width (a squeezed
# "RE…" column helps nobody).
DROP_ORDER = ("EST ERR", "ROUTE h/m/s", "REASON", "REUSE", "GPU UTIL", "GPU MEM", "RESTARTS", "TTFT p99", "UPTIME",
              "GPUS", "WAITING", "KV")
_MIN_WIDTH = {"ID": 2, "STATE": 9, "UPTIME": 6, "ACTIVE": 6, "TTFT p50": 8, "TTFT p99": 8,
              "GPU MEM": 9}


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _num(value: Any, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


def _pct(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction * 100:.0f}%"


def _gpu_cells(gpus: list[dict[str, Any]]) -> tuple[str, str]:
    if not gpus:
        return "-", "-"
    used = sum(g.get("memory_used_mib", 0) for g in gpus) / 1024
    total = sum(g.get("memory_total_mib", 0) for g in gpus) / 1024
    util = sum(g.get("utilization_pct", 0) for g in gpus) / len(gpus)
    return f"{used:.1f}/{total:.0f}G", f"{util:.0f}%"


def _routes(routes: dict[str, int] | None) -> str:
    """The last minute's picks of a prompt-aware policy: % prefix hit / miss / spill ("-" for
    another policy, or no prompt at stake)."""
    kinds = {"hit": 0, "miss": 0, "spill": 0}
    for reason, n in (routes or {}).items():
        kind = ROUTE_KINDS.get(reason)
        if kind is not None:
            kinds[kind] += n
    counts = list(kinds.values())
    total = sum(counts)
    return "/".join(f"{100 * c / total:.0f}" for c in counts) if total else "-"


def instance_row(inst: dict[str, Any]) -> list[Text | str]:
    state = inst["state"]
    engine = inst.get("engine") or {}
    llm = inst.get("llm") or {}
    reason = "" if state == "READY" and not inst.get("last_failure") else (inst.get("reason") or "")
    if state == "READY" and inst.get("last_failure"):
        reason = f"last failure: {inst['last_failure']}"
    active = f"{engine['active']}/{engine['max_active']}" if engine else "-"
    kv = _pct(engine.get("kv_fraction"))
    mem, util = _gpu_cells(inst.get("gpu") or [])
    return [inst["id"], Text(state, style=_STATE_STYLE.get(state, "")), Text(reason),  # no markup
            ",".join(map(str, inst["gpus"])), _duration(inst.get("uptime_s")), str(inst.get("restarts", 0)),
            str(inst.get("inflight", 0)), _num(engine.get("waiting")), active, kv,
            _pct(engine.get("kv_reuse_hit_rate")), _num(llm.get("ttft_p50_ms"), "{:.1f}ms"),
            _num(llm.get("ttft_p99_ms"), "{:.1f}ms"), _num(llm.get("tokens_per_s"), "{:.1f}"),
            _routes(llm.get("routes")), _pct(llm.get("ttft_est_err")), mem, util]


def header(status: dict[str, Any], error: str = "") -> Text:
    d = status["daemon"]
    endpoint = d.get("listen") or "(no load balancer)"
    if d.get("grpc_listen"):
        endpoint += f"  grpc {d['grpc_listen']}"
    text = Text()
    text.append("trtllm-orch top", style="bold")
    text.append(f"  endpoint {endpoint}  proxy {d.get('proxy', '?')}  policy {d.get('lb_policy', '?')}\n")
    ready, total = status.get("ready", 0), status.get("total", 0)
    text.append(f"ready {ready}/{total}", style="green" if ready == total and total else "yellow")
    text.append(f"  tokens/s {d.get('tokens_per_s', 0):.1f}  held {d.get('held', 0)}"
                f"  daemon pid {d.get('pid')} up {_duration(d.get('uptime_s'))}")
    # the data plane's worker processes, total and each (NGINX mode: its side workers)
    pools = [p for proxy in status.get("proxies", []) for p in (proxy, proxy.get("side") or {}) if "workers" in p]
    for pool in pools:
        alive, wanted = pool.get("workers_alive", 0), pool.get("workers_wanted", 0)
        label = "side workers" if pool.get("kind") == "side" else "workers"
        text.append(f"\n{label} {alive}/{wanted}", style="green" if alive == wanted else "yellow")
        text.append(f"  conns {pool.get('connections', 0)}  in flight {pool.get('inflight', 0)}  "
                    + "  ".join(f"w{w['slot']}:{w.get('connections', 0)}c/{w.get('inflight', 0)}f"
                                for w in pool["workers"]))
        without = [f"w{w['slot']}" for w in pool["workers"] if w.get("front_missing")]
        if without:  # --front auto, not built: aiohttp serves them at a fraction of the rate
            text.append(f"  no compiled front: {' '.join(without)}", style="yellow")
    if d.get("rolling_restart"):
        text.append("  rolling restart", style="magenta")
    if d.get("stopping"):
        text.append("  stopping", style="bold red")
    if error:
        text.append(f"\n{error}", style="bold red")
    return text


def columns_for(width: int | None) -> list[str]:
    """The columns that fit `width` (None: all), dropping the least needed first."""
    names = list(COLUMNS)

    def need(cols: list[str]) -> int:
        return sum(max(len(c), _MIN_WIDTH.get(c, 0)) + 2 for c in cols if c != "REASON") + \
            (24 if "REASON" in cols else 0)

    for name in DROP_ORDER:
        if width is None or need(names) <= width:
            break
        names.remove(name)
    return names


def render(status: dict[str, Any], error: str = "", footer: str = "", width: int | None = None) -> Group:
    table = Table(box=None, header_style="bold reverse", pad_edge=False, expand=False)
    names = columns_for(width)
    for name in names:
        table.add_column(name, no_wrap=True, overflow="ellipsis", min_width=_MIN_WIDTH.get(name),
                         max_width=40 if name == "REASON" else None,
                         justify="right" if name not in ("ID", "STATE", "REASON", "GPUS") else "left")
    keep = [COLUMNS.index(n) for n in names]
    for inst in status.get("instances", []):
        cells = instance_row(inst)
        table.add_row(*(cells[i] for i in keep))
    parts: list[Any] = [header(status, error), Text(""), table]
    if "REASON" not in names:  # too narrow for the column: why an instance is not READY, below
        for inst in status.get("instances", []):
            if inst["state"] != "READY" and inst.get("reason"):
                parts.append(Text(f"{inst['id']} {inst['state'].lower()}: {inst['reason']}",
                                  style=_STATE_STYLE.get(inst["state"], ""), overflow="ellipsis", no_wrap=True))
    if footer:
        parts += [Text(""), Text(footer, style="dim")]
    return Group(*parts)


# --- the terminal ---------------------------------------------------------------------
def show_once(socket_path: Path, out=None) -> int:
    """Not a terminal: one table, like `status`, wide enough not to wrap."""
    _, status = asyncio.run(call(socket_path, "GET", "/status"))
    width = int(os.environ.get("COLUMNS", "0") or 0) or 200
    console = Console(file=out or sys.stdout, width=width, color_system=None, force_terminal=False)
    console.print(render(status))
    return EXIT_OK


class _Keys:
    """stdin in cbreak mode (keys without Enter, Ctrl-C still a signal), read by the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_quit) -> None:
        self._loop = loop
        self._on_quit = on_quit
        self._fd = sys.stdin.fileno() if sys.stdin.isatty() else None
        self._saved: Any = None

    def __enter__(self) -> "_Keys":
        if self._fd is not None:
            import termios
            import tty
            self._saved = termios.tcgetattr(self._fd)
            tty.setcbreak(self._fd)
            self._loop.add_reader(self._fd, self._read)
        return self

    def _read(self) -> None:
        try:
            data = os.read(self._fd, 64)  # type: ignore[arg-type]  # readable now: does not block (a terminal's fd)
        except OSError:
            data = b""
        if not data or b"q" in data.lower():
            self._on_quit()

    def __exit__(self, *exc: Any) -> None:
        if self._fd is not None:
            import termios
            self._loop.remove_reader(self._fd)
            termios.tcsetattr(self._fd, termios.TCSADRAIN, self._saved)


async def _live(socket_path: Path, interval: float) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    _, status = await call(socket_path, "GET", "/status", timeout_s=5.0)  # no daemon: the usual error
    footer = "q or Ctrl-C: quit"
    console = Console()
    try:
        with _Keys(loop, stop.set), Live(render(status, footer=footer, width=console.width), console=console,
                                         screen=True,
                                         auto_refresh=False, transient=True) as live:
            while not stop.is_set():
                error = ""
                started = time.monotonic()
                try:
                    _, status = await call(socket_path, "GET", "/status", timeout_s=max(interval * 4, 2.0))
                except (DaemonNotRunning, OrchError) as exc:
                    error = f"daemon not answering: {exc}"
                live.update(render(status, error, footer, console.width), refresh=True)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), max(0.0, interval - (time.monotonic() - started)))
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        loop.remove_signal_handler(signal.SIGTERM)
    return EXIT_OK


def run(socket_path: Path, once: bool = False, interval: float = REFRESH_S) -> int:
    if once or not sys.stdout.isatty():
        return show_once(socket_path)
    return asyncio.run(_live(socket_path, interval))
