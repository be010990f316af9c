"""`--proxy nginx`: a private nginx master in front of the READY instances.

The daemon owns one nginx master (its own prefix under the state directory, its own
process group, foreground so it stays our child). Every change of the ready set
re-renders configs/nginx.conf.j2, validates it with `nginx -t`, swaps it in
atomically and sends SIGHUP: nginx starts new workers on the new config and lets the
old ones finish their open requests, so a reload never cuts a stream.

Lifecycle (one owner: the daemon):
    proxy = NginxProxy(settings, ready_backends, state_dir, logger)
    await proxy.start()            # raises OrchError / EnvironmentProblem, one line
    ... await proxy.wait_exited()  # returns nginx's exit status if it ever dies on its own
    await proxy.stop()             # SIGQUIT, SIGKILL the group after the grace

`wait_exited()` also returns after `stop()`; the daemon tells the two apart by who
called stop. After an unexpected exit the daemon should still call `stop()` (it kills
any orphaned workers of the group and unsubscribes) before starting a new proxy.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pwd
import signal
import socket
import time
from pathlib import Path

from ..config import Settings, parse_host_port
from ..errors import EnvironmentProblem, OrchError
from ..templates import render
from .backends import Backend, ReadyBackends
from .surface import admin_regexes

TEMPLATE = "nginx.conf.j2"
CONF_NAME = "nginx.conf"
RETRY_AFTER_S = 5
FAIL_TIMEOUT_S = 10  # passive check: an instance that failed a connect is skipped this long
UPSTREAM_KEEPALIVE = 32  # idle upstream connections kept per worker
LISTEN_WAIT_S = 10.0  # nginx retries a busy bind 5 times, 0.5 s apart, before it gives up
RELOAD_WAIT_S = 10.0

_log = logging.getLogger(__name__)


def _addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _ms(seconds: float) -> int:
    return max(1, int(round(seconds * 1000)))


def render_nginx_config(settings: Settings, backends: tuple[Backend, ...], prefix_dir: Path | None,
                        *, listen_port: int | None = None, grpc_port: int | None = None,
                        worker_user: str | None = None) -> str:
    """The nginx config for this ready set.

    prefix_dir set: a complete nginx.conf for our own master (pid, error_log and temp
    paths inside prefix_dir). prefix_dir None: an http-context snippet (upstreams, geo,
    map and the two server blocks) for a system nginx's sites-available; it sets no
    pid, log or temp paths and no http-level directives. listen_port/grpc_port replace
    the ports of --listen/--grpc-listen (used when those ask for port 0).
    """
    host, port = parse_host_port(settings.listen, "--listen")
    grpc_listen = ""
    if settings.grpc_listen:
        ghost, gport = parse_host_port(settings.grpc_listen, "--grpc-listen")
        grpc_listen = _addr(ghost, grpc_port if grpc_port is not None else gport)
    full = prefix_dir is not None
    return render(
        TEMPLATE,
        full=full,
        prefix=str(prefix_dir) if full else "",
        worker_user=worker_user if full else None,
        worker_processes="auto",
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
        retry_after_s=RETRY_AFTER_S,
        # Per read in nginx (the embedded proxy's body deadline is for the whole body).
        client_header_timeout_ms=_ms(settings.client_header_timeout_s),
        client_body_timeout_ms=_ms(settings.client_body_timeout_s),
        keepalive_timeout_s=75,
    )


def _check_bindable(host: str, port: int, flag: str) -> None:
    """Fail fast, naming the address, when something already listens there.

    nginx would also fail, but only after 2.5 s of retries, and meanwhile a connect
    probe would reach the other listener and take it for nginx.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as nginx does: TIME_WAIT is fine
        try:
            s.bind((host, port))
        except OSError as exc:
            raise OrchError(f"{flag}={_addr(host, port)}: nginx cannot bind it: {exc.strerror}") from None


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _children(pid: int) -> set[int]:
    out: set[int] = set()
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as fh:
                out.update(int(p) for p in fh.read().split())
    except OSError:
        pass
    return out


