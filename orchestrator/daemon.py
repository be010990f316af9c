"""The daemon: owns the instances, the load balancer, the control socket and every task.

Start order: state dir + lock, sweep leftovers of a killed predecessor, control
socket, load balancer, instances (in parallel). Stop order is the reverse, so
the endpoint stops taking requests before the instances behind it go away, and
the lock is released only once nothing of the run is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import psutil

from .config import Settings
from .health.exit_watch import ExitWatcher
from .health.outlier import OutlierDetector
from .instance import Instance, Shared
from .launcher.command import LaunchCommand
from .launcher.process_tree import OsOps
from .plan import InstancePlan, Plan
from .proxy.backends import ReadyBackends
from .reaper import sweep_leftovers
from .states import State
from .statedir import StateDir

log = logging.getLogger("trtllm-orch")


class Daemon:
    def __init__(self, settings: Settings, plan: Plan, build_command: Callable[[InstancePlan], LaunchCommand],
                 state_dir: StateDir, *, ops: OsOps | None = None,
                 gpu_holders: Callable[[tuple[int, ...]], set[int]] | None = None,
                 reload_settings: Callable[[], Settings] | None = None):
        self.settings = settings
        self.plan = plan
        self.state_dir = state_dir
        self._build_command = build_command
        self._ops = ops or OsOps()
        self._gpu_holders = gpu_holders
        self._reload_settings = reload_settings
        self.backends = ReadyBackends()
        self.instances: dict[str, Instance] = {}
        self.proxies: list[Any] = []
        self._stop = asyncio.Event()
        self._stop_reason = ""
        self._started = time.monotonic()
        self._outliers = OutlierDetector(settings.outlier_failures)
        self._reload_task: asyncio.Task | None = None
        self._notifier = _make_notifier()
        self._announced_ready = False
        # Launches per instance (moves into STARTING), so a rolling restart can tell that an
        # instance really went through a new start: `restarts` does not count a restart out
        # of FAILED, and waiting on it hung the rolling restart (and refused every later one).
        self._starts: dict[str, int] = {}
        self._last_state: dict[str, State] = {}

    # --- lifecycle -------------------------------------------------------------------
    async def run(self) -> int:
        sd = self.state_dir
        sd.ensure()
        sd.acquire_lock()
        try:
            left = await sweep_leftovers(sd, self._ops, self.settings.stop_grace_s)
            if left:
                log.warning("stopped %d process(es) left by a previous daemon: %s", len(left), left)
            return await self._run_locked()
        finally:
            sd.clear_state()
            sd.release_lock()

    async def _run_locked(self) -> int:
        loop = asyncio.get_running_loop()
        self._install_signals(loop)
        watcher = ExitWatcher(loop)
        timeout = aiohttp.ClientTimeout(total=None, connect=self.settings.probe_timeout_s)
        session = aiohttp.ClientSession(timeout=timeout,
                                        connector=aiohttp.TCPConnector(limit=0, force_close=False))
        shared = Shared(self.settings, self.state_dir, self._ops, session, watcher,
                        self._build_command, self._gpu_holders)
        for inst_plan in self.plan.instances:
            self.instances[inst_plan.instance_id] = Instance(inst_plan, shared, self._instance_changed)
        self.backends.set_health_sinks(self._proxy_saw_failure, self._proxy_saw_success)
        from .control import ControlServer  # late: control imports daemon types
        control = ControlServer(self, self.state_dir.socket_path)
        exit_code = 0
        try:
            await control.start()
            await self._start_proxies()
            self._write_state()
            log.info("daemon pid=%d state_dir=%s instances=%d proxy=%s listen=%s", os.getpid(),
                     self.state_dir.root, len(self.instances), self.settings.proxy, self.settings.listen)
            async with asyncio.TaskGroup() as tasks:
                for inst in self.instances.values():
                    tasks.create_task(inst.supervise(), name=f"instance-{inst.id}")
                tasks.create_task(self._watchdog_loop(), name="watchdog")
                await self._stop.wait()
                log.info("stopping: %s", self._stop_reason)
                if self._notifier is not None:
                    self._notifier.stopping()
                    self._notifier.status(f"stopping: {self._stop_reason}")
                # Endpoint first: no new requests reach instances that are about to go.
                await self._stop_proxies()
                for inst in self.instances.values():
                    inst.request_stop()
                if self._reload_task:
                    self._reload_task.cancel()
                # supervise() tasks return once their groups are gone; the watchdog ends with _stop.
        except* Exception as group:  # noqa: B902 - we log each, then fail the run
            for exc in group.exceptions:
                log.error("daemon error: %s", exc, exc_info=exc)
            exit_code = 1
            await self._stop_proxies()
            for inst in self.instances.values():
                await inst._stop_group()
        finally:
            await control.stop()
            await session.close()
            watcher.close()
        # A clean stop is success even if some instance had FAILED: `status` reported it
        # while we ran, and systemd must not restart a service that was asked to stop.
        return exit_code

    def request_stop(self, reason: str) -> None:
        if not self._stop.is_set():
            self._stop_reason = reason
            self._stop.set()

    def _install_signals(self, loop: asyncio.AbstractEventLoop) -> None:
        # Handlers only record the signal; the loop acts on it (uvicorn's rule).
        def on_term(signame: str) -> None:
            if self._stop.is_set():
                log.warning("second %s: forcing exit", signame)
                os._exit(1)
            self.request_stop(f"{signame} received")
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_term, sig.name)
        loop.add_signal_handler(signal.SIGHUP, lambda: self.start_rolling_restart("SIGHUP"))

    # --- load balancer ---------------------------------------------------------------
    async def _start_proxies(self) -> None:
        from .proxy import make_proxies
        self.proxies = make_proxies(self.settings, self.backends, self.state_dir.root)
        for proxy in self.proxies:
            await proxy.start()

    async def _stop_proxies(self) -> None:
        proxies, self.proxies = self.proxies, []
        for proxy in proxies:
            with contextlib.suppress(Exception):
                await proxy.stop(5.0)

    def _proxy_saw_failure(self, instance_id: str, reason: str) -> None:
        inst = self.instances.get(instance_id)
        if inst and self._outliers.record_failure(instance_id, reason):
            inst.suspect(f"ejected after {self.settings.outlier_failures} consecutive proxy "
                         f"failures (last: {reason})")

    def _proxy_saw_success(self, instance_id: str) -> None:
        self._outliers.record_success(instance_id)
        inst = self.instances.get(instance_id)
        if inst:
            inst.note_traffic_ok()

    # --- reacting to instances ---------------------------------------------------------
    def _instance_changed(self, inst: Instance) -> None:
        if inst.state == State.STARTING and self._last_state.get(inst.id) != State.STARTING:
            self._starts[inst.id] = self._starts.get(inst.id, 0) + 1
        self._last_state[inst.id] = inst.state
        # Synchronous on purpose: the ready set is current before the next request is routed.
        self.backends.publish(tuple(i.backend for i in self.instances.values() if i.serving))
        if inst.state == State.READY:
            self._outliers.reset(inst.id)
        self._write_state()
        self._report_to_systemd()

    def _write_state(self) -> None:
        try:
            self.state_dir.write_state(self.state_record())
        except OSError as exc:
            log.error("cannot write %s: %s", self.state_dir.state_path, exc)

    def state_record(self) -> dict[str, Any]:
        proxy_pids = [pid for p in self.proxies for pid in getattr(p, "pids", lambda: [])()]
        return {"daemon_pid": os.getpid(),
                "daemon_create_time": psutil.Process().create_time(),
                "proxy_pids": proxy_pids,
                "instances": {i.id: i.state_record() for i in self.instances.values()}}

    def ready_count(self) -> int:
        return sum(1 for i in self.instances.values() if i.serving)

    def status(self) -> dict[str, Any]:
        inflight: dict[str, int] = {}
        for proxy in self.proxies:
            for key, value in proxy.inflight().items():
                inflight[key] = inflight.get(key, 0) + value
        instances = []
        for inst in self.instances.values():
            entry = inst.describe()
            entry["inflight"] = inflight.get(inst.id, 0)
            instances.append(entry)
        gpu = _gpu_usage(self.plan) if self._gpu_holders else {}
        for entry in instances:
            entry["gpu"] = [gpu[g] for g in entry["gpus"] if g in gpu]
        return {
            "daemon": {"pid": os.getpid(), "uptime_s": round(time.monotonic() - self._started, 1),
                       "state_dir": str(self.state_dir.root), "proxy": self.settings.proxy,
                       "listen": self.settings.listen if self.settings.proxy != "none" else "",
                       "grpc_listen": self.settings.grpc_listen if self.settings.proxy != "none" else "",
                       "model_repo": self.settings.model_repo,
                       "stopping": self._stop.is_set(),
                       "rolling_restart": bool(self._reload_task and not self._reload_task.done())},
            "ready": self.ready_count(), "total": len(self.instances),
            "instances": instances,
        }

    # --- rolling restart ---------------------------------------------------------------
    def start_rolling_restart(self, why: str) -> bool:
        if self._stop.is_set() or (self._reload_task and not self._reload_task.done()):
            return False
        self._reload_task = asyncio.get_running_loop().create_task(self._rolling_restart(why),
                                                                    name="rolling-restart")
        return True

    async def _rolling_restart(self, why: str) -> None:
        if self._reload_settings is not None:
            try:
                new = self._reload_settings()
            except Exception as exc:
                log.error("reload (%s): config not reloaded: %s", why, exc)
                return
            if (new.gpus, new.tp, new.base_port, new.bind_address) != (
                    self.settings.gpus, self.settings.tp, self.settings.base_port, self.settings.bind_address):
                log.error("reload (%s): GPU plan or ports changed; that needs `down` and `up`", why)
                return
            self.settings = new
            for inst in self.instances.values():
                inst.apply_settings(new)
        log.info("rolling restart (%s): %d instance(s), one at a time", why, len(self.instances))
        for inst in list(self.instances.values()):
            if self._stop.is_set():
                return
            if inst.state == State.STOPPED:
                continue
            before = self._starts.get(inst.id, 0)
            inst.request_restart()
            while not self._stop.is_set():
                if self._starts.get(inst.id, 0) > before and inst.state in (State.READY, State.FAILED):
                    break
                await asyncio.sleep(0.05)
            log.info("rolling restart: instance=%s is %s", inst.id, inst.state.value)
        log.info("rolling restart done")

    # --- systemd -------------------------------------------------------------------------
    def _report_to_systemd(self) -> None:
        if self._notifier is None or self._stop.is_set():
            return
        ready, total = self.ready_count(), len(self.instances)
        restarts = sum(i.restarts for i in self.instances.values())
        text = f"{ready}/{total} instances ready, {restarts} restarts"
        need = self.settings.ready_min or total
        # READY=1 once: the endpoint is bound (proxies start before instances) and enough
        # instances answer behind it.
        if not self._announced_ready and ready >= need and self.proxies_ready():
            self._announced_ready = True
            self._notifier.ready(text)
        else:
            self._notifier.status(text)

    def proxies_ready(self) -> bool:
        return self.settings.proxy == "none" or bool(self.proxies)

    async def _watchdog_loop(self) -> None:
        """WATCHDOG=1 from the event loop itself, so a stuck loop misses it and systemd acts."""
        interval = self._notifier.watchdog_interval() if self._notifier else None
        while not self._stop.is_set():
            if self._notifier is not None:
                if interval:
                    self._notifier.watchdog()
                if not self._announced_ready:
                    # Model loads take minutes: keep systemd's start timeout from firing.
                    self._notifier.extend_timeout(max(30.0, (interval or 15) * 4))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), interval or 15.0)


def _make_notifier():
    if not os.environ.get("NOTIFY_SOCKET"):
        return None
    from .service.sdnotify import SystemdNotifier
    return SystemdNotifier(logger=log)


def _gpu_usage(plan: Plan) -> dict[int, dict[str, Any]]:
    from .gpus import gpu_usage
    gpus = tuple(g for inst in plan.instances for g in inst.gpus)
    try:
        return gpu_usage(gpus)
    except Exception:
        return {}
