"""A data-plane worker: one process of the public endpoint.

    python -m orchestrator.dataplane.worker --state-dir DIR --slot K --settings FILE
        [--listen-fd N] [--metrics-fd N]

Started by the daemon's worker pool (controlplane/workers.py), never by hand. It
runs the same proxies the daemon used to run in its own process (HTTP with the
OpenAI API, gRPC, the data plane's /metrics) on listening sockets it inherits:
one socket per public address, shared by every worker, so a worker that dies or
is replaced never closes the port (the kernel's accept queue outlives any one
worker). Each worker takes its share of the connections waiting there
(accept_share.py: the first one awake would take a whole burst). gRPC is the
exception: grpcio binds its own socket, so each worker binds the gRPC port with
SO_REUSEPORT.

What it owns: its client connections, its upstream connection pool, its row of
the shared table (in flight per instance, connections, whether it accepts, held,
requests, a heartbeat), its Prometheus files. What it does not: membership (the daemon
publishes it over the feed), restarts of anything, other workers.

It lives in its own session, so the daemon can die, restart or be upgraded while
it goes on serving the last membership it had (live restore); it reconnects to
whichever daemon comes next. SIGTERM or a `drain` message: stop accepting, finish
what is in flight up to the grace, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from orchestrator import release
from orchestrator.config import Settings, settings_from_json
from orchestrator.dataplane import descriptors, metric_values, shared_cells
from orchestrator.dataplane.accept_share import AcceptShare
from orchestrator.dataplane.away_probe import AwayProber
from orchestrator.dataplane.feed import FeedClient
from orchestrator.dataplane.membership import WorkerMembership
from orchestrator.dataplane.metric_values import TurnBatched
from orchestrator.dataplane.shared_prefix import SharedPrefixIndex
from orchestrator.dataplane.shared_pending import SharedPending
from orchestrator.dataplane.shared_stamps import SharedStamps
from orchestrator.dataplane.shared_table import GlobalInflight, SharedTable, TableError, WorkerCounts
from orchestrator.routing.backends import ReadyBackends
from orchestrator.routing.balancer import SharedRouting
from orchestrator.routing.journal import Journal
from orchestrator.routing.llm_policies import SharedTurns
from orchestrator.tasks import cancel_and_wait

HEARTBEAT_S = 0.25
STATS_S = 1.0
FIRST_MEMBERS_WAIT_S = 2.0


def dataplane_dir(state_dir: Path) -> Path:
    return state_dir / "dataplane"


def feed_path(state_dir: Path) -> Path:
    return dataplane_dir(state_dir) / "feed.sock"


def table_path(state_dir: Path) -> Path:
    return dataplane_dir(state_dir) / "table"


def prefix_path(state_dir: Path) -> Path:
    return dataplane_dir(state_dir) / "prefixes"


def pending_path(state_dir: Path) -> Path:
    return dataplane_dir(state_dir) / "pending"


def routed_paths(state_dir: Path) -> tuple[Path, Path]:
    """The workers' cumulative prompt blocks and requests routed to each instance (cost-model's
    write logs, routing/journal.py's WriteLog): shared_pending.py's layout, never cleared while
    the data plane lives (a replaced worker adds on to its row)."""
    return dataplane_dir(state_dir) / "routed-blocks", dataplane_dir(state_dir) / "routed-requests"


def turns_path(state_dir: Path) -> Path:
    """When any worker last chose each instance (routing/llm_policies.py's SharedTurns: the
    default's turns among equally loaded instances): shared_stamps.py, never cleared while the
    data plane lives."""
    return dataplane_dir(state_dir) / "turns"


def serves_openai_only(s: Settings) -> bool:
    """Whether a worker with these settings serves /v1/ alone: the side workers of `--proxy none`
    (controlplane/side_workers.py), to which a system NGINX sends nothing else."""
    return s.proxy == "none"


def handover_path(state_dir: Path) -> Path:
    """Where a new daemon takes the listening sockets from a worker (SCM_RIGHTS)."""
    return dataplane_dir(state_dir) / "handover.sock"


class Worker:
    def __init__(self, state_dir: Path, slot: int, settings: Settings,
                 sockets: dict[str, socket.socket], log: logging.Logger,
                 batched_values: TurnBatched | None = None) -> None:
        self.state_dir = state_dir
        self._metric_values = batched_values  # where set: this worker's metrics, written once per loop turn
        self.slot = slot
        self.settings = settings
        self._sockets = sockets
        self._log = log
        self._stop = asyncio.Event()
        self._grace_s = 5.0
        self._got_members = asyncio.Event()
        self.started = time.time()
        self._away_task: asyncio.Task[None] | None = None  # the away prober, while no daemon is there
        self.pending: SharedPending | None = None  # the workers' pending prefill (shared_pending.py)
        self.routed: tuple[SharedPending, SharedPending] | None = None  # routed blocks, requests
        self.turns: SharedStamps | None = None  # the workers' turns among ties, counts read (turns_path)

    async def run(self) -> int:
        from orchestrator.dataplane.metrics import ProxyMetrics  # after PROMETHEUS_MULTIPROC_DIR is read
        loop = asyncio.get_running_loop()
        if self._metric_values is not None:
            self._metric_values.bind(loop)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        table = SharedTable.open(table_path(self.state_dir))
        table.clear_worker(self.slot)
        table.set_pid(self.slot, os.getpid())
        self.table = table
        self.prefixes = SharedPrefixIndex.open(prefix_path(self.state_dir))
        self.pending = self._open_pending(table)
        self.routed = self._open_routed()
        self.turns = self._open_turns()
        backends = ReadyBackends()
        self.feed = FeedClient(feed_path(self.state_dir), self._hello, self._on_message,
                               self._on_connection, self._log)
        self.membership = WorkerMembership(backends, table, self.feed.send, self.settings.outlier_failures)
        metrics = ProxyMetrics()
        metrics.extra_collectors.append(WorkerCollector(table))
        if self._metric_values is not None:
            metrics.write_through = self._metric_values.flush
        self.metrics = metrics
        self.proxies = self._make_proxies(backends, metrics, table)
        # Owned here, cancelled below.
        tasks = [loop.create_task(self.feed.run(), name="feed"),
                 loop.create_task(self._heartbeat(), name="heartbeat")]
        try:
            with contextlib.suppress(asyncio.TimeoutError):  # no daemon yet: serve what comes
                await asyncio.wait_for(self._got_members.wait(), FIRST_MEMBERS_WAIT_S)
            for proxy in self.proxies:
                await proxy.start()
            self.feed.send({"t": "listening"})
            # What start-up made lives as long as the worker: out of the collector's sight, so
            # the collections that requests' short-lived cycles trigger do not walk it again.
            gc.freeze()
            self._log.info("data-plane worker %d pid=%d serving (%s; prefix index slots in %s, shared counts in %s)",
                           self.slot, os.getpid(), ", ".join(type(p).__name__ for p in self.proxies),
                           "C" if self.prefixes.compiled else "Python",
                           "C" if shared_cells.NATIVE is not None else "Python")
            await self._stop.wait()
            self._log.info("data-plane worker %d draining (grace %.1fs)", self.slot, self._grace_s)
            for proxy in self.proxies:
                with contextlib.suppress(Exception):
                    await proxy.stop(self._grace_s)
        finally:
            if self._away_task is not None:
                tasks.append(self._away_task)
            await cancel_and_wait(*tasks)
            table.clear_worker(self.slot)
            if self.pending is not None:
                self.pending.clear_worker(self.slot)
            if self._metric_values is not None:
                self._metric_values.flush()  # the last turn's counts, before the process ends
        return 0

    def _open_pending(self, table: SharedTable) -> SharedPending | None:
        """The workers' pending-prefill file, this worker's row cleared; None where the daemon
        that made this data plane had none (an older one, adopted by live restore): the
        cost-model's ledgers stay this worker's own, as they were then."""
        try:
            pending = SharedPending.open(pending_path(self.state_dir))
        except TableError as exc:
            self._log.warning("data-plane worker %d: %s: pending prefill not shared", self.slot, exc)
            return None
        pending.clear_worker(self.slot)
        return pending

    def _open_routed(self) -> tuple[SharedPending, SharedPending] | None:
        """The workers' routed blocks and requests; None where the data plane has none (an older
        daemon's, adopted): the write logs stay this worker's own."""
        opened: list[SharedPending] = []
        try:
            for path in routed_paths(self.state_dir):
                opened.append(SharedPending.open(path))
        except TableError as exc:
            for f in opened:  # the one that did open is of no use alone
                f.close()
            self._log.warning("data-plane worker %d: %s: routed blocks not shared", self.slot, exc)
            return None
        return opened[0], opened[1]

    def _open_turns(self) -> SharedStamps | None:
        """The workers' turns among ties; None where the data plane has none (an older daemon's,
        adopted): this worker takes ties in its own turns."""
        try:
            return SharedStamps.open(turns_path(self.state_dir))
        except TableError as exc:
            self._log.warning("data-plane worker %d: %s: turns not shared", self.slot, exc)
            return None

    def _make_proxies(self, backends: ReadyBackends, metrics: Any, table: SharedTable) -> list[Any]:
        from orchestrator.dataplane.embedded import EmbeddedProxy
        slot = self.slot
        s = self.settings
        # Every worker routes on the same numbers: all workers' in-flight counts, one prefix
        # index and the prefill pending at each instance (HTTP and gRPC alike, so a prefix sent
        # by either lands together; one journal for both).
        lane = self.pending.lane(slot, table.rows) if self.pending is not None else None
        routed = None
        if self.routed is not None:
            routed = (self.routed[0].lane(slot, table.rows), self.routed[1].lane(slot, table.rows))
        turns = SharedTurns(self.turns) if self.turns is not None else None
        shared = SharedRouting(GlobalInflight(table), WorkerCounts(table, slot), self.prefixes, Journal(lane, routed),
                               turns)
        # The side workers of --proxy none serve a system NGINX /v1/ alone (controlplane/side_workers.py).
        proxies: list[Any] = [EmbeddedProxy(s, backends, self._log, metrics, openai_only=serves_openai_only(s),
                                            shared=shared, sockets=self._sockets,
                                            tally=lambda n=1: table.add_requests(slot, n),
                                            accept_share=AcceptShare(table, slot))]
        if s.grpc_listen:
            from orchestrator.dataplane.grpc_proxy import GrpcProxy
            proxies.append(GrpcProxy(s, backends, self._log, metrics, shared=shared, reuseport=True))
        return proxies

    # --- the feed ------------------------------------------------------------------------
    def _hello(self) -> dict[str, Any]:
        return {"t": "hello", "slot": self.slot, "pid": os.getpid(), "version": release(),
                "started": self.started}

    def _on_message(self, msg: dict[str, Any]) -> None:
        kind = msg.get("t")
        if kind == "members":
            self.membership.on_members(msg["backends"])
            self._got_members.set()
        elif kind == "engine":
            self.membership.on_engine(str(msg["iid"]), msg["snap"], msg.get("routed"), msg.get("gone_before"))
        elif kind == "settings":
            self._apply(settings_from_json(msg["settings"]))
        elif kind == "send_sockets":
            self._send_sockets(str(msg["path"]))
        elif kind == "abort":  # an instance stopped answering: what waits on it goes elsewhere
            self._abort(str(msg["host"]), int(msg["port"]), str(msg.get("reason", "")), bool(msg.get("answering")))
        elif kind == "drain":
            self._grace_s = float(msg.get("grace_s", self._grace_s))
            self._stop.set()

    def _send_sockets(self, path: str) -> None:
        """Hand a new daemon (live restore) the listening sockets this worker serves on.
        Blocking, on the serving loop: one local connect and one message, microseconds."""
        names = [name for name in ("listen", "metrics_listen") if name in self._sockets]
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(1.0)
                conn.connect(path)
                socket.send_fds(conn, [json.dumps({"slot": self.slot, "names": names}).encode()],
                                [self._sockets[name].fileno() for name in names])
        except OSError as exc:
            self._log.warning("data-plane worker %d: socket handover to %s failed: %s", self.slot, path, exc)

    def _abort(self, host: str, port: int, reason: str, answering: bool) -> None:
        for proxy in self.proxies:
            abort = getattr(proxy, "abort_instance", None)
            if abort is not None:
                abort(host, port, reason, answering)

    def _on_connection(self, up: bool) -> None:
        self.membership.set_connected(up)
        if self._away_task is not None:
            self._away_task.cancel()  # a daemon is back (or this is a second "gone"): it decides
            self._away_task = None
        if not up:
            self._log.warning("data-plane worker %d: the daemon is gone; serving the last membership "
                              "(%d instance(s)) with passive health and its own probes", self.slot,
                              len(self.membership.backends.current()))
            prober = AwayProber(self.membership, self.table,
                                lambda host, port, reason: self._abort(host, port, reason, True), self._log)
            self._away_task = asyncio.get_running_loop().create_task(prober.run(self.settings), name="away-probe")
        self.membership.refresh()

    def _apply(self, settings: Settings) -> None:
        self.settings = settings
        self.membership.threshold = settings.outlier_failures
        for proxy in self.proxies:
            proxy.apply_settings(settings)

    async def _heartbeat(self) -> None:
        last_stats = 0.0
        while True:
            now = time.monotonic()
            self.table.beat(self.slot, now)
            self.table.set_held(self.slot, self.metrics.held_now())
            if not self.membership.daemon_connected:
                self.membership.refresh()  # ejections of other workers, and their expiry
            if now - last_stats >= STATS_S:
                last_stats = now
                self.feed.send({"t": "stats", "llm": self.metrics.recent.summary(now, histogram=True),
                                "connections": self._connections(), "served": self.membership.take_served(),
                                "front_served": self._front_served()})
            await asyncio.sleep(HEARTBEAT_S)

    def _connections(self) -> int:
        http = self.proxies[0]
        front = getattr(http, "_front", None)
        return sum(getattr(server, "open_connections", 0) for server in getattr(http, "_servers", ())) + \
            (front.open_connections if front is not None else 0)

    def _front_served(self) -> int | None:
        """Requests the compiled front answered since this worker started (None: no front)."""
        front = getattr(self.proxies[0], "_front", None)
        return front.served if front is not None else None


class WorkerCollector:
    """The workers' rows of the shared table, per worker: any worker's scrape shows all."""

    def __init__(self, table: SharedTable) -> None:
        self._table = table

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        from orchestrator.dataplane.shared_table import ALIVE_S, MAX_WORKERS, alive
        t = self._table
        now = time.monotonic()
        live = GaugeMetricFamily("trtllm_orch_dataplane_workers",
                                 f"Data-plane workers alive (heartbeat < {ALIVE_S:g} s)")
        inflight = GaugeMetricFamily("trtllm_orch_dataplane_worker_inflight_requests",
                                     "Requests in flight per data-plane worker", labels=("worker",))
        held = GaugeMetricFamily("trtllm_orch_dataplane_worker_held_requests",
                                 "Requests held (no instance ready) per data-plane worker", labels=("worker",))
        requests = CounterMetricFamily("trtllm_orch_dataplane_worker_requests",
                                       "Requests answered per data-plane worker (since its slot was last "
                                       "filled)", labels=("worker",))
        n = 0
        for w in range(MAX_WORKERS):
            if not alive(t, w, now):
                continue
            n += 1
            label = (str(w),)
            inflight.add_metric(label, t.worker_inflight(w))
            held.add_metric(label, t.held(w))
            requests.add_metric(label, t.requests(w))
        live.add_metric((), n)
        return [live, inflight, held, requests]


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="trtllm-orch-worker", description=__doc__.split("\n\n")[0])
    p.add_argument("--state-dir", required=True, type=Path)
    p.add_argument("--slot", required=True, type=int)
    p.add_argument("--settings", required=True, type=Path)
    p.add_argument("--listen-fd", type=int, default=-1)
    p.add_argument("--metrics-fd", type=int, default=-1)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s worker{args.slot} %(levelname)s %(message)s")
    log = logging.getLogger("trtllm-orch.worker")
    settings = settings_from_json(json.loads(args.settings.read_text()))
    logging.getLogger().setLevel(settings.log_level.upper())
    # Before any thread starts: grown later, under a burst, each doubling stalls the worker.
    descriptors.reserve_for(settings.max_client_connections)
    sockets = {}
    for name, fd in (("listen", args.listen_fd), ("metrics_listen", args.metrics_fd)):
        if fd >= 0:
            sock = socket.socket(fileno=fd)
            sock.setblocking(False)
            sockets[name] = sock
    from orchestrator.dataplane.embedded import install_uvloop_if_available
    install_uvloop_if_available()
    worker = Worker(args.state_dir, args.slot, settings, sockets, log, _batched_metric_values())
    return asyncio.run(worker.run())


def _batched_metric_values() -> TurnBatched | None:
    """Where the worker's metrics are multiprocess files (always, under the daemon), their values
    are written once per loop turn (metric_values.py says why). Before any metric exists: each
    value takes the class when it is made."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return None
    return metric_values.install(os.getpid())

if __name__ == "__main__":
    sys.exit(main())
