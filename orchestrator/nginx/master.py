"""The managed nginx master process: started, watched, restarted when it dies.

One owner (NginxProxy) calls start() and stop(); in between a watcher task waits on
the master with asyncio's child watcher (no blocking call on the event loop).

The listening sockets are ours: we bind them and hand them to every master we start
(nginx's own mechanism for a binary upgrade: the fds in the NGINX environment
variable). So the port never refuses while nginx is restarted, and never becomes free
for someone else: connections wait in the backlog until a worker accepts them.

When the master dies on its own (OOM killer, kill -9):
- its workers live on as orphans in its process group, sharing the listening sockets
  and serving as before. Once a new master's workers run they get SIGQUIT: each
  finishes its open requests and exits (idle keep-alive client connections are closed,
  as on any graceful nginx stop); any still running `orphan_grace_s` after the death
  is SIGKILLed.
- a new master starts from the same config file (it passed `nginx -t` when written):
  at once after a death that follows a stable run, with backoff for a repeat
  (health/restart_policy.py, the rules the instances follow). It never gives up: the
  instances behind it are fine, an OOM kill is often transient, and `status` shows the
  state and the last failure all along (an operator is better served by an endpoint
  that keeps trying than by one that stopped).

A master a previous daemon started is adopted (live restore: `adopt()`), not ours as a
child: its exit comes through launcher/adopted.py, and its listening sockets are its own
(nginx cannot hand them back). Should it die, its orphaned workers are retired first and
the sockets bound again (`reopen`) before a new master starts: the port refuses for that
moment, where a master we started is replaced with the port open throughout.

States: starting -> running -> (master died) restarting -> running ...; stopping -> stopped.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orchestrator.errors import OrchError
from orchestrator.health.restart_policy import RestartPolicy
from orchestrator.launcher.adopted import UNKNOWN_EXIT, AdoptedProcess
from orchestrator.launcher.logfile import shift_out_if_over
from orchestrator.tasks import cancel_and_wait

START_WAIT_S = 10.0  # until the new master runs a worker
RELOAD_WAIT_S = 10.0
ORPHAN_POLL_S = 0.2  # how often orphaned workers are checked while some remain
# How often error.log's size is looked at. NGINX never rotates its own logs, and under
# traffic to a FAILED instance it adds two lines every two seconds for as long as it runs.
LOG_CHECK_S = 5.0
# Backoff between restarts of a master that keeps dying: 0 (first), 0.5, 1, 2, ... 10 s.
BACKOFF_INITIAL_S = 0.5
BACKOFF_CAP_S = 10.0
STABLE_AFTER_S = 30.0  # running this long forgives earlier deaths (next death restarts at once)
FAILURE_WINDOW_S = 60.0

STARTING, RUNNING, RESTARTING, STOPPING, STOPPED = "starting", "running", "restarting", "stopping", "stopped"

_log = logging.getLogger(__name__)


def _addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def open_listener(host: str, port: int, flag: str) -> socket.socket:
    """A listening socket for nginx to inherit; OrchError naming the flag if it is taken.

    Bound as nginx binds its own (SO_REUSEADDR, IPv6-only for IPv6 addresses, backlog
    511) and non-blocking: nginx's workers all accept on it and must never block there.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        s.bind((host, port))
        s.listen(511)
        s.setblocking(False)
    except OSError as exc:
        s.close()
        raise OrchError(f"{flag}={_addr(host, port)}: nginx cannot bind it: {exc.strerror or exc}") from None
    return s


def children(pid: int) -> set[int]:
    """Direct children of pid (reads /proc/PID/task/*/children: one process, cheap)."""
    out: set[int] = set()
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as fh:
                out.update(int(p) for p in fh.read().split())
    except OSError:
        pass
    return out


def live_group_members(pgid: int) -> list[int]:
    """Non-zombie processes in process group pgid (zombies hold no sockets).

    Scans all of /proc: call it in a worker thread, never on the event loop.
    """
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


