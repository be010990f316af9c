"""What `up` shows while engines load: per instance, the time since launch and the
last meaningful line of its log, until it is READY (or FAILED, with its log tail).

Real engines take minutes to load and `up` was silent between STARTING and READY.
This renderer is fed by the daemon's instance-change callback (`changed`, a dict
update: nothing else on that path) and by the instances' in-memory log tails, which
it reads itself from its own task, twice a second, off the request path. It is done
once every instance has settled (READY or FAILED) and then stays quiet: later
restarts are the log's business.

Two ways to show it:
- a terminal (stderr is a tty, not under systemd): a rich Live block under the log
  lines, one row per instance, left on screen as a summary when all have settled;
- anything else (a file, a pipe, journald via JOURNAL_STREAM): one plain log line
  per loading instance every PLAIN_EVERY_S, so a journal shows progress too.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import sys
import time
from collections.abc import Mapping
from typing import Any, Protocol

log = logging.getLogger("trtllm-orch")

REFRESH_S = 0.5
PLAIN_EVERY_S = 10.0
TAIL_LINES = 3  # of a failed instance's log, under its row

_RANK_TAG = re.compile(r"^\[(?:\d+,)?(\d+)\](?:<std(?:out|err)>:)?\s?")
# tritonserver's glog prefix: I1122 01:16:15.157670 26458 model_lifecycle.cc:472]
_GLOG = re.compile(r"^[IWEF]\d{4} [\d:.]+\s+\d+ [\w.]+:\d+\] ")
# Triton's line for a model whose load completed (model_lifecycle.cc).
_FINISHED = re.compile(r"^(?:rank \d+: )?successfully loaded '")
# Every instance starts STOPPED: only READY and FAILED end the loading (a `down` during
# the load cancels the renderer with the daemon's other tasks).
_SETTLED = frozenset({"READY", "FAILED"})
_STYLE = {"READY": "bold green", "FAILED": "bold red", "BACKOFF": "yellow", "STARTING": "cyan",
          "UNHEALTHY": "yellow"}


class Loading(Protocol):
    """What the renderer reads of an instance (orchestrator.controlplane.instance.Instance has it)."""

    id: str
    reason: str
    started_at: float | None
    startup_s: float | None

    @property
    def state(self) -> Any: ...

    @property
    def plan(self) -> Any: ...

    def log_tail(self, n: int = 20) -> list[str]: ...

    def error_lines(self, n: int = 3) -> list[str]: ...


def meaningful(line: str) -> str:
    """A log line without its rank tag and glog prefix; '' for noise (tables, blanks, our notes)."""
    m = _RANK_TAG.match(line)
    rank = m.group(1) if m else None
    text = line[m.end():] if m else line
    text = _GLOG.sub("", text).strip()
    if text.startswith('"') and text.endswith('"') and len(text) >= 2:
        text = text[1:-1].strip()
    if not text or text[0] in "+|" or text.startswith("[trtllm-orch] launch:"):
        return ""
    return f"rank {rank}: {text}" if rank is not None else text


def last_meaningful(lines: list[str]) -> str:
    """The newest line that says what the instance is still doing.

    Triton loads a repository's models side by side: the tokenizer models finish in
    a second and say "successfully loaded 'preprocessing'" while the engine goes on
    loading for minutes. Such a line is the answer only when no newer line of a load
    still under way precedes it."""
    finished = ""
    for line in reversed(lines):
        text = meaningful(line)
        if not text:
            continue
        if _FINISHED.search(text):
            finished = finished or text
            continue
        return text
    return finished


def _state(inst: Loading) -> str:
    state = inst.state
    return getattr(state, "value", str(state))


def plain_line(inst: Loading, now: float) -> str:
    elapsed = now - inst.started_at if inst.started_at is not None else 0.0
    return f"instance={inst.id} loading for {elapsed:.0f}s: {last_meaningful(inst.log_tail(40)) or '(no output yet)'}"


def rows(instances: Mapping[str, Loading], now: float) -> list[tuple[str, str, str, str, list[str]]]:
    """(id, state, elapsed, what, tail lines) per instance: the view, without the terminal."""
    out = []
    for inst in instances.values():
        state = _state(inst)
        tail: list[str] = []
        if state == "READY":
            elapsed = f"{inst.startup_s:.1f}s" if inst.startup_s is not None else "-"
            what = f"ready in {elapsed}"
        elif state == "FAILED":
            elapsed = "-"
            what = inst.reason
            tail = [meaningful(ln) or ln for ln in inst.error_lines(TAIL_LINES)]
        else:
            elapsed = f"{now - inst.started_at:.1f}s" if inst.started_at is not None else "-"
            what = last_meaningful(inst.log_tail(40))
            if state == "BACKOFF":
                what = inst.reason
        out.append((inst.id, state, elapsed, what, tail))
    return out


def use_terminal(stream: Any = None) -> bool:
    stream = stream or sys.stderr
    return stream.isatty() and not os.environ.get("JOURNAL_STREAM")


class LoadProgress:
    def __init__(self, terminal: bool | None = None) -> None:
        self.terminal = use_terminal() if terminal is None else terminal
        self._seen: dict[str, str] = {}  # instance -> last state the callback reported
        self._changed = asyncio.Event()

    def changed(self, inst: Loading) -> None:
        """The daemon's instance-change callback: note it, redraw soon. Nothing more here."""
        self._seen[inst.id] = _state(inst)
        self._changed.set()

    @staticmethod
    def settled(instances: Mapping[str, Loading]) -> bool:
        return all(_state(i) in _SETTLED for i in instances.values())

    async def run(self, instances: Mapping[str, Loading]) -> None:
        """Owned by the daemon (a background task): shows progress until all settled, then idles."""
        if self.terminal:
            await self._run_live(instances)
        else:
            await self._run_plain(instances)
        await asyncio.Event().wait()  # done; the daemon cancels us at its end

    async def _wait(self, seconds: float) -> None:
        self._changed.clear()
        try:
            await asyncio.wait_for(self._changed.wait(), seconds)
        except asyncio.TimeoutError:
            pass

    async def _run_plain(self, instances: Mapping[str, Loading]) -> None:
        await self._wait(PLAIN_EVERY_S)
        while not self.settled(instances):
            now = time.monotonic()
            for inst in instances.values():
                if _state(inst) == "STARTING" and inst.started_at is not None \
                        and now - inst.started_at >= PLAIN_EVERY_S / 2:
                    log.info("%s", plain_line(inst, now))
            await asyncio.sleep(PLAIN_EVERY_S)

    async def _run_live(self, instances: Mapping[str, Loading]) -> None:
        from rich.console import Console
        from rich.live import Live

        real = sys.stderr
        console = Console(file=real)
        live = Live(self.render(instances), console=console, auto_refresh=False, transient=False,
                    redirect_stdout=False, redirect_stderr=True)
        live.start()
        # Our log handlers hold the real stderr: point them at the Live's proxy (now
        # sys.stderr) so log lines print above the block instead of through it.
        moved = _redirect_handlers(real, sys.stderr)
        try:
            while True:
                live.update(self.render(instances), refresh=True)
                if self.settled(instances):
                    break
                await self._wait(REFRESH_S)
        finally:
            _restore_handlers(moved)
            live.stop()

    def render(self, instances: Mapping[str, Loading]) -> Any:
        from rich.table import Table
        from rich.text import Text

        table = Table(box=None, show_header=True, header_style="bold", pad_edge=False,
                      title="loading engines", title_justify="left", title_style="bold")
        table.add_column("ID")
        table.add_column("GPUS")
        table.add_column("STATE")
        table.add_column("ELAPSED", justify="right")
        table.add_column("LAST LOG LINE", overflow="ellipsis", no_wrap=True, max_width=100)
        for inst_id, state, elapsed, what, tail in rows(instances, time.monotonic()):
            gpus = ",".join(map(str, instances[inst_id].plan.gpus))
            # Text, not str: log lines hold brackets ("[twin tensorrt_llm] ...") that rich
            # would read as markup and swallow.
            table.add_row(inst_id, gpus, Text(state, style=_STYLE.get(state, "")), elapsed, Text(what))
            for line in tail:
                table.add_row("", "", "", "", Text(f"log: {line}", style="red"))
        return table


def _redirect_handlers(old: Any, new: Any) -> list[tuple[logging.StreamHandler, Any]]:
    moved = []
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and getattr(handler, "stream", None) is old:
            handler.setStream(new)
            moved.append((handler, old))
    return moved


def _restore_handlers(moved: list[tuple[logging.StreamHandler, Any]]) -> None:
    for handler, stream in moved:
        handler.setStream(stream)
