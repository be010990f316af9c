"""`--proxy nginx`: a private nginx master in front of the instances.

The daemon owns one NginxProxy; it owns the nginx master (nginx_master.py: its own
prefix under the state directory, its own process group, foreground so it stays our
child, watched and restarted if it dies) and a /metrics listener.

The config lists every planned instance and changes only when the daemon's config
does (`apply_settings`): then it is re-rendered from configs/nginx.conf.j2, validated
with `nginx -t`, swapped in atomically and applied with SIGHUP. Instances coming and
going never reload nginx: a reload makes the old workers close their idle keep-alive
client connections, and a request a client had just written on one was lost (the
failover bench counted 17 over 3 kills). Instead an instance that is down refuses
connections and nginx retries the request on another (configs/nginx.conf.j2 says how
dead, draining and hung instances are handled), and the ready set reaches nginx as a
small file (health/ready.json) that answers /v2/health/ready.

The master lives apart from the daemon (live restore): a daemon killed, restarted by its
watchdog or upgraded leaves it serving the native HTTP and gRPC routes on the last ready
set, and the next `up` adopts it (`state_record`, controlplane/adoption.py) instead of
stopping it: no connection refused or cut. Nginx reloads then only if the config the new
daemon renders differs. The OpenAI routes, and the native HTTP requests no instance took (NGINX
cannot hold them), go to data-plane side workers (controlplane/side_workers.py), which live
apart from the daemon too: the next daemon adopts them with their loopback socket, so the
config names the same port.

Lifecycle (one owner: the daemon):
    proxy = NginxProxy(settings, ready_backends, state_dir, logger, planned=..., on_change=..., adopt=...)
    await proxy.start()            # raises OrchError / EnvironmentProblem, one line
    proxy.status()                 # {"kind": "nginx", "state": "running", "pid": ..., "restarts": ...}
    await proxy.stop()             # SIGQUIT, SIGKILL the group after the grace
    await proxy.detach()           # or: leave nginx serving for the next daemon
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pwd
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from orchestrator.config import Settings, parse_host_port
from orchestrator.controlplane.side_workers import FLAG, SideWorkers, upstream_address
from orchestrator.errors import EnvironmentProblem, OrchError
from orchestrator.templates import render
from orchestrator.routing.backends import Backend, ReadyBackends
from orchestrator.dataplane.metrics import MetricsServer, NginxMetrics, ProxyMetrics
from orchestrator.nginx.master import RUNNING, NginxMaster, open_listener
from orchestrator.routing.surface import admin_regexes
from orchestrator.tasks import cancel_and_wait

if TYPE_CHECKING:
    from orchestrator.controlplane.adoption import AdoptableNginx, AdoptableWorker

TEMPLATE = "nginx.conf.j2"
CONF_NAME = "nginx.conf"
RETRY_AFTER_S = 5
# Passive check: an instance that failed (refused, reset, 503) is skipped this long, then
# one request tries it again. Short, because every planned instance stays listed: an
# instance back from a restart waits at most this long for traffic, and a dead one costs
# one refused loopback connect (retried at once) per period.
FAIL_TIMEOUT_S = 2
UPSTREAM_KEEPALIVE = 32  # idle upstream connections kept per worker
# Idle pooled upstream connections close after this: a SIGTERMed Triton waits for every
# open HTTP connection before it exits (measured: the whole 30 s exit timeout with
# nginx's default 60 s), which would stretch every rolling restart to --stop-grace-s.
UPSTREAM_KEEPALIVE_TIMEOUT_S = 1
READY_NAME = "ready.json"

_log = logging.getLogger(__name__)


def _addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _ms(seconds: float) -> int:
    return max(1, int(round(seconds * 1000)))


def render_nginx_config(settings: Settings, backends: tuple[Backend, ...], prefix_dir: Path | None,
                        *, listen_port: int | None = None, grpc_port: int | None = None,
                        worker_user: str | None = None, openai_upstream: str | None = None,
                        backup: str = "") -> str:
    """The nginx config listing `backends` (the daemon passes every planned instance).

    prefix_dir set: a complete nginx.conf for our own master (pid, error_log and temp
    paths inside prefix_dir). prefix_dir None: an http-context snippet (upstreams, geo,
    map and the two server blocks) for a system nginx's sites-available; it sets no
    pid, log or temp paths and no http-level directives. listen_port/grpc_port replace
    the ports of --listen/--grpc-listen (used when those ask for port 0). openai_upstream:
    the side workers' listener that /v1/ goes to (default: --openai-listen, for the
    snippet; none: no /v1/). backup: theirs too, the HTTP upstream's backup server (the hold).
    """
    host, port = parse_host_port(settings.listen, "--listen")
    grpc_listen = ""
    if settings.grpc_listen:
        ghost, gport = parse_host_port(settings.grpc_listen, "--grpc-listen")
        grpc_listen = _addr(ghost, grpc_port if grpc_port is not None else gport)
    full = prefix_dir is not None
    ready_dir = prefix_dir / "health" if prefix_dir is not None else None
    if openai_upstream is None and settings.openai == "on" and settings.openai_listen:
        openai_upstream = upstream_address(settings.openai_listen, parse_host_port(settings.openai_listen, FLAG)[1])
    return render(
        TEMPLATE,
        full=full,
        prefix=str(prefix_dir) if full else "",
        worker_user=worker_user if full else None,
        worker_processes=settings.worker_count(),  # --proxy-workers: equal to the embedded data plane's
        worker_connections=4096,
        error_log_level="warn",
        listen=_addr(host, listen_port if listen_port is not None else port),
        grpc_listen=grpc_listen,
        http_servers=[_addr(b.host, b.http_port) for b in backends],
        grpc_servers=[_addr(b.host, b.grpc_port) for b in backends],
        trusted_proxies=list(settings.trusted_proxy),
        allow_admin=settings.allow_admin,
        admin=admin_regexes(),
        max_body_bytes=settings.max_body_bytes,
        # nginx caps connect timeouts at 75 s.
        connect_timeout_ms=min(_ms(settings.connect_timeout_s), 75_000),
        idle_timeout_ms=_ms(settings.idle_timeout_s),
        max_attempts=settings.max_attempts,
        fail_timeout_s=FAIL_TIMEOUT_S,
        upstream_keepalive=UPSTREAM_KEEPALIVE,
        upstream_keepalive_timeout_s=UPSTREAM_KEEPALIVE_TIMEOUT_S,
        # Full config only: the daemon's ready set, as a file NginxProxy rewrites.
        ready_dir=str(ready_dir) if ready_dir else "",
        ready_name=READY_NAME,
        ready_file=str(ready_dir / READY_NAME) if ready_dir else "",
        retry_after_s=RETRY_AFTER_S,
        # Per read in nginx (the embedded proxy's body deadline is for the whole body).
        client_header_timeout_ms=_ms(settings.client_header_timeout_s),
        client_body_timeout_ms=_ms(settings.client_body_timeout_s),
        keepalive_timeout_s=75,
        openai_upstream=openai_upstream or "",
        backup=backup,
    )


def _write_ready_file(path: Path, ready: int) -> None:
    """The ready set as nginx reads it: the file exists while an instance is READY.

    Replaced atomically (a reader sees the old file or the new one); no fsync: it lives
    as long as this run and is rewritten on every change. Runs in a worker thread.
    """
    if ready == 0:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(json.dumps({"ready": True, "backends": ready}, separators=(",", ":")))
    os.replace(tmp, path)


class NginxProxy:
    def __init__(self, settings: Settings, backends: ReadyBackends, state_dir: Path,
                 logger: logging.Logger | None = None, *, planned: tuple[Backend, ...],
                 on_change: Callable[[], None] | None = None, adopt: "AdoptableNginx | None" = None,
                 adopt_workers: "list[AdoptableWorker] | None" = None) -> None:
        if not planned:
            raise ValueError("NginxProxy needs the planned instances (its upstreams list them all)")
        self._settings = settings
        self._backends = backends
        self._planned = planned
        self._on_change = on_change  # the daemon's: state.json and systemd learn of a new master
        self._adopt = adopt  # a master a previous daemon left serving, to take over
        self._dir = Path(state_dir) / "nginx"
        self._conf = self._dir / CONF_NAME
        self._ready_file = self._dir / "health" / READY_NAME
        self._log = logger or _log
        self._master: NginxMaster | None = None
        self.metrics = ProxyMetrics()
        self._nginx_metrics = NginxMetrics(self.metrics.registry)
        self._restarts_counted = 0
        self._metrics_server: MetricsServer | None = None
        self._unsubscribe: Callable[[], None] | None = None
        self._reload_task: asyncio.Task[None] | None = None
        self._reload_wanted = False
        self._ready_task: asyncio.Task[None] | None = None
        self._ready_written: int | None = None
        # Adopted: the ready file as the last daemon left it, until this one's ready set is not
        # empty (its probes passed) or the adoption's window is over (`_adopted_ready_hold`).
        self._hold_empty_until = 0.0
        self._hold_timer: asyncio.TimerHandle | None = None
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        host, port = parse_host_port(settings.listen, "--listen")
        self._listen = (host, port)
        self._grpc_listen = parse_host_port(settings.grpc_listen, "--grpc-listen") if settings.grpc_listen else None
        self._port = port
        self._grpc_port = self._grpc_listen[1] if self._grpc_listen else None
        if adopt is not None:  # the ports it serves (those of ':0' were learnt by its daemon)
            self._port = adopt.http_port
            self._grpc_port = adopt.grpc_port if self._grpc_listen else None
        self.reloads = 0  # applied reloads (config changes), for status and tests
        self.last_error = ""
        # NGINX can neither translate the OpenAI API nor hold a request: /v1/, and what no instance
        # took, go to side workers on loopback, started before nginx and stopped after it
        # (in-flight requests pass through both). Adopting: on the port the master's config
        # names, so that it needs no reload.
        self._side = SideWorkers(settings, backends, Path(state_dir), self._log,
                                 port=adopt.side_port if adopt is not None else 0,
                                 adopt=adopt_workers, on_change=on_change)
        self.metrics.add_worker_files(self._side.prom_dir)  # /metrics counts the requests they serve

    # --- public ------------------------------------------------------------------
    @property
    def bound_port(self) -> int:
        return self._port

    @property
    def bound_grpc_port(self) -> int | None:
        return self._grpc_port

    @property
    def metrics_port(self) -> int:
        """Actual port of the metrics listener (0 when off)."""
        return self._metrics_server.port if self._metrics_server is not None else 0

    @property
    def config_path(self) -> Path:
        return self._conf

    def pids(self) -> list[int]:
        pid = self._master.pid if self._master is not None else None
        return ([pid] if pid is not None else []) + self._side.pids()

    def inflight(self) -> dict[str, int]:
        return {}  # nginx does not tell us per instance

    def held_now(self) -> int:
        return self._side.held_now()

    def llm_summary(self) -> dict[str, dict[str, Any]]:
        """The side workers' last minute per instance (NGINX's own relaying is not timed)."""
        return self._side.llm_summary()

    def abort_instance(self, host: str, port: int, reason: str, answering: bool) -> None:
        """The side workers fail their requests in flight there; NGINX's timeouts decide its own."""
        self._side.abort_instance(host, port, reason, answering)

    def status(self) -> dict[str, Any]:
        """For the daemon's `status`: is the endpoint really there?"""
        master = self._master.status() if self._master is not None else {"state": "stopped", "pid": None}
        return {"kind": "nginx", **master,
                "side": self._side.status(),
                "listen": _addr(self._listen[0], self._port),
                # (a gRPC listener has its port: the asked one, then the bound one)
                "grpc_listen": _addr(self._grpc_listen[0], self._grpc_port)  # type: ignore[arg-type]
                if self._grpc_listen else "",
                "metrics_port": self.metrics_port, "config": str(self._conf), "reloads": self.reloads,
                "last_error": self.last_error}

    def state_record(self) -> dict[str, Any]:
        """What the next daemon needs to adopt this master and the side workers (live restore)."""
        record = self._side.state_record()  # the addresses, the side workers and their kind
        master = self._master
        pid = master.pid if master is not None else None
        if pid is None:
            return record
        try:
            created = psutil.Process(pid).create_time()
        except psutil.Error:
            return record
        return {**record,
                "nginx": {"pid": pid, "create_time": created, "prefix": str(self._dir), "http_port": self._port,
                          "grpc_port": self._grpc_port,
                          "side_port": self._side.bound_port}}

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        binary = self._binary()
        self._dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        (self._dir / "temp").mkdir(exist_ok=True, mode=0o700)
        self._ready_file.parent.mkdir(exist_ok=True, mode=0o700)
        adopt = self._adopt
        # The public ports first: one taken fails `up` before any side worker starts.
        listeners: list[socket.socket] = self._open_listeners() if adopt is None else []
        try:
            await self._side.start()  # its port goes into the config
            if adopt is None:
                error = await self._write_checked(self._render())
                if error:
                    raise OrchError(f"--proxy=nginx: rendered config fails `nginx -t`: {error}")
                await self._publish_ready()
        except BaseException:
            for s in listeners:
                s.close()
            await self._side.stop(0)
            raise
        self._master = NginxMaster(
            [binary, "-p", str(self._dir), "-c", str(self._conf), "-e", str(self._dir / "error.log"),
             "-g", "daemon off;"], self._dir, listeners, logger=self._log,
            on_change=self._master_changed, orphan_grace_s=self._settings.stop_grace_s,
            log_limits=lambda: (self._settings.log_max_bytes, self._settings.log_backups),
            reopen=self._open_listeners)
        try:
            if adopt is None:
                await self._master.start()
            else:
                # A previous daemon's master (live restore): its config is rendered again below and
                # applied with a reload only where it changed; the ready file is ours from now on.
                self._master.adopt(adopt.pid, adopt.create_time)
            if self._settings.metrics_listen:
                self._metrics_server = MetricsServer(self.metrics, self._settings.metrics_listen)
                await self._metrics_server.start()
        except BaseException:
            await self._master.stop(0)  # also closes the listening sockets
            await self._side.stop(0)
            raise
        if adopt is not None:
            self._adopted_ready_hold()
        # Subscribe only now; a change that raced with startup is caught by one more write.
        self._unsubscribe = self._backends.subscribe(self._on_ready_set)
        self._on_ready_set(self._backends.current())
        if adopt is not None:
            self._request_reload()  # nothing to do where the config is the same
        self._log.info("nginx %d %s on %s (config %s; metrics %s)", self._master.pid,
                       "adopted, serving" if adopt is not None else "listening", _addr(self._listen[0], self._port),
                       self._conf, f"port {self.metrics_port}" if self._metrics_server else "off")

    def _adopted_ready_hold(self) -> None:
        """The new daemon's ready set is empty until its probes of the adopted instances pass
        (1-3 s); written as it is, NGINX's /v2/health/ready answered 503 meanwhile, and a load
        balancer polling it took the node out (tests/test_e2e_nginx_live_restore.py: 43 503s in
        a restart). The file is held as it is for as long as an adopted instance has to answer
        its probes (docs/live-restore.md), then the ready set is written whatever it is."""
        from orchestrator.controlplane.instance import adopted_ready_s
        window = adopted_ready_s(self._settings)  # the adopted instances' own window, one rule
        assert self._loop is not None
        self._hold_empty_until = time.monotonic() + window
        self._hold_timer = self._loop.call_later(window, lambda: self._on_ready_set(self._backends.current()))

    async def detach(self) -> None:
        """Leave the master serving for the next daemon (an upgrade); stop what is ours."""
        await self._end(lambda master: master.detach(), lambda side: side.detach())

    def apply_settings(self, settings: Settings) -> None:
        """A reload of the daemon's config: nginx reloads only if the rendered config changed.

        The daemon refuses changed listen addresses before this (they need down/up).
        """
        self._settings = settings
        self._side.apply_settings(settings)
        self._request_reload()

    async def wait_synced(self) -> None:
        """Until the ready file and any requested reload are applied (or failed). For tests."""
        for attr in ("_ready_task", "_reload_task"):
            while getattr(self, attr) is not None and not getattr(self, attr).done():
                await asyncio.shield(getattr(self, attr))

    async def stop(self, grace_s: float = 5.0) -> None:
        await self._end(lambda master: master.stop(grace_s), lambda side: side.stop(grace_s))

    async def _end(self, end_master: Callable[[NginxMaster], Awaitable[None]],
                   end_side: Callable[[SideWorkers], Awaitable[None]]) -> None:
        """Stop or detach: our tasks first, then the master's watch (`end_master`), then the
        side workers' (after nginx: the last requests it sent them have drained through them)."""
        self._stopping = True
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None
        for attr in ("_reload_task", "_ready_task"):
            task = getattr(self, attr)
            if task is not None:
                await cancel_and_wait(task)
                setattr(self, attr, None)
        if self._master is not None:
            await end_master(self._master)
        await end_side(self._side)
        if self._metrics_server is not None:
            await self._metrics_server.stop()

    # --- the ready set: a file, never a reload ---------------------------------------
    def _on_ready_set(self, backends: tuple[Backend, ...]) -> None:
        # Called synchronously by ReadyBackends.publish. One writer task at a time; it
        # re-reads the set after each write, so a change during a write is not lost.
        self.metrics.set_ready(backends)
        if self._stopping or self._loop is None:
            return
        if self._ready_task is None or self._ready_task.done():
            self._ready_task = self._loop.create_task(self._publish_ready(), name="nginx-ready-file")

    async def _publish_ready(self) -> None:
        while True:
            count = len(self._backends.current())
            if count == self._ready_written:
                return
            if count:
                self._hold_empty_until = 0.0
            elif time.monotonic() < self._hold_empty_until:
                return
            try:
                await asyncio.to_thread(_write_ready_file, self._ready_file, count)
            except OSError as exc:
                self._ready_written = None  # the next change tries again
                self.last_error = f"cannot write {self._ready_file}: {exc}"
                self._log.error("nginx: %s", self.last_error)
                return
            self._ready_written = count

    # --- config reloads (config changes only) ------------------------------------------
    def _request_reload(self) -> None:
        # Reloads run one at a time; a request during a reload only marks one more,
        # which then renders the latest settings.
        self._reload_wanted = True
        if self._stopping or self._loop is None:
            return
        if self._reload_task is None or self._reload_task.done():
            self._reload_task = self._loop.create_task(self._reload_loop(), name="nginx-reload")

    async def _reload_loop(self) -> None:
        while self._reload_wanted and not self._stopping:
            self._reload_wanted = False
            try:
                await self._reload_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a reload failure must never kill the daemon
                self.last_error = f"nginx reload failed: {exc}"
                self._log.error("%s", self.last_error)

    async def _reload_once(self) -> None:
        text = self._render()
        if self._conf.exists() and text == self._conf.read_text():
            return
        error = await self._write_checked(text)
        if error:
            self.last_error = f"new nginx config rejected, keeping the old one: {error}"
            self._log.error("%s", self.last_error)
            return
        assert self._master is not None
        await self._master.reload()
        self.reloads += 1
        self._log.info("nginx reloaded: config changed")

    # --- the master ------------------------------------------------------------------------
    def _master_changed(self) -> None:
        master = self._master
        assert master is not None
        self._nginx_metrics.up.set(1 if master.state == RUNNING else 0)
        if master.restarts > self._restarts_counted:
            self._nginx_metrics.restarts.inc(master.restarts - self._restarts_counted)
            self._restarts_counted = master.restarts
        if self._on_change is not None:
            self._on_change()

    # --- helpers -----------------------------------------------------------------
    def _open_listeners(self) -> list[socket.socket]:
        """Bind --listen (and --grpc-listen) for nginx to inherit; learns the ports of ':0'.

        Fails fast, naming the flag, when one is taken (nginx itself would retry for 2.5 s).
        """
        http = open_listener(*self._listen, "--listen")
        self._port = http.getsockname()[1]
        if self._grpc_listen is None:
            return [http]
        try:
            grpc = open_listener(*self._grpc_listen, "--grpc-listen")
        except BaseException:
            http.close()
            raise
        self._grpc_port = grpc.getsockname()[1]
        return [http, grpc]

    def _binary(self) -> str:
        value = self._settings.nginx
        if os.sep in value:
            path = Path(value)
            if path.is_file() and os.access(path, os.X_OK):
                return str(path)
        else:
            from shutil import which

            found = which(value) or which(value, path="/usr/sbin:/usr/local/sbin:/sbin")
            if found:
                return found
        raise EnvironmentProblem(f"--nginx={value!r}: no executable nginx there "
                                 "(install nginx, e.g. apt-get install nginx-light, or pass --nginx PATH)")

    def _render(self) -> str:
        worker_user = pwd.getpwuid(os.geteuid()).pw_name if os.geteuid() == 0 else None
        side = self._side.upstream
        return render_nginx_config(self._settings, self._planned, self._dir, listen_port=self._port,
                                   grpc_port=self._grpc_port, worker_user=worker_user,
                                   openai_upstream=side if self._settings.openai == "on" else "", backup=side)

    async def _write_checked(self, text: str) -> str:
        """Validate text with `nginx -t`; install it atomically if valid. Returns the error, or ''."""
        candidate = self._dir / (CONF_NAME + ".new")
        candidate.write_text(text)
        proc = await asyncio.create_subprocess_exec(
            self._binary(), "-t", "-q", "-p", str(self._dir), "-c", str(candidate),
            "-e", str(self._dir / "error.log"), "-g", "daemon off;",
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        out, _ = await proc.communicate()
        if proc.returncode != 0:
            lines = [ln for ln in out.decode(errors="replace").splitlines() if "[emerg]" in ln or "[crit]" in ln]
            return (lines[0] if lines else out.decode(errors="replace").strip()).split("] ", 1)[-1]
        os.replace(candidate, self._conf)
        return ""