def _live_group_members(pgid: int) -> list[int]:
    """Non-zombie processes in process group pgid (zombies hold no sockets)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z" and int(fields[2]) == pgid:
                out.append(int(entry))
    return out


def _shutting_down(pid: int) -> bool:
    # nginx retitles a worker "nginx: worker process is shutting down" when it starts
    # its graceful exit; a worker that is gone has finished it.
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmdline = fh.read()
    except OSError:
        return True
    return not cmdline or b"shutting down" in cmdline


class NginxProxy:
    def __init__(self, settings: Settings, backends: ReadyBackends, state_dir: Path,
                 logger: logging.Logger | None = None) -> None:
        self._settings = settings
        self._backends = backends
        self._dir = Path(state_dir) / "nginx"
        self._conf = self._dir / CONF_NAME
        self._log = logger or _log
        self._proc: asyncio.subprocess.Process | None = None
        self._pgid: int | None = None
        self._unsubscribe = None
        self._reload_task: asyncio.Task[None] | None = None
        self._reload_wanted = False
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        host, port = parse_host_port(settings.listen, "--listen")
        self._listen = (host, port)
        self._grpc_listen = parse_host_port(settings.grpc_listen, "--grpc-listen") if settings.grpc_listen else None
        self._port = port
        self._grpc_port = self._grpc_listen[1] if self._grpc_listen else None
        self.reloads = 0  # applied reloads, for status and tests
        self.last_error = ""

    # --- public ------------------------------------------------------------------
    @property
    def bound_port(self) -> int:
        return self._port

    @property
    def bound_grpc_port(self) -> int | None:
        return self._grpc_port

    @property
    def config_path(self) -> Path:
        return self._conf

    def pids(self) -> list[int]:
        return [self._proc.pid] if self._proc is not None and self._proc.returncode is None else []

    def inflight(self) -> dict[str, int]:
        return {}  # nginx does not tell us per instance

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        binary = self._binary()
        self._dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        (self._dir / "temp").mkdir(exist_ok=True, mode=0o700)
        host, port = self._listen
        if port == 0:
            self._port = _free_port(host)
        _check_bindable(host, self._port, "--listen")
        if self._grpc_listen is not None:
            ghost, gport = self._grpc_listen
            if gport == 0:
                self._grpc_port = _free_port(ghost)
            _check_bindable(ghost, self._grpc_port, "--grpc-listen")

        text = self._render(self._backends.current())
        error = await self._write_checked(text)
        if error:
            raise OrchError(f"--proxy=nginx: rendered config fails `nginx -t`: {error}")

        stderr = open(self._dir / "nginx.stderr.log", "ab")
        try:
            self._proc = await asyncio.create_subprocess_exec(
                binary, "-p", str(self._dir), "-c", str(self._conf), "-e", str(self._dir / "error.log"),
                "-g", "daemon off;",
                stdin=asyncio.subprocess.DEVNULL, stdout=stderr, stderr=stderr,
                start_new_session=True,  # its own group: stop() can kill master and workers together
            )
        finally:
            stderr.close()
        self._pgid = self._proc.pid
        try:
            await self._wait_listening()
        except BaseException:
            await self._kill_group()
            raise
        # Subscribe only now: a change that raced with startup is caught by one reload.
        self._unsubscribe = self._backends.subscribe(self._on_change)
        if self._render(self._backends.current()) != self._conf.read_text():
            self._on_change(self._backends.current())
        self._log.info("nginx %d listening on %s (config %s)", self._proc.pid,
                       _addr(host, self._port), self._conf)

    async def wait_exited(self) -> int:
        """nginx master's exit status (negative: killed by that signal)."""
        assert self._proc is not None, "start() first"
        return await self._proc.wait()

    async def stop(self, grace_s: float = 5.0) -> None:
        self._stopping = True
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._reload_task is not None:
            self._reload_task.cancel()
            await asyncio.gather(self._reload_task, return_exceptions=True)
            self._reload_task = None
        if self._proc is None:
            return
        if self._proc.returncode is None:
            # SIGQUIT: graceful. Workers stop accepting and finish what they have.
            self._signal(signal.SIGQUIT)
            try:
                await asyncio.wait_for(self._proc.wait(), grace_s)
            except asyncio.TimeoutError:
                self._log.warning("nginx %d still running %.1f s after SIGQUIT: killing its group",
                                  self._proc.pid, grace_s)
        await self._kill_group()

    # --- reloads -----------------------------------------------------------------
    def _on_change(self, backends: tuple[Backend, ...]) -> None:
        # Called synchronously by ReadyBackends.publish. Reloads run one at a time; a
        # change during a reload only marks one more, which then renders the latest set.
        self._reload_wanted = True
        if self._stopping or self._loop is None:
            return
        if self._reload_task is None or self._reload_task.done():
            self._reload_task = self._loop.create_task(self._reload_loop())

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

    async def wait_reloaded(self) -> None:
        """Until every requested reload has been applied (or failed). For tests and `reload`."""
        while self._reload_task is not None and not self._reload_task.done():
            await asyncio.shield(self._reload_task)

    async def _reload_once(self) -> None:
        if self._proc is None or self._proc.returncode is not None:
            return
        backends = self._backends.current()
        text = self._render(backends)
        if self._conf.exists() and text == self._conf.read_text():
            return
        error = await self._write_checked(text)
        if error:
            self.last_error = f"new nginx config rejected, keeping the old one: {error}"
            self._log.error("%s", self.last_error)
            return
        before = _children(self._proc.pid)
        self._signal(signal.SIGHUP)
        await self._wait_new_workers(before)
        self.reloads += 1
        self._log.info("nginx reloaded: %d ready instance(s): %s", len(backends),
                       ", ".join(b.instance_id for b in backends) or "none")

    async def _wait_new_workers(self, before: set[int]) -> None:
        # A second SIGHUP while the master is still re-reading the config is safe but
        # pointless; waiting for the new workers keeps reloads strictly one at a time.
        assert self._proc is not None
        # Done when new workers run and every old one has at least begun its graceful
        # exit (it then stops accepting and closes idle keep-alive connections, so new
        # requests land on the new config; its in-flight requests still finish).
        deadline = time.monotonic() + RELOAD_WAIT_S
        while time.monotonic() < deadline and self._proc.returncode is None:
            now = _children(self._proc.pid)
            if now - before and all(_shutting_down(pid) for pid in now & before):
                return
            await asyncio.sleep(0.02)
        self._log.warning("nginx %d: reload not finished %.0f s after SIGHUP", self._proc.pid, RELOAD_WAIT_S)

    # --- helpers -----------------------------------------------------------------
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

    def _render(self, backends: tuple[Backend, ...]) -> str:
        worker_user = pwd.getpwuid(os.geteuid()).pw_name if os.geteuid() == 0 else None
        return render_nginx_config(self._settings, backends, self._dir, listen_port=self._port,
                                   grpc_port=self._grpc_port, worker_user=worker_user)

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

    async def _wait_listening(self) -> None:
        assert self._proc is not None
        targets = [(self._listen[0], self._port, "--listen")]
        if self._grpc_listen is not None:
            targets.append((self._grpc_listen[0], self._grpc_port, "--grpc-listen"))
        deadline = time.monotonic() + LISTEN_WAIT_S
        for host, port, flag in targets:
            probe = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
            while True:
                if self._proc.returncode is not None:
                    raise OrchError(f"{flag}={_addr(host, port)}: nginx exited with status "
                                    f"{self._proc.returncode} before listening: {self._last_error_line()}")
                try:
                    _, writer = await asyncio.wait_for(asyncio.open_connection(probe, port), 1.0)
                    writer.close()
                    break
                except (OSError, asyncio.TimeoutError):
                    pass
                if time.monotonic() > deadline:
                    raise OrchError(f"{flag}={_addr(host, port)}: nginx not listening after "
                                    f"{LISTEN_WAIT_S:.0f} s: {self._last_error_line()}")
                await asyncio.sleep(0.05)
        # The master binds before it forks workers; a connect succeeds (backlog) before
        # anyone can answer. Started means a worker runs.
        while not _children(self._proc.pid):
            if self._proc.returncode is not None or time.monotonic() > deadline:
                raise OrchError(f"--listen={_addr(self._listen[0], self._port)}: nginx started no worker: "
                                f"{self._last_error_line()}")
            await asyncio.sleep(0.02)

    def _last_error_line(self) -> str:
        for name in ("error.log", "nginx.stderr.log"):
            try:
                lines = (self._dir / name).read_text(errors="replace").strip().splitlines()
            except OSError:
                continue
            for line in reversed(lines):
                if "[emerg]" in line or "[alert]" in line or "[crit]" in line:
                    return line.split("] ", 1)[-1]
        return f"see {self._dir / 'error.log'}"

    def _signal(self, sig: signal.Signals) -> None:
        if self._proc is not None and self._proc.returncode is None:
            try:
                self._proc.send_signal(sig)
            except ProcessLookupError:
                pass

    async def _kill_group(self) -> None:
        # Also after the master died on its own: its workers (and old workers of a
        # reload) stay in the group and would keep the port.
        if self._pgid is not None:
            try:
                os.killpg(self._pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self._proc is not None and self._proc.returncode is None:
            await self._proc.wait()
        if self._pgid is not None:
            # Orphaned workers are not our children: wait until they are really gone so
            # the port is free when the daemon starts the next nginx.
            deadline = time.monotonic() + 2.0
            while _live_group_members(self._pgid) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        self._pgid = None
