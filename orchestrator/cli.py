"""`trtllm-orch`: up, plan, status, top, down, restart, reload, logs, render-nginx, install-service."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from orchestrator import config as cfg
from orchestrator.errors import EXIT_OK, EXIT_RUNTIME, DaemonNotRunning, OrchError, UsageError

log = logging.getLogger("trtllm-orch")


# --- argument parsing ------------------------------------------------------------------
def _add_settings_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="TOML file holding any of these flags "
                        "(keys as flag names); flags override it")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(cfg.Settings):
        meta = f.metadata
        group = groups.setdefault(meta["group"], parser.add_argument_group(meta["group"]))
        kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": meta["help"]}
        if isinstance(f.default, bool):
            kwargs["action"] = "store_true"
        elif meta["repeat"]:
            kwargs.update(action="append", metavar=meta["metavar"] or "VALUE")
        else:
            kwargs["metavar"] = meta["metavar"] or f.name.upper()
        group.add_argument(cfg.flag(f.name), **kwargs)


def _add_state_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--state-dir", dest="state_dir", default=None, metavar="DIR",
                        help="the daemon's state directory (default as for `up`)")
    parser.add_argument("--config", metavar="FILE", help="read state-dir from this config file")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2, like every other usage error
        self.exit(2, f"trtllm-orch: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="trtllm-orch", description="Self-healing, load-balanced "
                     "TensorRT-LLM/Triton instances on one GPU node.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    up = sub.add_parser("up", help="start instances and the load balancer (foreground daemon)")
    _add_settings_flags(up)
    plan = sub.add_parser("plan", help="print the GPU groups, ports and commands; start nothing")
    _add_settings_flags(plan)
    plan.add_argument("--json", action="store_true", help="machine-readable output")
    status = sub.add_parser("status", help="show the instances of the running daemon")
    _add_state_dir(status)
    status.add_argument("--json", action="store_true")
    top = sub.add_parser("top", help="live view of the instances (q or Ctrl-C quits); one table when "
                         "stdout is not a terminal")
    _add_state_dir(top)
    top.add_argument("--once", action="store_true", help="print one table and exit")
    top.add_argument("--interval-s", type=float, default=0.5, help="refresh interval")
    down = sub.add_parser("down", help="stop everything; returns once nothing of the run is left")
    _add_state_dir(down)
    down.add_argument("--timeout-s", type=float, default=300.0, help="how long to wait for the daemon")
    restart = sub.add_parser("restart", help="restart one instance (also from FAILED)")
    _add_state_dir(restart)
    restart.add_argument("instance_id", metavar="ID")
    reload = sub.add_parser("reload", help="rolling restart: one instance at a time, re-reading --config")
    _add_state_dir(reload)
    upgrade = sub.add_parser("upgrade", help="replace the daemon by the installed code; engines and the "
                                            "endpoint keep serving and are adopted (live restore)")
    _add_state_dir(upgrade)
    upgrade.add_argument("--timeout-s", type=float, default=120.0, help="how long to wait for the new daemon")
    logs = sub.add_parser("logs", help="print an instance's log")
    _add_state_dir(logs)
    logs.add_argument("instance_id", metavar="ID")
    logs.add_argument("--rank", type=int, default=None, help="only this rank's lines")
    logs.add_argument("-f", "--follow", action="store_true")
    logs.add_argument("--lines", type=int, default=50)
    render = sub.add_parser("render-nginx", help="print an NGINX config for a system NGINX")
    _add_settings_flags(render)
    install = sub.add_parser("install-service", help="write a systemd unit that runs `up --config FILE`")
    _add_settings_flags(install)
    install.add_argument("--unit-dir", default="/etc/systemd/system", help="where to write the unit")
    install.add_argument("--dry-run", action="store_true", help="print the unit instead")
    return parser


def _settings_from(args: argparse.Namespace) -> cfg.Settings:
    flags = {name: getattr(args, name, None) for name in cfg.FIELDS}
    return cfg.build_settings(args.config, flags)


def _state_dir_of(args: argparse.Namespace):
    from orchestrator.controlplane.statedir import StateDir
    if args.state_dir:
        return StateDir(Path(args.state_dir).expanduser().absolute())
    if args.config:
        return StateDir(cfg.build_settings(args.config, {}).resolved_state_dir())
    return StateDir(cfg.default_state_dir())


# --- planning (shared by up, plan, render-nginx) ----------------------------------------
@dataclasses.dataclass
class Prepared:
    settings: cfg.Settings
    plan: Any
    build_command: Any
    commands: dict[str, Any]
    gpus_from_nvml: bool
    notes: tuple[str, ...] = ()  # what placement or pinning could not do here, for `plan`
    launcher: Any = None  # ("slurm", job id, nodes) when groups run as Slurm job steps; None: local mpirun


def prepare(settings: cfg.Settings, *, for_launch: bool) -> Prepared:
    from orchestrator.gpus import inventory, parse_gpu_spec
    from orchestrator.launcher.affinity import plan_affinity
    from orchestrator.launcher.command import build_launch, find_rank_wrapper, find_tritonserver
    from orchestrator.launcher.mpi import MpiFlavour, detect_flavour
    from orchestrator.plan import make_plan
    from orchestrator.topology import host_topology, load_topology
    from orchestrator.launcher.slurm_alloc import resolve_launcher
    from orchestrator.endpoint import check_front

    if for_launch:
        check_front(settings)  # before anything is looked up or started, whatever launches the groups
    if resolve_launcher(settings.launcher, os.environ) == "slurm":
        from orchestrator.launcher.slurm_prepare import prepare_slurm
        return prepare_slurm(settings, for_launch=for_launch, prepare_local=prepare)
    recorded = load_topology(settings.topology) if settings.topology else None
    gpus = inventory(settings.assume_gpus, recorded)
    ids = parse_gpu_spec(settings.gpus, tuple(g.index for g in gpus))
    topology, note = recorded, ""
    if topology is None and settings.assume_gpus is None:
        topology, note = host_topology()
    # A recorded topology describes another machine: `plan` shows it as recorded, while
    # `up` must pin to CPUs this host has and with a wrapper that works here.
    affinity, pinner, notes = plan_affinity(topology, ids, settings.cpu_affinity,
                                            host_checks=for_launch or recorded is None)
    reserved = tuple(cfg.parse_host_port(v, cfg.flag(n))[1]
                     for n, v in (("listen", settings.listen), ("grpc_listen", settings.grpc_listen),
                                  ("metrics_listen", settings.metrics_listen))
                     if v and settings.proxy != "none")
    bind = settings.bind_address
    if settings.bind_interface:
        from orchestrator.launcher.ports import interface_address
        bind = interface_address(settings.bind_interface)
    plan = make_plan(ids, settings.tp, settings.base_port, bind, reserved,
                     topology=topology, placement=settings.placement, affinity=affinity)
    if for_launch:
        if not settings.model_repo:
            raise UsageError("--model-repo", "", "required: the Triton model repository to serve")
        if not Path(settings.model_repo).is_dir():
            raise UsageError("--model-repo", settings.model_repo, "not a directory")
        mpi = detect_flavour(settings.mpirun)
        tritonserver = find_tritonserver(settings.tritonserver)
    else:  # `plan` on a machine without them still shows the commands
        try:
            mpi = detect_flavour(settings.mpirun)
        except OrchError:
            mpi = MpiFlavour("openmpi", "?", settings.mpirun or "mpirun")
        try:
            tritonserver = find_tritonserver(settings.tritonserver)
        except OrchError:
            tritonserver = settings.tritonserver or "tritonserver"
    state_dir = settings.resolved_state_dir()
    wrapper = find_rank_wrapper()
    model_repo = str(Path(settings.model_repo).absolute()) if settings.model_repo else "<model-repo>"

    def build_command(inst):
        return build_launch(inst, mpi=mpi, tritonserver=tritonserver, model_repo=model_repo,
                            llm_models=settings.tensorrt_llm_model, extra_args=settings.tritonserver_arg,
                            state_dir=str(state_dir),
                            group_dir=str(state_dir / "instances" / inst.instance_id),
                            as_root=os.geteuid() == 0, rank_wrapper=wrapper, pinner=pinner)

    commands = {inst.instance_id: build_command(inst) for inst in plan.instances}
    return Prepared(settings, plan, build_command, commands, settings.assume_gpus is None and recorded is None,
                    tuple(n for n in [note, *notes] if n))


# --- commands -------------------------------------------------------------------------------
def cmd_plan(args: argparse.Namespace) -> int:
    prepared = prepare(_settings_from(args), for_launch=False)
    if args.json:
        out = []
        for inst in prepared.plan.instances:
            entry = dataclasses.asdict(inst)
            cmd = prepared.commands[inst.instance_id]
            # Lists as numactl and /proc write them (launcher.affinity.check_rank_affinity reads these).
            entry.update(argv=list(cmd.argv), env=cmd.env, warnings=list(inst.warnings()),
                         affinity=[{"rank": r, "gpu": a.gpu, "cpus": a.cpu_list, "mems": a.mem_list}
                                   for r, a in enumerate(inst.affinity)])
            out.append(entry)
        print(json.dumps({"placement": prepared.plan.placement, "instances": out,
                          "notes": list(prepared.notes)}, indent=2))
        return EXIT_OK
    for inst in prepared.plan.instances:
        p = inst.ports
        link = f", {inst.link_text}" if inst.link_text else ""
        where = f"{','.join(inst.nodes)} " if inst.nodes else ""
        print(f"instance {inst.instance_id}: {where}GPUs {inst.cuda_visible_devices} (TP{inst.tp}{link})  "
              f"http {inst.bind_address}:{p.http}  grpc {p.grpc}  metrics {p.metrics}")
        for rank, aff in enumerate(inst.affinity):
            where = f"CPUs {aff.cpu_list}" + (f", memory node {aff.mem_list}" if aff.mems else "") \
                if aff.cpus else "any CPU"
            print(f"  rank {rank}: GPU {aff.gpu}, {where}")
        for warning in inst.warnings():
            print(f"  warning: {warning}")
        print("  " + prepared.commands[inst.instance_id].shell_text())
    s = prepared.settings
    if s.proxy != "none":
        print(f"load balancer ({s.proxy}): http {s.listen}" + (f", grpc {s.grpc_listen}" if s.grpc_listen else ""))
    if prepared.plan.instances[0].link_text or prepared.plan.placement != "ordered":
        print(f"placement: {prepared.plan.placement}")
    for note in prepared.notes:
        print(f"note: {note}")
    return EXIT_OK


def _check_listen_ports(settings: cfg.Settings, plan, sd, instances: bool = True) -> None:
    from orchestrator.launcher.ports import taken_ports
    from orchestrator.controlplane.reaper import leftover_processes
    from orchestrator.launcher.process_tree import process_tree
    # A SIGKILLed predecessor may still hold our ports: those are not strangers. Only the
    # daemon sweeps them, under its lock, so a racing `up` can never lose its processes.
    # Their children too: a managed NGINX's workers hold its listening sockets.
    ours = frozenset(c.pid for p in leftover_processes(sd) for c in process_tree(p.pid)) if sd.root.exists() \
        else frozenset()
    for inst in plan.instances if instances else ():  # under Slurm they are other hosts' ports
        busy = taken_ports(inst.bind_address, inst.ports.all(), ours)
        if busy:
            raise UsageError("--base-port", settings.base_port,
                             f"instance {inst.instance_id} port(s) in use: {', '.join(busy)}")
    from orchestrator.controlplane.side_workers import runs_side_workers
    names = [] if settings.proxy == "none" else ["listen", "grpc_listen", "metrics_listen"]
    if runs_side_workers(settings):
        names.append("openai_listen")  # the side workers' (controlplane/side_workers.py)
    for name in names:
        value = getattr(settings, name)
        if value:
            host, port = cfg.parse_host_port(value, cfg.flag(name))
            busy = taken_ports(host, (port,), ours) if port else []
            if busy:  # a predecessor's data-plane workers hold it: theirs to hand over, not strangers
                raise UsageError(cfg.flag(name), value, "address in use: " + ", ".join(busy))


def setup_logging(level: str) -> None:
    # Under systemd (JOURNAL_STREAM set) journald adds timestamps itself.
    fmt = "%(levelname)s %(message)s" if os.environ.get("JOURNAL_STREAM") else \
        "%(asctime)s %(levelname)s %(message)s"
    logging.basicConfig(level=getattr(logging, level.upper()), format=fmt, stream=sys.stderr)


def cmd_up(args: argparse.Namespace) -> int:
    # Before gRPC is loaded: its fork handlers are for children that keep using gRPC;
    # ours exec mpirun at once. With them on, every launch while the gRPC proxy runs
    # printed "Other threads are currently calling into gRPC, skipping fork() handlers"
    # straight to fd 2, past logging: noise in the journal, and on a terminal a line
    # that rich's live loading view does not know of, so it redrew one line too low.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    from orchestrator.controlplane.daemon import Daemon, Launchable
    from orchestrator.controlplane.statedir import StateDir

    settings = _settings_from(args)
    prepared = prepare(settings, for_launch=True)
    sd = StateDir(settings.resolved_state_dir())
    holder = sd.lock_holder()
    if holder:
        raise OrchError(f"a daemon (pid {holder}) already runs with state dir {sd.root}; "
                        "`trtllm-orch down` stops it")
    _check_listen_ports(settings, prepared.plan, sd, instances=prepared.launcher is None)
    if settings.detach:
        from orchestrator.detach import run_detached
        return run_detached(sys.argv[1:], settings, sd)
    setup_logging(settings.log_level)
    gpu_holders: Any = None
    gpu_usage: Any = None
    if prepared.gpus_from_nvml:
        from orchestrator.gpus import gpu_holders, gpu_usage

    def reload_config() -> Launchable:
        # The config file as it is now, with this command's flags on top, validated in
        # full (a new plan, mpirun and tritonserver found) before anything restarts.
        new = prepare(_settings_from(args), for_launch=True)
        return Launchable(new.settings, new.build_command)

    launcher = None
    if prepared.launcher is not None:
        from orchestrator.launcher.slurm import SlurmLauncher
        _, job_id, nodes = prepared.launcher
        launcher = SlurmLauncher(job_id, nodes, sd.root, lambda: daemon.settings.slurm_poll_s)
    from orchestrator.progress import LoadProgress
    daemon = Daemon(settings, prepared.plan, prepared.build_command, sd,
                    gpu_holders=gpu_holders, gpu_usage=gpu_usage, reload_config=reload_config,
                    launcher=launcher, progress=LoadProgress())
    # uvloop (libuv) when installed: the embedded proxy's per-request loop work costs less
    # (issue 12); the asyncio loop otherwise, with the same behaviour.
    from orchestrator.dataplane.embedded import install_uvloop_if_available
    log.info("event loop: %s", "uvloop" if install_uvloop_if_available() else "asyncio")
    try:
        return asyncio.run(daemon.run())
    except KeyboardInterrupt:
        return EXIT_RUNTIME


def cmd_status(args: argparse.Namespace) -> int:
    from orchestrator.controlplane.control_socket import call_sync
    sd = _state_dir_of(args)
    _, status = call_sync(sd.socket_path, "GET", "/status")
    if args.json:
        print(json.dumps(status, indent=2))
        return EXIT_OK
    print(format_status(status))
    return EXIT_OK


def format_workers(pool: dict[str, Any], daemon_version: str = "") -> list[str]:
    """The data plane: a total line, then one line per worker process. A worker whose code
    is not the daemon's (adopted across an upgrade) says so, and what replaces it. The side
    workers (beside NGINX) are named so."""
    label = "side workers" if pool.get("kind") == "side" else "data plane"
    lines = [f"{label} {pool.get('state')}  {pool.get('workers_alive', 0)}/{pool.get('workers_wanted', 0)} "
             f"workers  connections {pool.get('connections', 0)}  in flight {pool.get('inflight', 0)}  "
             f"requests {pool.get('requests', 0)}"]
    for w in pool["workers"]:
        version = w.get("version") or "?"
        older = daemon_version and w.get("alive", True) and version != daemon_version
        lines.append(f"      worker {w['slot']}: pid {w.get('pid') or '-'}  v{version}  "
                     f"connections {w.get('connections', 0)}  in flight {w.get('inflight', 0)}  held "
                     f"{w.get('held', 0)}  requests {w.get('requests', 0)}"
                     + (f" ({w['front_served']} by the front)" if w.get("front_served") is not None else "")
                     + (" (no compiled front: not built, aiohttp serves)" if w.get("front_missing") else "")
                     + f"  restarts {w.get('restarts', 0)}"
                     + (f"  last exit: {w['last_exit']}" if w.get("last_exit") else "")
                     + ("  (not the daemon's code: `reload --proxy-workers` replaces it)" if older else ""))
    return lines


def format_status(status: dict[str, Any]) -> str:
    d = status["daemon"]
    lines = [f"daemon pid {d['pid']}  up {d['uptime_s']:.0f}s  {status['ready']}/{status['total']} ready  "
             f"proxy {d['proxy']} {d['listen']}" + ("  (stopping)" if d.get("stopping") else "")]
    for proxy in status.get("proxies", []):  # a proxy with a process of its own (nginx, the workers)
        if "workers" in proxy:
            lines += format_workers(proxy, d.get("version", ""))
            continue
        lines.append(f"{proxy.get('kind', 'proxy')} {proxy.get('state')}  pid {proxy.get('pid') or '-'}  "
                     f"restarts {proxy.get('restarts', 0)}"
                     + ("  (adopted: started by the daemon before this one)" if proxy.get("adopted") else ""))
        if proxy.get("last_failure"):
            lines.append(f"      last failure: {proxy['last_failure']}")
        if proxy.get("side"):  # NGINX mode's side workers: /v1/ and its hold
            lines += format_workers(proxy["side"], d.get("version", ""))
    lines.append(f"{'ID':<4}{'GPUS':<10}{'STATE':<11}{'HTTP':<7}{'GRPC':<7}{'METRICS':<9}{'UPTIME':<9}"
                 f"{'RESTARTS':<10}{'INFLIGHT':<10}PIDS")
    for inst in status["instances"]:
        up = f"{inst['uptime_s']:.0f}s" if inst.get("uptime_s") is not None else "-"
        lines.append(f"{inst['id']:<4}{','.join(map(str, inst['gpus'])):<10}{inst['state']:<11}"
                     f"{inst['ports']['http']:<7}{inst['ports']['grpc']:<7}{inst['ports']['metrics']:<9}"
                     f"{up:<9}{inst['restarts']:<10}{inst.get('inflight', 0):<10}"
                     f"{' '.join(map(str, inst['pids']))}")
        if inst.get("nodes"):
            lines.append(f"      on {','.join(inst['nodes'])} ({inst.get('bind_address', '')})")
        if inst.get("engine"):
            lines.append("      " + format_engine(inst["engine"]))
        for gpu in inst.get("gpu", []):
            lines.append(f"      gpu {gpu['index']}: {gpu['memory_used_mib']}/{gpu['memory_total_mib']} MiB, "
                         f"{gpu['utilization_pct']}% busy")
        if inst["state"] != "READY" and inst.get("reason"):
            lines.append(f"      {inst['state'].lower()}: {inst['reason']}")
        if inst.get("last_failure"):
            lines.append(f"      last failure: {inst['last_failure']}")
        for line in inst.get("errors", []):
            lines.append(f"      log: {line[:200]}")
    return "\n".join(lines)


def format_engine(engine: dict[str, Any]) -> str:
    """What the instance's engine last reported (its TRT-LLM metrics)."""
    hit = engine.get("kv_reuse_hit_rate")
    reuse = "-" if hit is None else f"{hit * 100:.0f}%"
    return (f"engine: waiting {engine['waiting']}  active {engine['active']}/{engine['max_active']}  "
            f"KV {engine['kv_fraction'] * 100:.0f}% ({engine['kv_used_blocks']}/{engine['kv_max_blocks']} blocks)  "
            f"reuse {reuse} of prompt blocks ({engine.get('kv_reused_last_minute', 0)} reused, last minute)")


