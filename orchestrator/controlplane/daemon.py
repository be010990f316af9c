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
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import psutil

from orchestrator.config import APPLIED_AT_RELAUNCH, Settings, reload_changes
from orchestrator.controlplane.control_socket import ControlServer
from orchestrator.errors import OrchError
from orchestrator.health.checks import InstanceChecks
from orchestrator.health.exit_watch import ExitWatcher
from orchestrator.health.loop_monitor import LoopMonitor
from orchestrator.controlplane.instance import Instance, Shared
from orchestrator.launcher.command import LaunchCommand
from orchestrator.launcher.group import ProcessGroup
from orchestrator.launcher.process_tree import OsOps
from orchestrator.plan import InstancePlan, Plan
from orchestrator.routing.backends import ReadyBackends
from orchestrator import release
from orchestrator.controlplane.adoption import Prior, find_prior
from orchestrator.controlplane.reaper import sweep_leftovers
from orchestrator.controlplane.states import State
from orchestrator.controlplane.statedir import StateDir, StateWriter
from orchestrator.tasks import cancel_and_wait

log = logging.getLogger("trtllm-orch")


@dataclass(frozen=True)
class Launchable:
    """A validated configuration: its settings and the command builder made from them."""

    settings: Settings
    build_command: Callable[[InstancePlan], LaunchCommand]


