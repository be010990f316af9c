"""The data plane as the daemon sees it: N proxy worker processes, supervised.

The pool binds the public HTTP and metrics sockets once and hands the same
sockets to every worker (inherited file descriptors), so the port is bound from
`up` to `down` whatever happens to any one worker: a worker that dies leaves its
share of the accept queue to the others, a replaced one takes over the same
socket. Why one shared socket rather than one SO_REUSEPORT socket per worker:
closing a reuseport socket resets the connections still in its own accept queue
(unless the host sets net.ipv4.tcp_migrate_req), so every worker replacement and
every shrink at reload would refuse a few clients under load; a shared socket
never closes while the run lives. Workers run with libuv's single-accept mode, so
an idle worker is not outraced to a burst of connections by a busy one.

It owns: the sockets, the shared table, prefix index, pending-prefill, routed-block and turns
files (created zeroed at start), the feed server, one supervising task per slot, the worker
processes. It publishes to the workers,
over the feed, what the daemon owns: membership (on every change), each ready
instance's engine snapshots (as scraped, each with every worker's count in flight there as it
was published), the settings (at reload). It takes from
them passive health reports, which go to the instance's own PassiveHealth, and
their per-second stats (for `status` and `top`).

A worker that exits unasked is replaced in its slot (its rows of the table and pending file are
cleared first: what it had in flight died with its connections; its routed blocks stay, the
cumulative counts the other workers' write logs read); one that dies
again within STABLE_S of its start waits a growing backoff, as engines do.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.config import Settings, settings_to_json
from orchestrator.controlplane.adoption import AdoptableWorker
from orchestrator.launcher.adopted import UNKNOWN_EXIT, AdoptedProcess
from orchestrator.dataplane.accept import bind_listener
from orchestrator.dataplane.feed import FeedServer
from orchestrator.dataplane.recent import histogram_percentile
from orchestrator.dataplane.shared_prefix import SharedPrefixIndex
from orchestrator.dataplane.shared_pending import SharedPending
from orchestrator.dataplane.shared_stamps import SharedStamps
from orchestrator.dataplane.shared_table import SharedTable, TableError, instance_index
from orchestrator.dataplane.worker import (dataplane_dir, feed_path, handover_path, pending_path, prefix_path,
                                           routed_paths, table_path, turns_path)
from orchestrator.errors import OrchError
from orchestrator.health.engine_state import EngineSnapshot
from orchestrator.launcher.command import ENV_STATE_DIR
from orchestrator.routing.backends import Backend, ReadyBackends
from orchestrator.routing.balancer import notes_counts
from orchestrator.routing.eviction import KvWrites
from orchestrator.tasks import cancel_and_wait

START_TIMEOUT_S = 30.0
HANDOVER_TIMEOUT_S = 5.0  # a worker's feed client retries every <= 0.5 s
STABLE_S = 10.0
BACKOFF_MAX_S = 5.0
ENV_ROLE = "TRTLLM_ORCH_ROLE"  # "dataplane": what the reaper and adoption look for


@dataclass
class _Slot:
    index: int
    proc: "asyncio.subprocess.Process | AdoptedProcess | None" = None
    started: float = 0.0
    restarts: int = 0
    fast_failures: int = 0
    last_exit: str = ""
    version: str = ""
    listening: asyncio.Event = field(default_factory=asyncio.Event)
    stats: dict[str, Any] = field(default_factory=dict)
    wanted: bool = True
    task: asyncio.Task[None] | None = None


class WorkerPool:
    kind = "embedded"

    def __init__(self, settings: Settings, backends: ReadyBackends, state_dir: Path,
                 logger: logging.Logger | None = None, on_change: Callable[[], None] | None = None,
                 adopt: list[AdoptableWorker] | None = None, listen_flag: str = "--listen") -> None:
        """listen_flag: the option `settings.listen` came from, for the errors that name it (the
        side workers' is --openai-listen: controlplane/side_workers.py)."""
        self._settings = settings
        self._listen_flag = listen_flag
        self._backends = backends
        self._state_dir = state_dir
        self._log = logger or logging.getLogger("trtllm-orch.dataplane")
        self._on_change = on_change or (lambda: None)
        self._dir = dataplane_dir(state_dir)
        self._prom_dir = self._dir / "prometheus"
        self._settings_file = self._dir / "settings.json"
        self._slots: dict[int, _Slot] = {}
        self._sockets: dict[str, socket.socket] = {}
        self._table: SharedTable | None = None
        self._pending: SharedPending | None = None  # None: a data plane adopted from a daemon without it
        self._stamps: SharedStamps | None = None  # the workers' turns and counts at their choices
        self._feed: FeedServer | None = None
        self._unsubscribe: Callable[[], None] | None = None
        self._hooked: dict[str, tuple[Any, Callable[[EngineSnapshot], None]]] = {}
        # Each ready instance's last snapshot and the feed message made of it: with the eviction
        # verdict over every snapshot since the instance joined (`gone_before`: one verdict for
        # every worker, late ones included) and, where it went out, the count it went out with
        # (`routed`). A worker that connects gets that message, not a count read later that the
        # snapshot never saw.
        self._published: dict[str, tuple[EngineSnapshot, dict[str, Any]]] = {}
        self._stopping = False
        self._resize_task: asyncio.Task[None] | None = None
        # Live restore: workers a previous daemon left serving. Until this daemon's ready
        # set first has an instance, they keep the membership they have (an empty set
        # would hold every request while the adopted engines are probed).
        self._adopt = list(adopt or [])
        self._adopting = bool(self._adopt)
        self._handover: asyncio.Task[None] | None = None
        self._bound = asyncio.Event()  # the listening socket is here: bound, or handed over

    # --- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        s = self._settings
        self._dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            if not await self._adopt_workers():
                self._fresh_files()
                self._bind_public()
                await self._start_feed()
            self._write_settings()
            self._unsubscribe = self._backends.subscribe(self._on_members)
            # A set published before (a daemon publishes after: its instances are not ready yet)
            # reaches the workers in their hello; its engine numbers from its next snapshots.
            self._hook_views(self._backends.current())
            if self._resize_task is None:  # adopting: _after_handover grows once it has the sockets
                await self._grow(s.worker_count())
        except BaseException:
            await self.stop(0)
            raise
        self._log.info("data plane: %d worker(s) on %s (grpc %s, metrics %s)", len(self._slots), s.listen,
                       s.grpc_listen or "off", s.metrics_listen or "off")

    def _fresh_files(self) -> None:
        shutil.rmtree(self._prom_dir, ignore_errors=True)  # counters of a previous run
        self._prom_dir.mkdir(mode=0o700)
        self._table = SharedTable.create(table_path(self._state_dir))
        SharedPrefixIndex.create(prefix_path(self._state_dir)).close()  # the workers map it
        self._pending = SharedPending.create(pending_path(self._state_dir))
        for path in routed_paths(self._state_dir):  # the workers map them; nobody clears them
            SharedPending.create(path).close()
        self._stamps = SharedStamps.create(turns_path(self._state_dir))

    def _adopt_routed(self) -> None:
        """Routed-block and turns files where a daemon without them left none: the workers started
        from now on share their write logs and turns (the adopted ones keep their own)."""
        for path in routed_paths(self._state_dir):
            if not path.exists():
                SharedPending.create(path).close()
        try:
            self._stamps = SharedStamps.open(turns_path(self._state_dir))
        except TableError:  # none, or of another layout: made anew (a stamp is about now either way)
            self._stamps = SharedStamps.create(turns_path(self._state_dir))

    def _adopt_pending(self) -> SharedPending | None:
        """The adopted workers' pending-prefill file; made where a daemon without it left none (the
        workers started from now on share theirs). One of another layout stays as it is: the
        adopted workers map it, and the new ones keep their ledgers to themselves."""
        path = pending_path(self._state_dir)
        try:
            return SharedPending.open(path)
        except TableError as exc:
            if path.exists():
                self._log.warning("live restore: %s: pending prefill not shared", exc)
                return None
        return SharedPending.create(path)

    async def _start_feed(self) -> None:
        self._feed = FeedServer(feed_path(self._state_dir), on_connect=self._on_connect,
                                on_message=self._on_message, logger=self._log)
        await self._feed.start()

    async def _adopt_workers(self) -> bool:
        """Take over the workers a previous daemon left (live restore): the same table,
        prefix index and Prometheus files; the listening sockets come from a worker over
        SCM_RIGHTS. False: nothing to adopt (or it could not be), start fresh."""
        if not self._adopt:
            return False
        try:
            self._table = SharedTable.open(table_path(self._state_dir))
        except TableError as exc:
            self._log.warning("live restore: %s: the previous workers are stopped, new ones started", exc)
            await self._stop_strays()
            return False
        self._pending = self._adopt_pending()
        self._adopt_routed()
        for w in self._adopt:
            slot = self._slots[w.slot] = _Slot(w.slot)
            slot.proc = AdoptedProcess(w.pid, w.create_time)
            slot.started, slot.version = time.monotonic(), w.version
            slot.listening.set()  # it serves already
            slot.task = asyncio.get_running_loop().create_task(self._supervise(slot),
                                                               name=f"dataplane-worker-{w.slot}")
        self._handover = asyncio.get_running_loop().create_task(self._receive_sockets(), name="dataplane-handover")
        await self._start_feed()  # the workers reconnect (their feed client retries every <= 0.5 s)
        # The sockets are needed only to start a worker: the adopted ones serve meanwhile,
        # and the daemon goes on adopting its instances without waiting for them.
        self._resize_task = asyncio.get_running_loop().create_task(self._after_handover(), name="dataplane-adopt")
        return True

    async def _after_handover(self) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._bound.wait(), HANDOVER_TIMEOUT_S)
        s = self._settings
        if not self._sockets:
            self._log.warning("live restore: no worker handed its sockets over in %.0fs: they are "
                              "stopped, new ones started", HANDOVER_TIMEOUT_S)
            await self._retire(list(self._slots.values()), 0)
            try:
                self._bind_public()
            except OrchError as exc:
                self._log.error("live restore: the data plane cannot start: %s", exc)
                return
        else:
            self._log.info("live restore: adopted %d data-plane worker(s) and their sockets", len(self._slots))
        await self._resize(s.worker_count())

    def _bind_public(self) -> None:
        s = self._settings
        try:
            self._sockets["listen"] = bind_listener(s.listen, self._listen_flag)
            if s.metrics_listen:
                self._sockets["metrics_listen"] = bind_listener(s.metrics_listen, "--metrics-listen")
        except OrchError:
            for sock in self._sockets.values():
                sock.close()
            self._sockets.clear()
            raise
        self._bound.set()

    async def listen_port(self, timeout_s: float = HANDOVER_TIMEOUT_S + 1.0) -> int:
        """The port the workers listen on: bound at start, or (adopting) that of the socket an
        adopted worker hands over, else of the one bound anew when none does."""
        try:
            await asyncio.wait_for(self._bound.wait(), timeout_s)
        except asyncio.TimeoutError:
            raise OrchError(f"{self._listen_flag}={self._settings.listen!r}: the data plane has no listening "
                            f"socket after {timeout_s:.0f}s") from None
        return int(self._sockets["listen"].getsockname()[1])

    async def _stop_strays(self) -> None:
        for w in self._adopt:
            AdoptedProcess(w.pid, w.create_time).kill()
        await asyncio.gather(*(AdoptedProcess(w.pid, w.create_time).wait() for w in self._adopt))

    async def _receive_sockets(self) -> None:
        """One worker sends the listening sockets it serves on (SCM_RIGHTS): a replacement
        or an extra worker of this daemon then serves the very same sockets."""
        path = handover_path(self._state_dir)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(path))
        os.chmod(path, 0o600)
        server.listen(8)
        server.setblocking(False)
        loop = asyncio.get_running_loop()
        try:
            while not self._sockets:
                conn, _ = await loop.sock_accept(server)
                with conn:
                    conn.setblocking(True)
                    conn.settimeout(2.0)
                    try:
                        data, fds, _, _ = await asyncio.to_thread(socket.recv_fds, conn, 4096, 4)
                        names = json.loads(data)["names"]
                    except (OSError, ValueError, KeyError) as exc:
                        self._log.warning("live restore: a bad socket handover: %r", exc)
                        continue
                    for name, fd in zip(names, fds):
                        sock = socket.socket(fileno=fd)
                        sock.setblocking(False)
                        self._sockets[name] = sock
                    if "listen" in self._sockets:
                        self._bound.set()
        finally:
            server.close()
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    async def stop(self, grace_s: float = 5.0) -> None:
        self._stopping = True
        await cancel_and_wait(self._handover, self._resize_task)
        await self._retire(list(self._slots.values()), grace_s)
        for view, listener in self._hooked.values():
            with contextlib.suppress(ValueError):
                view.listeners.remove(listener)
        self._hooked.clear()
        self._published.clear()
        await self._close_own()

    async def detach(self) -> None:
        """Leave the workers serving for the next daemon (live restore): close only what is
        this daemon's (the feed, its copies of the sockets, its view of the table)."""
        self._stopping = True
        await cancel_and_wait(self._handover, self._resize_task, *(s.task for s in self._slots.values()))
        await self._close_own()

    async def _close_own(self) -> None:
        """What this daemon holds of the data plane, closed (stop and detach alike): its
        membership subscription, the feed, its copies of the public sockets, its view of the table."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._feed is not None:
            await self._feed.stop()
            self._feed = None
        for sock in self._sockets.values():
            sock.close()
        self._sockets.clear()
        if self._table is not None:
            self._table.close()
            self._table = None
        if self._stamps is not None:
            self._stamps.close()
            self._stamps = None
        if self._pending is not None:
            self._pending.close()
            self._pending = None

    # --- workers -----------------------------------------------------------------------------
    async def _grow(self, count: int) -> None:
        """Fill slots 0..count-1 that have no worker, and wait until each listens."""
        new = []
        for index in range(count):
            if index not in self._slots:
                slot = self._slots[index] = _Slot(index)
                await self._spawn(slot)
                slot.task = asyncio.get_running_loop().create_task(self._supervise(slot),
                                                                   name=f"dataplane-worker-{index}")
                new.append(slot)
        await self._wait_listening(new)

    async def _wait_listening(self, slots: list[_Slot]) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        for slot in slots:
            while not slot.listening.is_set():
                if slot.proc is None or slot.proc.returncode is not None:
                    raise OrchError(f"data-plane worker {slot.index} exited at start ({slot.last_exit}): "
                                    f"{self._log_tail(slot.index)}")
                if time.monotonic() > deadline:
                    raise OrchError(f"data-plane worker {slot.index} did not listen within {START_TIMEOUT_S:.0f}s: "
                                    f"{self._log_tail(slot.index)}")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(slot.listening.wait(), 0.1)

    async def _spawn(self, slot: _Slot) -> None:
        assert self._table is not None
        self._table.clear_worker(slot.index)
        if self._pending is not None:
            self._pending.clear_worker(slot.index)
        self._table.use_rows(slot.index + 1)  # before it can count a request in its row
        slot.listening.clear()
        fds = {name: sock.fileno() for name, sock in self._sockets.items()}
        argv = [sys.executable, "-m", "orchestrator.dataplane.worker", "--state-dir", str(self._state_dir),
                "--slot", str(slot.index), "--settings", str(self._settings_file)]
        if "listen" in fds:
            argv += ["--listen-fd", str(fds["listen"])]
        if "metrics_listen" in fds:
            argv += ["--metrics-fd", str(fds["metrics_listen"])]
        env = dict(os.environ)
        env.update({ENV_STATE_DIR: str(self._state_dir), ENV_ROLE: "dataplane",
                    "PROMETHEUS_MULTIPROC_DIR": str(self._prom_dir),
                    # libuv: accept one connection per wake-up, so workers share a burst
                    "UV_TCP_SINGLE_ACCEPT": "1",
                    "PYTHONPATH": os.pathsep.join(filter(None, [_package_root(), env.get("PYTHONPATH", "")]))})
        log_path = self._dir / f"worker-{slot.index}.log"
        with open(log_path, "ab") as log:
            # Its own session: a signal to the daemon's process group (Ctrl-C, systemd's
            # systemctl stop's SIGTERM) is not the worker's; the daemon stops it explicitly.
            slot.proc = await asyncio.create_subprocess_exec(
                *argv, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=asyncio.subprocess.STDOUT,
                pass_fds=tuple(fds.values()), start_new_session=True)
        slot.started = time.monotonic()
        self._on_change()

    async def _supervise(self, slot: _Slot) -> None:
        while True:
            proc = slot.proc
            assert proc is not None
            rc = await proc.wait()
            slot.last_exit = _describe_exit(rc)
            self._forget_process(slot, proc.pid)
            if self._stopping or not slot.wanted:
                return
            lived = time.monotonic() - slot.started
            slot.fast_failures = slot.fast_failures + 1 if lived < STABLE_S else 0
            delay = 0.0 if slot.fast_failures <= 1 else min(BACKOFF_MAX_S, 0.1 * 2 ** slot.fast_failures)
            self._log.warning("data-plane worker %d pid=%d %s after %.1fs; replacing it%s", slot.index, proc.pid,
                              slot.last_exit, lived, f" in {delay:.1f}s" if delay else "")
            if delay:
                await asyncio.sleep(delay)
            if self._stopping or not slot.wanted:
                return
            slot.restarts += 1
            await self._spawn(slot)

    def _forget_process(self, slot: _Slot, pid: int) -> None:
        if self._table is not None:
            self._table.clear_worker(slot.index)
        if self._pending is not None:
            self._pending.clear_worker(slot.index)
        with contextlib.suppress(Exception):
            from prometheus_client import multiprocess
            multiprocess.mark_process_dead(pid, str(self._prom_dir))
        slot.stats = {}
        self._on_change()

    async def _retire(self, slots: list[_Slot], grace_s: float) -> None:
        """Drain workers: stop accepting, finish in flight up to the grace, then exit (or SIGKILL)."""
        for slot in slots:
            slot.wanted = False
            if slot.proc is not None and slot.proc.returncode is None:
                sent = self._feed is not None and self._feed.send(slot.index, {"t": "drain", "grace_s": grace_s})
                if not sent:
                    with contextlib.suppress(ProcessLookupError):
                        slot.proc.send_signal(signal.SIGTERM)
        procs = [s.proc for s in slots if s.proc is not None and s.proc.returncode is None]
        if procs:
            _, pending = await asyncio.wait([asyncio.ensure_future(p.wait()) for p in procs],
                                            timeout=grace_s + 3.0)
            for proc in procs:
                if proc.returncode is None:
                    self._log.warning("data-plane worker pid=%d did not drain in time: SIGKILL", proc.pid)
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
            await asyncio.gather(*(p.wait() for p in procs), return_exceptions=True)
        for slot in slots:
            await cancel_and_wait(slot.task)
            self._slots.pop(slot.index, None)

    # --- reload ------------------------------------------------------------------------------
    def apply_settings(self, settings: Settings) -> None:
        old, self._settings = self._settings, settings
        self._write_settings()
        if settings.lb_policy != old.lb_policy and self._stamps is not None:
            # Counts noted before the switch (the old policy's, or an older noting one's) are
            # not the counts of choices to come: `_routed` reads none until a choice notes again.
            self._stamps.clear_counts()
        if self._feed is not None:
            self._feed.broadcast({"t": "settings", "settings": settings_to_json(settings)})
        want = settings.worker_count()
        if want != old.worker_count() or want != len(self._slots):
            if self._resize_task is not None and not self._resize_task.done():
                self._resize_task.cancel()
            self._resize_task = asyncio.get_running_loop().create_task(self._resize(want), name="dataplane-resize")

    async def _resize(self, want: int) -> None:
        # New workers first (they listen on the same sockets), then the extra ones drain:
        # at no moment does the endpoint have fewer accepting workers than the smaller count.
        try:
            await self._grow(want)
        except OrchError as exc:
            self._log.error("data plane resize to %d failed: %s", want, exc)
            return
        extra = [slot for index, slot in sorted(self._slots.items()) if index >= want]
        if extra:
            await self._retire(extra, self._settings.stop_grace_s)
        self._log.info("data plane: %d worker(s)", len(self._slots))
        self._on_change()

    def _write_settings(self) -> None:
        tmp = self._settings_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(settings_to_json(self._settings)))
        os.replace(tmp, self._settings_file)

    # --- the feed ------------------------------------------------------------------------------
    def abort_instance(self, host: str, port: int, reason: str, answering: bool) -> None:
        """An instance stopped answering: every worker fails its requests in flight there
        (EmbeddedProxy.abort_instance)."""
        if self._feed is not None:
            self._feed.broadcast({"t": "abort", "host": host, "port": port, "reason": reason,
                                  "answering": answering})

    def _on_connect(self, slot_index: int, hello: dict[str, Any]) -> list[dict[str, Any]]:
        slot = self._slots.get(slot_index)
        if slot is not None:
            slot.version = str(hello.get("version", ""))
        out: list[dict[str, Any]] = [{"t": "settings", "settings": settings_to_json(self._settings)}]
        if not self._sockets:
            out.append({"t": "send_sockets", "path": str(handover_path(self._state_dir))})
        if not self._adopting:
            out.append(_members(self._backends.current()))
        for b in self._backends.current():
            snap = b.engine.latest if b.engine is not None else None
            if snap is not None:
                published = self._published.get(b.instance_id)
                out.append(published[1] if published is not None and published[0] is snap else
                           {"t": "engine", "iid": b.instance_id, "snap": snap.as_dict()})  # one before it joined
        return out

    def _on_message(self, slot_index: int, msg: dict[str, Any]) -> None:
        kind = msg.get("t")
        if kind == "health":
            backend = next((b for b in self._backends.current() if b.instance_id == msg.get("iid")), None)
            if backend is not None:  # gone already: its restart made the report moot
                if msg.get("ok"):
                    backend.report_success()
                else:
                    backend.report_failure(str(msg.get("reason", "")))
        elif kind == "stats":
            slot = self._slots.get(slot_index)
            if slot is not None:
                slot.stats = msg
            served = set(msg.get("served") or ())
            for backend in self._backends.current():
                if backend.instance_id in served:
                    backend.report_success()  # traffic: the canary need not run early
        elif kind == "listening":
            slot = self._slots.get(slot_index)
            if slot is not None:
                slot.listening.set()

    def _on_members(self, backends: tuple[Backend, ...]) -> None:
        if self._feed is None:
            return
        if self._adopting and not backends:
            return  # adopted workers keep what they route to until an instance is ready here
        self._adopting = False
        self._feed.broadcast(_members(backends))
        self._hook_views(backends)

    def _hook_views(self, backends: tuple[Backend, ...]) -> None:
        """Publish each ready instance's engine snapshots as they come (once per view)."""
        for b in backends:
            view = b.engine
            if view is None or b.instance_id in self._hooked and self._hooked[b.instance_id][0] is view:
                continue
            listener = self._engine_listener(b.instance_id)
            view.listeners.append(listener)
            self._hooked[b.instance_id] = (view, listener)

    def _engine_listener(self, iid: str) -> Callable[[EngineSnapshot], None]:
        evictions = KvWrites()  # a new view: a new instance, nothing known of it

        def publish(snap: EngineSnapshot) -> None:
            evictions.observe(snap)
            msg = {"t": "engine", "iid": iid, "snap": snap.as_dict(), "gone_before": evictions.gone_before}
            self._published[iid] = (snap, msg)
            if self._feed is not None and any(b.instance_id == iid for b in self._backends.current()):
                msg["routed"] = self._routed(iid)
                self._feed.broadcast(msg)
        return publish

    def _routed(self, iid: str) -> int | None:
        """Every worker's requests in flight at the instance as the latest choice over it read
        them (at least as many as now), as its snapshot is published (EngineSnapshot.routed):
        what one worker's own notes say where it makes every choice. None where the table has no
        column for it."""
        if self._table is None:
            return None
        try:
            now = self._table.inflight(instance_index(iid))
        except (ValueError, TableError):
            return None
        if self._stamps is None or not notes_counts(self._settings.lb_policy):
            return now  # the row is as the last noting choice left it, maybe before a reload
        return self._stamps.routed(iid, now)

    # --- what the daemon asks ------------------------------------------------------------------
    @property
    def prom_dir(self) -> Path:
        """Where the workers write their metrics (prometheus_client's multiprocess files)."""
        return self._prom_dir

    def state_record(self) -> dict[str, Any]:
        """What the next daemon needs to adopt these workers (live restore)."""
        s = self._settings
        workers = []
        for slot in self._slots.values():
            proc = slot.proc
            if proc is not None and proc.returncode is None:
                created = getattr(proc, "create_time", None)
                if created is None:
                    with contextlib.suppress(Exception):
                        import psutil
                        created = psutil.Process(proc.pid).create_time()
                if created is not None:
                    workers.append({"slot": slot.index, "pid": proc.pid, "create_time": created,
                                    "version": slot.version})
        return {"listen": s.public_addresses(), "workers": workers, "workers_kind": self.kind}

    def pids(self) -> list[int]:
        return [s.proc.pid for s in self._slots.values() if s.proc is not None and s.proc.returncode is None]

    def inflight(self) -> dict[str, int]:
        table = self._table
        if table is None:
            return {}
        return {b.instance_id: table.inflight(instance_index(b.instance_id)) for b in self._backends.current()}

    def held_now(self) -> int:
        table = self._table
        return sum(table.held(i) for i in self._slots) if table is not None else 0

    def llm_summary(self) -> dict[str, dict[str, Any]]:
        """Every worker's last minute per instance, added up: rates and counts add; the TTFT
        percentiles are those of the workers' merged bucket counts (recent.log_histogram),
        or one worker's own exact ones when only it served the instance."""
        rows: dict[str, list[dict[str, Any]]] = {}
        for slot in self._slots.values():
            for iid, row in (slot.stats.get("llm") or {}).items():
                rows.setdefault(iid, []).append(row)
        return {iid: merge_llm_rows(r) for iid, r in rows.items()}

    def status(self) -> dict[str, Any]:
        table = self._table
        now = time.monotonic()
        workers = []
        for index, slot in sorted(self._slots.items()):
            alive = slot.proc is not None and slot.proc.returncode is None
            workers.append({
                "slot": index, "pid": slot.proc.pid if alive and slot.proc else None,
                "alive": alive, "version": slot.version, "restarts": slot.restarts,
                "uptime_s": round(now - slot.started, 1) if alive else 0.0,
                "connections": int(slot.stats.get("connections", 0)) if alive else 0,
                "inflight": table.worker_inflight(index) if table is not None else 0,
                "held": table.held(index) if table is not None else 0,
                "requests": table.requests(index) if table is not None else 0,
                # of those, answered by the compiled front (None without one)
                "front_served": slot.stats.get("front_served") if alive else None,
                # the compiled front asked (auto), and the worker's stats say it runs none (the module
                # not built: aiohttp serves every request at a fraction of the rate, with one warning
                # in the worker's log); unknown until its first stats
                "front_missing": alive and self._settings.front != "aiohttp" and "front_served" in slot.stats
                and slot.stats["front_served"] is None,
                "last_exit": slot.last_exit,
            })
        serving = sum(1 for w in workers if w["alive"])
        return {"kind": self.kind, "state": "running" if serving == len(workers) and workers else "degraded",
                "workers_wanted": self._settings.worker_count(), "workers_alive": serving,
                "requests": sum(w["requests"] for w in workers),
                "inflight": sum(w["inflight"] for w in workers),
                "connections": sum(w["connections"] for w in workers),
                "workers": workers, "last_failure": next((w["last_exit"] for w in workers if w["last_exit"]), "")}

    def _log_tail(self, index: int, n: int = 5) -> str:
        try:
            lines = (self._dir / f"worker-{index}.log").read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(lines[-n:]) or "(empty log)"