def cmd_top(args: argparse.Namespace) -> int:
    from orchestrator.top import run
    if args.interval_s <= 0:
        raise UsageError("--interval-s", args.interval_s, "must be > 0")
    return run(_state_dir_of(args).socket_path, once=args.once, interval=args.interval_s)


def cmd_down(args: argparse.Namespace) -> int:
    from orchestrator.controlplane.control_socket import call_sync
    from orchestrator.launcher.process_tree import OsOps, alive, process_of
    from orchestrator.controlplane.reaper import leftover_processes, sweep_leftovers
    sd = _state_dir_of(args)
    daemon_pid = sd.lock_holder()
    if daemon_pid:
        daemon = process_of(daemon_pid)  # taken before it stops: its start time tells a reused pid apart
        try:
            call_sync(sd.socket_path, "POST", "/down")
        except DaemonNotRunning:
            pass  # holds the lock but does not answer: wait, then sweep
        deadline = time.monotonic() + args.timeout_s
        while sd.lock_holder() and time.monotonic() < deadline:
            time.sleep(0.1)
        if sd.lock_holder():
            raise OrchError(f"the daemon (pid {daemon_pid}) did not stop within {args.timeout_s:g}s")
        # The lock goes first; the interpreter's teardown (the loop's executor threads joined,
        # exit handlers) comes after it. "Nothing of the run is left" includes the daemon.
        while daemon is not None and alive(daemon) and time.monotonic() < deadline:
            time.sleep(0.05)
        if daemon is not None and alive(daemon):
            raise OrchError(f"the daemon (pid {daemon_pid}) released its lock but had not exited "
                            f"within {args.timeout_s:g}s")
    from orchestrator.launcher.slurm import sweep_steps
    steps, stuck = asyncio.run(sweep_steps(sd.root))  # a Slurm run's steps, found by name
    if steps:
        print(f"cancelled {len(steps)} Slurm job step(s) left by a killed daemon: {' '.join(steps)}")
    left = asyncio.run(sweep_leftovers(sd, OsOps(), 10.0, slurm_steps=False))
    if left:
        print(f"stopped {len(left)} process(es) left by a killed daemon: {' '.join(map(str, left))}")
    remaining = leftover_processes(sd)
    if remaining:
        raise OrchError(f"processes still running after down: {[p.pid for p in remaining]}")
    if stuck:
        raise OrchError(f"Slurm still lists job step(s) {' '.join(stuck)} of this run: their nodes do not "
                        "answer; run `trtllm-orch down` again once Slurm has ended them")
    sd.clear_state()
    if not daemon_pid and not left and not steps:
        print(f"nothing was running (state dir {sd.root})")
    else:
        print("down: everything stopped")
    return EXIT_OK