class Daemon:
    def __init__(self, settings: Settings, plan: Plan, build_command: Callable[[InstancePlan], LaunchCommand],
                 state_dir: StateDir, *, ops: OsOps | None = None,
                 gpu_holders: Callable[[tuple[int, ...]], set[int]] | None = None,
                 gpu_usage: Callable[[tuple[int, ...]], dict[int, dict]] | None = None,
                 reload_config: Callable[[], Launchable] | None = None, launcher: Any = None,
                 progress: Any = None):
        self.settings = settings
        self.plan = plan
        self.state_dir = state_dir
        self._build_command = build_command
        self._ops = ops or OsOps()
        self._gpu_holders = gpu_holders
        self._gpu_usage = gpu_usage
        # Blocking (it runs `mpirun --version` and may ask NVML): called in a worker thread.
        self._reload_config = reload_config
        # launcher.slurm.SlurmLauncher when groups run as Slurm job steps; None: local mpirun.
        self._launcher = launcher
        self.backends = ReadyBackends()
        self.instances: dict[str, Instance] = {}
        self.proxies: list[Any] = []
        self._shared: Shared | None = None
        self._stop = asyncio.Event()
        self._stop_reason = ""
        self._started = time.monotonic()
        self._create_time = psutil.Process().create_time()
        self._reload_task: asyncio.Task | None = None
        self._signal_tasks: set[asyncio.Task] = set()  # SIGHUP reloads; cancelled at the end
        self._notifier = _make_notifier()
        self._announced_ready = False
        self._state_writer = StateWriter(state_dir, self.state_record)
        self.loop_monitor = LoopMonitor()
        # Shows engines loading (progress.LoadProgress): told of every instance change,
        # renders from a task of its own that the daemon owns.
        self._progress = progress
        self._prior = Prior()  # what the previous daemon left for us to adopt (run() reads it)
        self.detached = False  # the daemon left its engines and workers to the next one
        self._argv = [a for a in sys.argv[1:] if a != "--detach"]

    # --- lifecycle -------------------------------------------------------------------
    async def run(self) -> int:
        sd = self.state_dir
        sd.ensure()
        sd.acquire_lock()
        try:
            # Live restore: what the previous daemon left that matches this config is
            # adopted (engines keep their KV cache, workers their clients); the rest is swept.
            self._prior = await asyncio.to_thread(self._find_prior)
            for note in self._prior.notes:
                log.info("live restore: %s", note)
            left = await sweep_leftovers(sd, self._ops, self.settings.stop_grace_s,
                                         keep=frozenset(self._prior.keep_pids()))
            if left:
                log.warning("stopped %d process(es) left by a previous daemon: %s", len(left), left)
            return await self._run_locked()
        finally:
            if not self.detached:  # detached: the next daemon adopts from this record
                sd.clear_state()
            sd.release_lock()

    def _find_prior(self) -> Prior:
        return find_prior(self.state_dir.read_state(), self.plan.instances, self._build_command,
                          str(self.state_dir.root), self.settings.public_addresses(),
                          local_launcher=self._launcher is None, proxy=self.settings.proxy)

    def _make_shared(self, watcher: ExitWatcher, session: aiohttp.ClientSession) -> Shared:
        root = str(self.state_dir.root)

        def make_group(plan, log_file, on_trouble) -> ProcessGroup:
            if self._launcher is not None:
                return self._launcher.make_group(plan, self._ops, log_file, on_trouble,
                                                 lambda iid=plan.instance_id: self._node_back(iid))
            return ProcessGroup(plan, root, self._ops, watcher, self._gpu_holders, log_file, on_trouble)

        return Shared(self.settings, self.state_dir, self._build_command, make_group,
                      lambda backend: InstanceChecks(session, backend.http_url, backend.metrics_url),
                      abort_upstream=self._abort_upstream)

    async def _run_locked(self) -> int:
        loop = asyncio.get_running_loop()
        self._install_signals(loop)
        watcher = ExitWatcher(loop)
        timeout = aiohttp.ClientTimeout(total=None, connect=self.settings.probe_timeout_s)
        session = aiohttp.ClientSession(timeout=timeout,
                                        connector=aiohttp.TCPConnector(limit=0, force_close=False))
        self._shared = self._make_shared(watcher, session)
        for inst_plan in self.plan.instances:
            inst = self.instances[inst_plan.instance_id] = Instance(
                inst_plan, self._shared, self._instance_changed, adopt=self._prior.instances.get(inst_plan.instance_id))
            inst.restarts = self._prior.restarts.get(inst_plan.instance_id, 0)
        control = ControlServer(self, self.state_dir.socket_path)
        # The daemon owns every task it starts here and stops each one below.
        background = [loop.create_task(self._watchdog_loop(), name="watchdog"),
                      loop.create_task(self._log_rotation_loop(), name="log-rotation"),
                      loop.create_task(self._state_writer.run(), name="state-writer"),
                      loop.create_task(self.loop_monitor.run(), name="loop-monitor")]
        if self._launcher is not None:  # Slurm: records the run's step names, watches the nodes
            background.append(loop.create_task(self._launcher.run(), name="slurm-nodes"))
        if self._progress is not None:
            background.append(loop.create_task(self._progress.run(self.instances), name="load-progress"))
        supervisors: dict[str, asyncio.Task] = {}
        exit_code = 0
        try:
            await control.start()
            await self._start_proxies()
            self._write_state()
            log.info("daemon pid=%d state_dir=%s instances=%d proxy=%s listen=%s", os.getpid(),
                     self.state_dir.root, len(self.instances), self.settings.proxy, self.settings.listen)
            supervisors = {i.id: loop.create_task(i.supervise(), name=f"instance-{i.id}")
                           for i in self.instances.values()}
            stale = {iid for iid, group in self._prior.instances.items() if group.stale}
            if stale:  # adopted groups launched with another command: replaced one at a time
                self._reload_task = loop.create_task(self._replace_stale(stale), name="rolling-restart")
            failure = await self._until_stop_or_failure([*supervisors.values(), *background])
            if failure is not None:
                raise failure
            if self.detached:
                await self._detach(supervisors)
                return EXIT_DETACHED
            log.info("stopping: %s", self._stop_reason)
            if self._notifier is not None:
                self._notifier.stopping()
                self._notifier.status(f"stopping: {self._stop_reason}")
            # Endpoint first: no new requests reach instances that are about to go.
            await self._stop_proxies()
            await cancel_and_wait(self._reload_task)
            for inst in self.instances.values():
                inst.request_stop()
            # supervise() returns once its group is gone.
            await asyncio.gather(*supervisors.values())
        except Exception as exc:
            log.error("daemon error: %s", exc, exc_info=exc)
            exit_code = 1
            await self._stop_proxies()
            await cancel_and_wait(self._reload_task)
            for iid, task in supervisors.items():
                await cancel_and_wait(task)
                await self.instances[iid].stop_now()
        finally:
            self._stop.set()
            await cancel_and_wait(*background, *self._signal_tasks)
            await control.stop()
            await session.close()
            watcher.close()
        # A clean stop is success even if some instance had FAILED: `status` reported it
        # while we ran, and systemd must not restart a service that was asked to stop.
        return exit_code

    async def _until_stop_or_failure(self, tasks: list[asyncio.Task]) -> BaseException | None:
        """Wait for a stop request. A task that ends before it is a bug: return its error."""
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            done, _ = await asyncio.wait([stop, *tasks], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        for task in done:
            if task is not stop:
                exc = task.exception()
                if exc is not None:
                    return exc
                if not self._stop.is_set():  # the watchdog ends with a stop, nothing else ends
                    return RuntimeError(f"task {task.get_name()} ended before the daemon stopped")
        return None

    def request_stop(self, reason: str) -> None:
        if not self._stop.is_set():
            self._stop_reason = reason
            self._stop.set()

    def request_detach(self, reason: str) -> None:
        """Exit and leave the engines and the data plane (workers, or a managed NGINX) serving
        (an upgrade: the next daemon, maybe newer code, adopts them). Local groups only: Slurm
        steps stop as on `down`."""
        if not self._stop.is_set():
            self.detached = True
            self.request_stop(reason)

    async def _detach(self, supervisors: dict[str, asyncio.Task]) -> None:
        log.info("detaching (%s): engines and the data plane keep serving for the next daemon",
                 self._stop_reason)
        if self._notifier is not None:
            self._notifier.stopping()
            self._notifier.status(f"detached: {self._stop_reason}")
        await cancel_and_wait(self._reload_task)
        for task in supervisors.values():
            await cancel_and_wait(task)  # the supervisor goes, its group runs on
        for proxy in self.proxies:
            detach = getattr(proxy, "detach", None)
            await (detach() if detach is not None else proxy.stop(5.0))
        # The record the next daemon adopts from, written now and whole.
        await asyncio.to_thread(self.state_dir.write_state, self.state_record())

    async def _stop_or_detach(self, signame: str) -> None:
        from orchestrator.service.systemd_job import being_restarted
        if await being_restarted():
            self.request_detach(f"{signame} of `systemctl restart`: the restarted daemon adopts")
        else:
            self.request_stop(f"{signame} received")

    def _install_signals(self, loop: asyncio.AbstractEventLoop) -> None:
        # Handlers only record the signal; the loop acts on it (uvicorn's rule).
        def on_term(signame: str) -> None:
            if self._stop.is_set():
                log.warning("second %s: forcing exit", signame)
                os._exit(1)
            if signame == "SIGTERM" and os.environ.get("INVOCATION_ID"):
                # Under systemd: `systemctl restart` detaches, stop stops (service/systemd_job.py).
                task = loop.create_task(self._stop_or_detach(signame), name="sigterm")
                self._signal_tasks.add(task)
                task.add_done_callback(self._signal_tasks.discard)
                return
            self.request_stop(f"{signame} received")

        def on_hup() -> None:
            task = loop.create_task(self._reload_logged("SIGHUP"), name="sighup-reload")
            self._signal_tasks.add(task)
            task.add_done_callback(self._signal_tasks.discard)

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_term, sig.name)
        loop.add_signal_handler(signal.SIGHUP, on_hup)
        # SIGUSR2: exit, leaving engines and workers to the next daemon (an upgrade under
        # systemd: `systemctl kill -s USR2`, then Restart= starts the new code, which adopts).
        loop.add_signal_handler(signal.SIGUSR2, self.request_detach, "SIGUSR2 received")

    # --- load balancer ---------------------------------------------------------------
    async def _start_proxies(self) -> None:
        from orchestrator.endpoint import make_proxies, planned_backends
        self.proxies = make_proxies(self.settings, self.backends, self.state_dir.root,
                                    planned=planned_backends(self.plan), on_change=self._proxy_changed,
                                    adopt=self._prior.workers, adopt_nginx=self._prior.nginx)
        for proxy in self.proxies:
            await proxy.start()

    def _abort_upstream(self, backend: Any, reason: str, answering: bool) -> None:
        """An instance stopped answering: every proxy fails what it has in flight there (the
        data-plane workers through their feed), so no client waits for an idle timeout."""
        for proxy in self.proxies:
            abort = getattr(proxy, "abort_instance", None)  # NGINX cannot: its timeouts decide
            if abort is not None:
                abort(backend.host, backend.http_port, reason, answering)

    def _proxy_changed(self) -> None:
        # A proxy's own process changed (nginx died or was restarted): state.json must name
        # the new pid (the reaper's list after a kill -9 of the daemon) and systemd must tell.
        self._write_state()
        self._report_to_systemd()

    async def _stop_proxies(self) -> None:
        proxies, self.proxies = self.proxies, []
        for proxy in proxies:
            with contextlib.suppress(Exception):
                await proxy.stop(5.0)

    # --- reacting to instances ---------------------------------------------------------
    def _instance_changed(self, inst: Instance) -> None:
        # Synchronous on purpose: the ready set is current before the next request is routed.
        self.backends.publish(tuple(i.backend for i in self.instances.values() if i.serving))
        self._write_state()
        self._report_to_systemd()
        if self._progress is not None:
            self._progress.changed(inst)

    def _write_state(self) -> None:
        # Coalesced and written (with fsync) in a worker thread: this runs inside proxy
        # request handlers (an ejection) and must not wait for the disk.
        self._state_writer.mark_dirty()

    def state_record(self) -> dict[str, Any]:
        proxy_pids = [pid for p in self.proxies for pid in getattr(p, "pids", lambda: [])()]
        dataplane = next((p.state_record() for p in self.proxies if hasattr(p, "state_record")), None)
        return {"daemon_pid": os.getpid(),
                "daemon_create_time": self._create_time,
                "version": release(),
                # `upgrade` starts the new daemon with this command line (or systemd does).
                "argv": self._argv, "cwd": os.getcwd(), "systemd": bool(os.environ.get("INVOCATION_ID")),
                "proxy_pids": proxy_pids,
                "dataplane": dataplane,
                "instances": {i.id: i.state_record() for i in self.instances.values()}}

    def ready_count(self) -> int:
        return sum(1 for i in self.instances.values() if i.serving)

    async def status(self) -> dict[str, Any]:
        inflight: dict[str, int] = {}
        for proxy in self.proxies:
            for key, value in proxy.inflight().items():
                inflight[key] = inflight.get(key, 0) + value
        gpu = await self._gpu_status()
        llm, held = self._llm_status()
        instances = []
        for inst in self.instances.values():
            entry = inst.describe()
            entry["inflight"] = inflight.get(inst.id, 0)
            entry["gpu"] = [gpu[g] for g in entry["gpus"] if g in gpu]
            entry["llm"] = llm.get(inst.id)
            instances.append(entry)
        s = self.settings
        return {
            "daemon": {"pid": os.getpid(), "version": release(),
                       "uptime_s": round(time.monotonic() - self._started, 1),
                       "state_dir": str(self.state_dir.root), "proxy": s.proxy,
                       "listen": s.listen if s.proxy != "none" else "",
                       "grpc_listen": s.grpc_listen if s.proxy != "none" else "",
                       "model_repo": s.model_repo,
                       "config_generation": self._shared.generation if self._shared else 1,
                       "stopping": self._stop.is_set(),
                       "rolling_restart": bool(self._reload_task and not self._reload_task.done()),
                       "loop_lag_ms": self.loop_monitor.summary(),
                       "lb_policy": s.lb_policy, "held": held,
                       "tokens_per_s": round(sum(v["tokens_per_s"] for v in llm.values()), 1)},
            "proxies": [p.status() for p in self.proxies if hasattr(p, "status")],
            "ready": self.ready_count(), "total": len(self.instances),
            "instances": instances,
        }

    def _llm_status(self) -> tuple[dict[str, dict[str, Any]], int]:
        """The data plane's last minute per instance (TTFT, tokens/s) and its held requests."""
        llm: dict[str, dict[str, Any]] = {}
        held = 0
        for proxy in self.proxies:
            llm.update(proxy.llm_summary())  # the data-plane workers': every worker's, merged
            held += proxy.held_now()
        return llm, held

    async def _gpu_status(self) -> dict[int, dict[str, Any]]:
        if self._gpu_usage is None:
            return {}
        gpus = tuple(g for inst in self.plan.instances for g in inst.gpus)
        try:
            return await asyncio.to_thread(self._gpu_usage, gpus)
        except Exception as exc:  # NVML trouble must not break `status`
            log.debug("gpu usage: %s", exc)
            return {}

    def _node_back(self, instance_id: str) -> None:
        # Slurm returned the node of an instance that failed with it: serve there again.
        inst = self.instances.get(instance_id)
        if inst is not None and inst.state == State.FAILED:
            inst.request_restart()

    def restart_instance(self, instance_id: str) -> str | None:
        """Restart one instance (also out of FAILED); an error message if there is no such one."""
        inst = self.instances.get(instance_id)
        if inst is None:
            return f"no instance {instance_id!r} (instances: {', '.join(self.instances)})"
        inst.request_restart()
        return None

    # --- reload: new config, rolling restart ----------------------------------------------
    async def reload(self, why: str) -> bool:
        """Re-read the config, apply it, and restart the instances one at a time when needed.

        Fields that apply at once (health, routing, proxy knobs) restart nothing: a
        restart would empty every engine's KV cache for no reason. A changed launch
        command (model repository, tritonserver args...) or an unchanged config (a
        restart on demand) starts a rolling restart. Raises OrchError (one line naming
        the field) when the new config is invalid or changes what needs `down`/`up`;
        then nothing changes. Returns whether a rolling restart is under way.
        """
        if self._stop.is_set():
            raise OrchError("the daemon is stopping")
        if self._reload_task and not self._reload_task.done():
            raise OrchError("a rolling restart is already running")
        if self._reload_config is not None:
            new = await asyncio.to_thread(self._reload_config)
            changed = reload_changes(self.settings, new.settings)  # raises for a fixed field
            self._apply(new, changed)
            if changed and not any(name in APPLIED_AT_RELAUNCH for name in changed):
                log.info("reload (%s): applied in place, no restart needed", why)
                return False
        if self._notifier is not None:
            self._notifier.reloading()  # `systemctl reload` waits for the READY=1 at its end
        self._reload_task = asyncio.get_running_loop().create_task(self._rolling_restart(why),
                                                                    name="rolling-restart")
        return True

    async def _reload_logged(self, why: str) -> None:
        try:
            await self.reload(why)
        except OrchError as exc:
            log.error("reload (%s) refused: %s", why, exc)

    def _apply(self, new: Launchable, changed: list[str]) -> None:
        assert self._shared is not None
        self.settings = new.settings
        self._shared.settings = new.settings
        self._shared.build_command = new.build_command
        self._shared.generation += 1
        logging.getLogger().setLevel(new.settings.log_level.upper())
        for inst in self.instances.values():
            inst.apply_settings(new.settings)
        for proxy in self.proxies:
            apply = getattr(proxy, "apply_settings", None)
            if apply is not None:
                apply(new.settings)
        at_relaunch = [name for name in changed if name in APPLIED_AT_RELAUNCH]
        now = [name for name in changed if name not in APPLIED_AT_RELAUNCH]
        log.info("reload: config generation %d; applied now: %s; at each relaunch: %s",
                 self._shared.generation, ", ".join(now) or "-", ", ".join(at_relaunch) or "-")

    async def _replace_stale(self, ids: set[str]) -> None:
        """Adopted groups that run an older launch command serve until every instance has
        settled, then are relaunched with this config's one at a time, as a reload would: a
        changed config never takes every instance out at once."""
        for inst in self.instances.values():
            await inst.wait_for(lambda inst=inst: inst.state in (State.READY, State.FAILED))  # type: ignore[misc]
        await self._rolling_restart("adopted with an older launch command", only=ids)

    async def _rolling_restart(self, why: str, only: set[str] | None = None) -> None:
        chosen = [i for i in self.instances.values() if only is None or i.id in only]
        log.info("rolling restart (%s): %d instance(s), one at a time", why, len(chosen))
        for inst in chosen:
            if inst.state == State.STOPPED:
                continue
            before = inst.launches
            inst.request_restart()
            # The instance tells us when its next launch settled; a restart out of FAILED
            # counts as a launch too (waiting on `restarts` alone once hung forever).
            await inst.wait_for(lambda inst=inst: inst.launches > before  # type: ignore[misc]
                                and inst.state in (State.READY, State.FAILED))
            log.info("rolling restart: instance=%s is %s", inst.id, inst.state.value)
        log.info("rolling restart done")
        if self._notifier is not None:
            self._notifier.ready(f"reloaded: {self.ready_count()}/{len(self.instances)} instances ready")

    # --- systemd -------------------------------------------------------------------------
    def _report_to_systemd(self) -> None:
        if self._notifier is None or self._stop.is_set():
            return
        ready, total = self.ready_count(), len(self.instances)
        restarts = sum(i.restarts for i in self.instances.values())
        text = f"{ready}/{total} instances ready, {restarts} restarts"
        for proxy in self.proxies:  # e.g. "; nginx restarting: nginx master 12 killed by SIGKILL"
            st = proxy.status() if hasattr(proxy, "status") else {}
            if st.get("state", "running") != "running":
                text += f"; {st.get('kind', 'proxy')} {st['state']}: {st.get('last_failure', '')}"
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


    async def _log_rotation_loop(self) -> None:
        """The engines write their logs themselves (they outlive the daemon): the daemon
        caps them, by copy and truncate, every LOG_CHECK_S."""
        while not self._stop.is_set():
            for inst in self.instances.values():
                inst.rotate_log()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), LOG_CHECK_S)


LOG_CHECK_S = 2.0
# The exit status of a detached daemon: EX_TEMPFAIL, so systemd's Restart=on-failure
# starts the (new) daemon, which adopts what this one left.
EXIT_DETACHED = 75


def _make_notifier():
    if not os.environ.get("NOTIFY_SOCKET"):
        return None
    from orchestrator.service.sdnotify import SystemdNotifier
    return SystemdNotifier(logger=log)