def _members(backends: tuple[Backend, ...]) -> dict[str, Any]:
    return {"t": "members", "backends": [{"id": b.instance_id, "host": b.host, "http": b.http_port,
                                          "grpc": b.grpc_port, "metrics": b.metrics_port} for b in backends]}


def _describe_exit(rc: int) -> str:
    if rc == UNKNOWN_EXIT:
        return "exited (adopted: its status went to init)"
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exited {rc}"


def _package_root() -> str:
    """Where `orchestrator` is imported from: a worker started by an installed daemon or a
    source checkout imports the same code (an upgrade starts new workers from new code)."""
    return str(Path(__file__).resolve().parents[2])


def merge_llm_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One instance's last minute from several workers' `RecentLLM.summary` rows: rates and
    counts add; a percentile is one worker's exact one when only it has any, else read from
    the workers' merged bucket counts (recent.log_histogram)."""
    m: dict[str, Any] = {"tokens_per_s": round(sum(r.get("tokens_per_s") or 0.0 for r in rows), 1),
                         "generations": sum(r.get("generations") or 0 for r in rows),
                         "window_s": max((r.get("window_s") or 0.0 for r in rows), default=0.0)}
    m["ttft_p50_ms"] = _merged_percentile(rows, "ttft_p50_ms", "ttft_hist", 0.50, 1000.0)
    m["ttft_p99_ms"] = _merged_percentile(rows, "ttft_p99_ms", "ttft_hist", 0.99, 1000.0)
    routes: Counter[str] = Counter()  # cost-model's routing reasons
    for r in rows:
        routes.update(r.get("routes") or {})
    if routes:
        m["routes"] = dict(routes)
    err = _merged_percentile(rows, "ttft_est_err", "est_err_hist", 0.50, 1.0, digits=3)
    if err is not None:
        m["ttft_est_err"] = err
    return m


def _merged_percentile(rows: list[dict[str, Any]], field: str, hist: str, q: float, scale: float,
                       digits: int = 1) -> float | None:
    """The q-quantile of a value each worker summarised as `field` (its own q-quantile) and as
    `hist` counts: one worker's `field` when only it has one, else read from the merged counts.
    A worker of an older release (adopted) sends no counts: then the generation-weighted mean
    of the workers' `field` stands in, as it did before."""
    having = [r for r in rows if r.get(field) is not None]
    if len(having) <= 1:
        return having[0][field] if having else None
    if all(r.get(hist) for r in having):
        counts: Counter[str] = Counter()
        for r in having:
            counts.update(r[hist])
        return round(histogram_percentile(counts, q) * scale, digits)
    w = [max(1, r.get("generations") or 0) for r in having]
    return round(sum(wi * r[field] for wi, r in zip(w, having)) / sum(w), digits)