def cmd_restart(args: argparse.Namespace) -> int:
    from orchestrator.controlplane.control_socket import call_sync
    code, body = call_sync(_state_dir_of(args).socket_path, "POST", f"/restart/{args.instance_id}")
    if code >= 400:
        raise UsageError("ID", args.instance_id, body.get("error", "refused"))
    print(f"instance {args.instance_id}: restarting")
    return EXIT_OK


def cmd_reload(args: argparse.Namespace) -> int:
    from orchestrator.controlplane.control_socket import call_sync
    # Reading the config runs `mpirun --version`: allow for it.
    code, body = call_sync(_state_dir_of(args).socket_path, "POST", "/reload", timeout_s=60.0)
    if code >= 400:
        error = OrchError(body.get("error", "reload refused"))
        error.exit_code = body.get("exit_code", error.exit_code)
        raise error
    print("rolling restart started" if body.get("rolling_restart") else
          "config applied in place (no launch setting changed: nothing restarted)")
    return EXIT_OK


def cmd_upgrade(args: argparse.Namespace) -> int:
    """The running daemon detaches (exits, leaving its engines and data-plane workers
    serving); a daemon of the code installed now starts with the same command line and
    adopts them. Under systemd the unit's Restart= starts it (the old daemon exits 75)."""
    from orchestrator.controlplane.control_socket import call_sync
    from orchestrator.detach import wait_ready
    sd = _state_dir_of(args)
    _, status = call_sync(sd.socket_path, "GET", "/status")
    old = status["daemon"]
    state = sd.read_state() or {}
    argv = state.get("argv")
    if not isinstance(argv, list) or not argv or argv[0] != "up":
        raise OrchError(f"{sd.state_path}: no `up` command line recorded: cannot start the new daemon")
    call_sync(sd.socket_path, "POST", "/detach")
    deadline = time.monotonic() + args.timeout_s
    while sd.lock_holder() and time.monotonic() < deadline:  # the old daemon writes its record and exits
        time.sleep(0.05)
    if sd.lock_holder():
        raise OrchError(f"daemon pid {old['pid']} did not detach within {args.timeout_s:g}s")
    if not state.get("systemd"):
        log = open(sd.daemon_log_path, "ab")
        subprocess.Popen([sys.executable, "-m", "orchestrator", *argv], stdin=subprocess.DEVNULL, stdout=log,
                         stderr=subprocess.STDOUT, start_new_session=True, cwd=state.get("cwd") or None)
    new = wait_ready(sd, args.timeout_s, lambda s: s["daemon"]["pid"] != old["pid"])
    print(f"upgraded: daemon pid {old['pid']} (trtllm-orch {old.get('version', '?')}) -> pid "
          f"{new['daemon']['pid']} (trtllm-orch {new['daemon'].get('version', '?')}); "
          f"{sum(1 for i in new['instances'] if i.get('adopted'))}/{new['total']} instances adopted")
    return EXIT_OK