def _exit_text(code: int | None) -> str:
    if code == UNKNOWN_EXIT:
        return "exited (an adopted master: its status went to its parent)"
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def _kill_each(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def default_policy() -> RestartPolicy:
    # max_failures is unreachable on purpose: the endpoint never stops trying (see the
    # module docstring); the backoff cap keeps a crash loop cheap.
    return RestartPolicy(BACKOFF_INITIAL_S, BACKOFF_CAP_S, STABLE_AFTER_S, max_failures=sys.maxsize,
                         window_s=FAILURE_WINDOW_S)


class NginxMaster:
    """argv starts the master in the foreground (`-g 'daemon off;'`); `listeners` are the
    sockets of the config's `listen` directives (open_listener), owned from here on."""

    def __init__(self, argv: list[str], prefix: Path, listeners: list[socket.socket], *,
                 logger: logging.Logger | None = None, on_change: Callable[[], None] | None = None,
                 orphan_grace_s: float = 10.0, policy: RestartPolicy | None = None,
                 log_limits: Callable[[], tuple[int, int]] | None = None,
                 reopen: Callable[[], list[socket.socket]] | None = None) -> None:
        """`log_limits` gives (max bytes, backups) for error.log, asked at every check so
        that a reload's new values apply; None: error.log is never rotated. `reopen` binds
        the listening sockets again, for a new master after an adopted one died (open_listener's
        OrchError where one is still taken)."""
        self._argv = argv
        self._prefix = prefix
        self._listeners = listeners
        self._log = logger or _log
        self._on_change = on_change
        self._orphan_grace_s = orphan_grace_s
        self._policy = policy or default_policy()
        self._log_limits = log_limits
        self._reopen = reopen
        self._proc: asyncio.subprocess.Process | AdoptedProcess | None = None
        self.adopted = False  # the running master is a previous daemon's
        self._pgid: int | None = None
        self._orphans: dict[int, float] = {}  # pgid of a dead master -> when its workers get SIGKILL
        self._watch_task: asyncio.Task[None] | None = None
        self._stopping = False
        self._running_since: float | None = None
        self.state = STARTING
        self.restarts = 0  # new masters started after a death
        self.log_rotations = 0
        self.last_failure = ""

    # --- public ------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.returncode is None else None

    def status(self) -> dict[str, Any]:
        running_s = round(time.monotonic() - self._running_since, 1) \
            if self._running_since is not None and self.state == RUNNING else None
        return {"state": self.state, "pid": self.pid, "restarts": self.restarts,
                "last_failure": self.last_failure, "running_s": running_s,
                "orphaned_groups": len(self._orphans), "log_rotations": self.log_rotations,
                "adopted": self.adopted}

    async def start(self) -> None:
        """Spawn the master and wait until it serves; raises OrchError (one line)."""
        await self._spawn()
        self._policy.record_ready()
        self._set_state(RUNNING, f"pid {self.pid}")
        self._watch_task = asyncio.get_running_loop().create_task(self._watch(), name="nginx-master-watch")

    def adopt(self, pid: int, create_time: float) -> None:
        """Take over a running master a previous daemon started (a session leader: its group is
        its pid) and watch it as one started here."""
        self._proc = AdoptedProcess(pid, create_time)
        self._pgid = pid
        self.adopted = True
        self._policy.record_ready()
        self._set_state(RUNNING, f"adopted pid {pid}")
        self._watch_task = asyncio.get_running_loop().create_task(self._watch(), name="nginx-master-watch")

    async def detach(self) -> None:
        """Stop watching and leave the master serving, for the next daemon to adopt; our copies
        of the listening sockets are closed (the master holds its own)."""
        self._stopping = True
        if self._watch_task is not None:
            await cancel_and_wait(self._watch_task)
            self._watch_task = None
        self._close_listeners()

    async def stop(self, grace_s: float = 5.0) -> None:
        self._stopping = True
        if self.state != STOPPED:
            self._set_state(STOPPING, "stop requested")
        if self._watch_task is not None:
            await cancel_and_wait(self._watch_task)
            self._watch_task = None
        # Ours first: once nginx's workers close theirs, new connections are refused.
        self._close_listeners()
        proc = self._proc
        if proc is not None and proc.returncode is None:
            # SIGQUIT: graceful. Workers stop accepting and finish what they have.
            self.signal(signal.SIGQUIT)
            try:
                await asyncio.wait_for(proc.wait(), grace_s)
            except asyncio.TimeoutError:
                self._log.warning("nginx %d still running %.1f s after SIGQUIT: killing its group",
                                  proc.pid, grace_s)
        await self._kill_group()
        for pgid in list(self._orphans):
            await self._kill_orphans(pgid)
        self._orphans.clear()
        self._set_state(STOPPED, "stopped")

    def _close_listeners(self) -> None:
        for s in self._listeners:
            s.close()
        self._listeners = []

    def signal(self, sig: signal.Signals) -> None:
        if self._proc is not None and self._proc.returncode is None:
            try:
                self._proc.send_signal(sig)
            except ProcessLookupError:
                pass

    async def reload(self) -> None:
        """SIGHUP; returns once new workers run and every old one began its graceful exit."""
        pid = self.pid
        if pid is None:
            return  # dead: the restart starts from the config file, which is already the new one
        before = children(pid)
        self.signal(signal.SIGHUP)
        await self._wait_new_workers(pid, before)

    def last_error_line(self) -> str:
        for name in ("error.log", "nginx.stderr.log"):
            try:
                lines = (self._prefix / name).read_text(errors="replace").strip().splitlines()
            except OSError:
                continue
            for line in reversed(lines):
                if "[emerg]" in line or "[alert]" in line or "[crit]" in line:
                    return line.split("] ", 1)[-1]
        return f"see {self._prefix / 'error.log'}"

    # --- watching and restarting -----------------------------------------------------
    def _set_state(self, state: str, why: str) -> None:
        self.state = state
        self._running_since = time.monotonic() if state == RUNNING else None
        self._log.debug("nginx: %s (%s)", state, why)
        if self._on_change is not None:
            self._on_change()

    async def _watch(self) -> None:
        """Owned by start()/stop(): wait for the master's exit; restart it; reap orphans;
        rotate error.log."""
        next_log_check = time.monotonic() + LOG_CHECK_S
        while True:
            proc = self._proc
            assert proc is not None
            try:
                # While orphans remain, wake up now and then to see whether they are done.
                await asyncio.wait_for(proc.wait(), ORPHAN_POLL_S if self._orphans else LOG_CHECK_S)
            except asyncio.TimeoutError:
                await self._check_orphans()
                if time.monotonic() >= next_log_check:
                    next_log_check = time.monotonic() + LOG_CHECK_S
                    await self._rotate_error_log()
                continue
            if self._stopping:
                return
            try:
                await self._restart(proc)
            except Exception as exc:  # a bug here must not leave nginx unwatched for good
                self.last_failure = f"restart failed unexpectedly: {exc!r}"
                self._log.exception("nginx: %s", self.last_failure)
                await asyncio.sleep(BACKOFF_CAP_S)

    async def _rotate_error_log(self) -> None:
        if self._log_limits is None:
            return
        max_bytes, backups = self._log_limits()
        if await asyncio.to_thread(shift_out_if_over, self._prefix / "error.log", max_bytes, backups):
            self.signal(signal.SIGUSR1)  # the master reopens its logs and has its workers do so
            self.log_rotations += 1

    async def _restart(self, dead: "asyncio.subprocess.Process | AdoptedProcess") -> None:
        # Called again (with the same dead process) when a restart attempt fails, so every
        # failed attempt counts as a failure for the backoff.
        decision = self._policy.record_failure()
        if self.state != RESTARTING:  # RUNNING -> RESTARTING: the master died
            self.last_failure = f"nginx master {dead.pid} {_exit_text(dead.returncode)}"
            self._log.error("%s; %s", self.last_failure, decision.reason)
            self._set_state(RESTARTING, self.last_failure)
        else:  # RESTARTING -> RESTARTING: the last attempt failed (last_failure says how)
            self._log.error("nginx: %s", decision.reason)
        if self._pgid is not None:
            # Its workers keep serving on the shared sockets until the new master runs.
            self._orphans[self._pgid] = time.monotonic() + self._orphan_grace_s
            self._pgid = None
        if decision.delay_s > 0:
            await asyncio.sleep(decision.delay_s)
        self.restarts += 1
        try:
            if not self._listeners and self._reopen is not None:
                await self._rebind()
            await self._spawn()
        except (OrchError, OSError) as exc:
            self.last_failure = f"restart #{self.restarts} failed: {exc}"
            self._log.error("nginx: %s", self.last_failure)
            return
        self._policy.record_ready()
        self._log.warning("nginx restarted: pid %d (restart #%d)", self.pid, self.restarts)
        self._set_state(RUNNING, f"restarted as pid {self.pid}")
        await self._retire_orphans()

    async def _rebind(self) -> None:
        """An adopted master died, and its sockets are its orphaned workers' alone. Told to quit
        (SIGQUIT), they close them at once and finish their requests; the addresses are bound
        again as soon as they are free (up to the grace), for the new master to inherit."""
        await self._retire_orphans()
        deadline = time.monotonic() + self._orphan_grace_s
        assert self._reopen is not None
        while True:
            try:
                self._listeners = self._reopen()
                break
            except OrchError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.02)
        self.adopted = False

    async def _retire_orphans(self) -> None:
        """SIGQUIT the workers of dead masters: they finish their requests and exit."""
        for pgid in self._orphans:
            members = await asyncio.to_thread(live_group_members, pgid)
            _kill_each(members, signal.SIGQUIT)
            if members:
                self._log.warning("nginx: %d orphaned worker(s) of master %d finish their requests",
                                  len(members), pgid)

    async def _check_orphans(self) -> None:
        for pgid, kill_at in list(self._orphans.items()):
            members = await asyncio.to_thread(live_group_members, pgid)
            if not members:
                del self._orphans[pgid]
                self._log.info("nginx: orphaned workers of master %d finished", pgid)
            elif time.monotonic() >= kill_at:
                self._log.warning("nginx: %d orphaned worker(s) of master %d still running after "
                                  "%.0f s: SIGKILL", len(members), pgid, self._orphan_grace_s)
                await self._kill_orphans(pgid)

    async def _kill_orphans(self, pgid: int) -> None:
        members = await asyncio.to_thread(live_group_members, pgid)
        _kill_each(members, signal.SIGKILL)
        await self._wait_group_gone(pgid, 2.0)
        self._orphans.pop(pgid, None)

    # --- spawning ----------------------------------------------------------------------
    async def _spawn(self) -> None:
        fds = [s.fileno() for s in self._listeners]
        # nginx adopts inherited sockets whose address matches a `listen` directive.
        env = {**os.environ, "NGINX": "".join(f"{fd};" for fd in fds)}
        stderr = open(self._prefix / "nginx.stderr.log", "ab")
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *self._argv, stdin=asyncio.subprocess.DEVNULL, stdout=stderr, stderr=stderr, env=env,
                pass_fds=fds, start_new_session=True,  # its own group: master and workers die together
            )
        finally:
            stderr.close()
        self._pgid = self._proc.pid
        try:
            await self._wait_started()
        except BaseException:
            await self._kill_group()
            raise

    async def _wait_started(self) -> None:
        # Connections wait in our sockets' backlog from the start; started means a worker
        # of this master runs (it forks them once the config is loaded).
        proc = self._proc
        assert proc is not None
        deadline = time.monotonic() + START_WAIT_S
        while not children(proc.pid):
            if proc.returncode is not None:
                raise OrchError(f"nginx exited with status {proc.returncode} at start: {self.last_error_line()}")
            if time.monotonic() > deadline:
                raise OrchError(f"nginx started no worker in {START_WAIT_S:.0f} s: {self.last_error_line()}")
            await asyncio.sleep(0.02)

    async def _wait_new_workers(self, pid: int, before: set[int]) -> None:
        # A second SIGHUP while the master is still re-reading the config is safe but
        # pointless; waiting for the new workers keeps reloads strictly one at a time.
        # Done when new workers run and every old one has at least begun its graceful
        # exit (it then stops accepting, so new requests land on the new config; its
        # in-flight requests still finish).
        deadline = time.monotonic() + RELOAD_WAIT_S
        while time.monotonic() < deadline and self.pid == pid:
            now = children(pid)
            if now - before and all(_shutting_down(p) for p in now & before):
                return
            await asyncio.sleep(0.02)
        if self.pid == pid:
            self._log.warning("nginx %d: reload not finished %.0f s after SIGHUP", pid, RELOAD_WAIT_S)

    # --- killing -------------------------------------------------------------------------
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
            # the port is free when the next nginx starts.
            await self._wait_group_gone(self._pgid, 2.0)
        self._pgid = None

    @staticmethod
    async def _wait_group_gone(pgid: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while await asyncio.to_thread(live_group_members, pgid) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