def cmd_logs(args: argparse.Namespace) -> int:
    from orchestrator.logs import show_logs
    return show_logs(_state_dir_of(args), args.instance_id, args.rank, args.lines, args.follow)


def cmd_render_nginx(args: argparse.Namespace) -> int:
    from orchestrator.routing.backends import Backend
    from orchestrator.nginx.proxy import render_nginx_config
    prepared = prepare(_settings_from(args), for_launch=False)
    backends = tuple(Backend(i.instance_id, i.bind_address, i.ports.http, i.ports.grpc, i.ports.metrics)
                     for i in prepared.plan.instances)
    print(render_nginx_config(prepared.settings, backends, None))
    return EXIT_OK


def cmd_install_service(args: argparse.Namespace) -> int:
    from orchestrator.service.install import install_service
    return install_service(args, _settings_from(args))


COMMANDS = {"up": cmd_up, "plan": cmd_plan, "status": cmd_status, "top": cmd_top, "down": cmd_down,
            "restart": cmd_restart, "reload": cmd_reload, "upgrade": cmd_upgrade, "logs": cmd_logs,
            "render-nginx": cmd_render_nginx, "install-service": cmd_install_service}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except OrchError as exc:
        print(f"trtllm-orch: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `trtllm-orch plan | head`: the reader left; that is not an error of ours.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
