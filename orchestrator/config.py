"""Settings: every knob of a run, with one source of truth for flags and TOML keys.

Each field carries its help text and the flag it maps to. The CLI builds its
argparse options from these fields, and a TOML config file uses the same names
(dashes or underscores), so a flag and a config key can never drift apart.
Precedence: defaults < config file < command-line flags.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.errors import UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 (NVIDIA's Triton containers): the same parser from PyPI
    import tomli as tomllib

LB_POLICIES = ("least-outstanding", "round-robin", "kv-aware", "prefix-affinity", "cost-model")
PROXY_MODES = ("embedded", "nginx", "none")
FRONTS = ("auto", "compiled", "aiohttp")
LOG_LEVELS = ("debug", "info", "warning", "error")
PLACEMENTS = ("topology", "ordered")
CPU_AFFINITY = ("auto", "off")
OPENAI_MODES = ("on", "off")
LAUNCHERS = ("auto", "local", "slurm")
SLURM_MPI = ("auto", "mpirun", "pmix")
MAX_PROXY_WORKERS = 64  # dataplane/shared_table.py MAX_WORKERS


def opt(default: Any, help: str, *, group: str = "launch", short: str | None = None,
        metavar: str | None = None, repeat: bool = False) -> Any:
    """A dataclass field that also describes its command-line flag."""
    meta = {"help": help, "group": group, "short": short, "metavar": metavar, "repeat": repeat}
    if isinstance(default, (list, dict)):
        raise TypeError("use tuples for immutable defaults")
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Settings:
    # --- launch -----------------------------------------------------------------
    gpus: str = opt("all", "GPUs to use: 'all', '0-3', '0,2,4,6', '0-3,6-7'")
    tp: int = opt(1, "tensor-parallel size: GPUs per instance (one mpirun job each)")
    model_repo: str = opt("", "Triton model repository served by every instance", metavar="DIR")
    assume_gpus: int | None = opt(None, "declare N GPUs instead of asking NVML "
                                  "(CPU-only hosts and tests; ranks then get no real GPU)", metavar="N")
    placement: str = opt("topology", "how --tp groups GPUs: topology (NVLink/NVSwitch peers first, then "
                         "a shared PCIe switch, then the same NUMA node; from NVML) or ordered (in --gpus "
                         "order; always so with --assume-gpus)")
    cpu_affinity: str = opt("auto", "auto: run each rank on the CPUs and memory node local to its GPU "
                            "(NVML; numactl, else taskset, CPUs only); off: ranks float over all CPUs")
    topology: str = opt("", "GPU topology JSON to use instead of NVML (as `python -m orchestrator.topology` "
                        "records it): plan for another machine; like --assume-gpus, ranks get no real GPU",
                        metavar="FILE")
    tensorrt_llm_model: tuple[str, ...] = opt(("tensorrt_llm",), "model(s) ranks != 0 load "
                                              "(repeat or comma list)", repeat=True, metavar="NAME")
    served_model: str = opt("ensemble", "model that health checks and the canary ask for", metavar="NAME")
    mpirun: str = opt("", "mpirun binary (default: mpirun on PATH)", metavar="PATH")
    tritonserver: str = opt("", "tritonserver binary (default: PATH, then /opt/tritonserver/bin/tritonserver)",
                            metavar="PATH")
    base_port: int = opt(8000, "first instance port; instance i uses base+3i .. base+3i+2 "
                         "(http, grpc, metrics)", metavar="PORT")
    bind_address: str = opt("127.0.0.1", "address instance ports bind to; keep loopback so only "
                            "the load balancer is public", metavar="ADDR")
    bind_interface: str = opt("", "bind instance ports to this interface's IPv4 address instead (under "
                              "Slurm: on each node, e.g. the cluster network ib0)", metavar="IFACE")
    launcher: str = opt("auto", "where groups run: local (mpirun on this host), slurm (one job step per "
                        "group across the allocation's nodes), auto (slurm when SLURM_JOB_ID is set)")
    slurm_mpi: str = opt("auto", "under Slurm: mpirun (inside a one-node step), pmix (srun --mpi=pmix "
                         "starts every rank), auto (mpirun; pmix for a group across nodes)")
    srun_arg: tuple[str, ...] = opt((), "extra argument for every group's srun (repeat; e.g. "
                                    "--srun-arg=--container-image=IMAGE)", repeat=True, metavar="ARG")
    slurm_poll_s: float = opt(5.0, "under Slurm: how often node states are read (sinfo, scontrol)",
                              group="health", metavar="S")
    tritonserver_arg: tuple[str, ...] = opt((), "extra argument passed to every tritonserver rank "
                                            "(repeat; e.g. --tritonserver-arg=--log-verbose=1)",
                                            repeat=True, metavar="ARG")
    state_dir: str = opt("", "state directory: lock, pids, logs, control socket "
                         "(default /run/trtllm-orch as root, else $XDG_RUNTIME_DIR/trtllm-orch)", metavar="DIR")
    stop_grace_s: float = opt(10.0, "seconds between SIGTERM and SIGKILL when stopping an instance",
                              metavar="S")
    log_level: str = opt("info", "daemon log level: " + ", ".join(LOG_LEVELS), group="daemon")
    log_max_bytes: int = opt(50 * 1024 * 1024, "instance log (and NGINX error.log) size before rotation",
                             group="daemon", metavar="BYTES")
    log_backups: int = opt(3, "rotated instance logs (and NGINX error.logs) kept", group="daemon", metavar="N")

    # --- proxy ------------------------------------------------------------------
    proxy: str = opt("embedded", "load balancer: " + ", ".join(PROXY_MODES), group="proxy")
    proxy_workers: str = opt("auto", "data-plane worker processes serving the endpoint (--proxy embedded), "
                             "or NGINX worker_processes (--proxy nginx): N (1-64) or auto (a quarter of the "
                             "CPUs, 1 to 16: the engines' ranks and their stubs need the rest)",
                             group="proxy", metavar="N|auto")
    listen: str = opt("0.0.0.0:8080", "public HTTP endpoint", group="proxy", metavar="HOST:PORT")
    grpc_listen: str = opt("0.0.0.0:8081", "public gRPC endpoint ('' disables it)", group="proxy",
                           metavar="HOST:PORT")
    metrics_listen: str = opt("127.0.0.1:8090", "the proxy's own Prometheus /metrics ('' disables)",
                              group="proxy", metavar="HOST:PORT")
    # prefix-affinity by default: on shared prompt prefixes it cut TTFT p90 to 0.12x NGINX
    # least_conn's and raised output tokens/s 1.9x; without sharing it routes by load like
    # least-outstanding (bench/routing_bench.py, bench/README.md).
    lb_policy: str = opt("prefix-affinity", "routing: " + ", ".join(LB_POLICIES), group="proxy")
    # The C front by default (auto): the workers' native generations through it carried 2.5-4.5x the
    # events/s of the aiohttp workers on the 16-core machine and 0.885-0.999x NGINX's tiny requests/s
    # on the 2-core box, against aiohttp's 0.84x (bench/README.md, docs/measured.md). auto: where the
    # C module is not built (no compiler when setup.py ran) aiohttp serves every request, with a
    # warning; compiled: `up` refuses to start without it, for a deployment that counts on its rate.
    front: str = opt("auto", "what serves the embedded workers' native generate, generate_stream and infer "
                     "requests: auto (the compiled front where it is built, else aiohttp with a warning), "
                     "compiled (the relay in C, required: `up` refuses without it; every other request "
                     "stays aiohttp's), or aiohttp", group="proxy")
    trusted_proxy: tuple[str, ...] = opt((), "peer address whose X-Forwarded-For is kept (repeat)",
                                         group="proxy", repeat=True, metavar="ADDR")
    max_body_bytes: int = opt(64 * 1024 * 1024, "largest request body accepted", group="proxy",
                              metavar="BYTES")
    connect_timeout_s: float = opt(2.0, "upstream connect timeout", group="proxy", metavar="S")
    idle_timeout_s: float = opt(300.0, "longest silence between upstream chunks (not a total "
                                "timeout: long generations are not cut)", group="proxy", metavar="S")
    max_attempts: int = opt(3, "upstream attempts per request (retries only before any byte "
                            "reached the client)", group="proxy", metavar="N")
    client_header_timeout_s: float = opt(10.0, "a client must send a request's line and headers "
                                         "within this long (from connect, or from the first byte of a "
                                         "keep-alive request), else 408 and the connection is closed",
                                         group="proxy", metavar="S")
    client_body_timeout_s: float = opt(30.0, "a client must send a request's whole body within this "
                                       "long after its headers, else 408 and the connection is closed "
                                       "(nginx mode: the longest pause between two reads)",
                                       group="proxy", metavar="S")
    max_client_connections: int = opt(4096, "open client connections per listener of the embedded "
                                      "proxy; beyond it a new connection gets 503 and is closed",
                                      group="proxy", metavar="N")
    hold_s: float = opt(10.0, "when no instance is ready (a restart), hold requests this long for one "
                        "to become ready, then 503 (0: 503 at once)", group="proxy", metavar="S")
    max_held: int = opt(1024, "requests held at once while no instance is ready; beyond, 503",
                        group="proxy", metavar="N")
    first_byte_timeout_s: float = opt(0.0, "no response head from an instance within this: cancel and "
                                      "retry on another (only before any byte reached the client; 0: off)",
                                      group="proxy", metavar="S")
    allow_admin: bool = opt(False, "let Triton's admin API (load/unload, shared memory, trace, "
                            "logging, config, stats) through the proxy", group="proxy")
    nginx: str = opt("nginx", "nginx binary for --proxy nginx", group="proxy", metavar="PATH")

    # --- OpenAI-compatible API (orchestrator/dataplane/openai_frontend.py) ------------------
    openai: str = opt("on", "OpenAI-compatible API (/v1/models, /v1/completions, /v1/chat/completions) "
                      "on --listen: " + ", ".join(OPENAI_MODES), group="openai")
    openai_model: str = opt("", "Triton model the OpenAI API calls: the ensemble or tensorrt_llm_bls "
                            "(default: --served-model)", group="openai", metavar="NAME")
    openai_model_name: str = opt("", "model id that /v1/models shows and requests name "
                                 "(default: the --openai-model name)", group="openai", metavar="ID")
    chat_template: str = opt("", "jinja2 chat template for /v1/chat/completions (default: chat_template "
                             "of the tokenizer that the repository's preprocessing names)",
                             group="openai", metavar="FILE")
    tokenizer_dir: str = opt("", "tokenizer directory for the chat template and token counts (default: "
                             "the tokenizer_dir parameter of the repository's preprocessing config)",
                             group="openai", metavar="DIR")
    openai_max_tokens: int = opt(4096, "max_tokens of a chat completion that sets none "
                                 "(/v1/completions: OpenAI's default, 16)", group="openai", metavar="N")
    openai_listen: str = opt("", "the side workers' listener (data-plane processes beside a proxy that cannot "
                             "translate): --proxy nginx forwards /v1/ to it, and what no instance took "
                             "(default: loopback, a free port); --proxy none runs them only when set, "
                             "serving /v1/ alone (point a system NGINX's /v1/ at it)",
                             group="openai", metavar="HOST:PORT")

    # --- health -----------------------------------------------------------------
    probe_interval_s: float = opt(2.0, "active health probe period", group="health", metavar="S")
    probe_timeout_s: float = opt(1.0, "active health probe timeout", group="health", metavar="S")
    probe_failures: int = opt(3, "consecutive failed probes that make an instance unhealthy",
                              group="health", metavar="N")
    startup_timeout_s: float = opt(900.0, "deadline for an instance's first READY (model loads)",
                                   group="health", metavar="S")
    canary_interval_s: float = opt(30.0, "period of the canary inference (0 disables)",
                                   group="health", metavar="S")
    canary_idle_s: float = opt(5.0, "run the canary early once an instance has been idle this long",
                               group="health", metavar="S")
    canary_deadline_s: float = opt(10.0, "a canary that takes longer means a hung instance",
                                   group="health", metavar="S")
    canary_body: str = opt("", "JSON body of the canary generate request (default: 1-token generate)",
                           group="health", metavar="JSON")
    engine_poll_s: float = opt(0.1, "scrape each instance's engine metrics (TRT-LLM's families) this "
                               "often, for routing and stall detection (0 disables)", group="health", metavar="S")
    stall_after_s: float = opt(10.0, "an engine whose iteration counter stays frozen this long with "
                               "active requests is suspect: canary, then restart (0 disables)",
                               group="health", metavar="S")
    silent_after_s: float = opt(0.6, "an instance whose metrics port answers nothing this long (its "
                                "processes stopped, its node or the link to it gone) leaves rotation at "
                                "once; the requests waiting on it are retried on others, then a canary "
                                "decides (needs --engine-poll-s; 0 disables)", group="health", metavar="S")
    outlier_failures: int = opt(5, "consecutive proxy-seen failures that eject an instance",
                                group="health", metavar="N")
    backoff_initial_s: float = opt(1.0, "first restart delay after a repeat failure", group="health",
                                   metavar="S")
    backoff_max_s: float = opt(30.0, "cap on restart delay", group="health", metavar="S")
    stable_after_s: float = opt(60.0, "READY this long resets the backoff", group="health", metavar="S")
    max_failures: int = opt(5, "failures within --failure-window-s that make an instance FAILED",
                            group="health", metavar="N")
    failure_window_s: float = opt(600.0, "window for --max-failures", group="health", metavar="S")

    # --- service ----------------------------------------------------------------
    ready_min: int = opt(0, "instances READY before the service reports ready (0: all)",
                         group="service", metavar="N")
    detach: bool = opt(False, "run the daemon in the background; return once the endpoint is ready",
                       group="service")

    def __post_init__(self) -> None:
        # Validation here so a config file and flags get the same one-line errors.
        def positive(name: str, allow_zero: bool = False) -> None:
            v = getattr(self, name)
            if v < 0 or (v == 0 and not allow_zero):
                raise UsageError(flag(name), v, "must be " + ("zero or more" if allow_zero else "positive"))

        if self.tp < 1:
            raise UsageError("--tp", self.tp, "must be at least 1")
        if self.assume_gpus is not None and self.assume_gpus < 1:
            raise UsageError("--assume-gpus", self.assume_gpus, "must be at least 1")
        if not 1 <= self.base_port <= 65535:
            raise UsageError("--base-port", self.base_port, "must be a TCP port (1-65535)")
        for name in ("stop_grace_s", "probe_interval_s", "probe_timeout_s", "startup_timeout_s",
                     "canary_deadline_s", "connect_timeout_s", "idle_timeout_s", "max_body_bytes",
                     "probe_failures", "max_attempts", "max_failures", "failure_window_s",
                     "outlier_failures", "log_max_bytes", "client_header_timeout_s",
                     "client_body_timeout_s", "max_client_connections", "slurm_poll_s", "openai_max_tokens"):
            positive(name)
        for name in ("canary_interval_s", "canary_idle_s", "backoff_initial_s", "backoff_max_s",
                     "stable_after_s", "ready_min", "log_backups", "engine_poll_s", "stall_after_s",
                     "silent_after_s", "hold_s", "max_held", "first_byte_timeout_s"):
            positive(name, allow_zero=True)
        if self.bind_interface:
            if self.bind_address != "127.0.0.1":
                raise UsageError("--bind-interface", self.bind_interface, "use either it or --bind-address")
            if len(self.bind_interface) > 15 or not all(c.isalnum() or c in "._-@:" for c in self.bind_interface):
                raise UsageError("--bind-interface", self.bind_interface, "not an interface name")
        if self.topology and self.assume_gpus is not None:
            raise UsageError("--topology", self.topology, "use either it or --assume-gpus: both declare the GPUs")
        for name, allowed in (("proxy", PROXY_MODES), ("front", FRONTS), ("lb_policy", LB_POLICIES),
                              ("log_level", LOG_LEVELS),
                              ("placement", PLACEMENTS), ("cpu_affinity", CPU_AFFINITY),
                              ("launcher", LAUNCHERS), ("slurm_mpi", SLURM_MPI), ("openai", OPENAI_MODES)):
            if getattr(self, name) not in allowed:
                raise UsageError(flag(name), getattr(self, name), "must be one of " + ", ".join(allowed))
        if self.proxy_workers != "auto" and not (self.proxy_workers.isdigit()
                                                 and 1 <= int(self.proxy_workers) <= MAX_PROXY_WORKERS):
            raise UsageError("--proxy-workers", self.proxy_workers, f"must be auto or 1-{MAX_PROXY_WORKERS}")
        for name in ("listen", "grpc_listen", "metrics_listen", "openai_listen"):
            value = getattr(self, name)
            if value or name == "listen":
                parse_host_port(value, flag(name))
        if self.canary_body:
            try:
                body = json.loads(self.canary_body)
            except json.JSONDecodeError as exc:
                raise UsageError("--canary-body", self.canary_body, f"not JSON: {exc}") from None
            if not isinstance(body, dict):
                raise UsageError("--canary-body", self.canary_body, "must be a JSON object")
        if not self.tensorrt_llm_model or any(not m for m in self.tensorrt_llm_model):
            raise UsageError("--tensorrt-llm-model", ",".join(self.tensorrt_llm_model), "needs a model name")

    def public_addresses(self) -> dict[str, str]:
        """The data plane's public addresses as state.json records them: a data plane (workers,
        or a managed NGINX) is adopted by the next daemon only if its config asks for the same."""
        return {"listen": self.listen, "grpc_listen": self.grpc_listen, "metrics_listen": self.metrics_listen,
                "openai_listen": self.openai_listen}

    def worker_count(self, cpus: int | None = None) -> int:
        """--proxy-workers as a number. auto: a quarter of the CPUs, 1 to 16. One worker relays
        ~100k+ streamed tokens/s; the ranks (one busy core each), their Python-backend stubs and
        tokenizers and the OS need the rest of the host: a data plane on every core would
        take CPU from the ranks that keep the GPUs fed."""
        if self.proxy_workers != "auto":
            return int(self.proxy_workers)
        cpus = cpus if cpus is not None else len(os.sched_getaffinity(0))
        return max(1, min(16, cpus // 4))

    def resolved_state_dir(self) -> Path:
        if self.state_dir:
            return Path(self.state_dir).expanduser().absolute()
        return default_state_dir()



def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def default_state_dir() -> Path:
    if os.geteuid() == 0:
        return Path("/run/trtllm-orch")
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "trtllm-orch"
    return Path(f"/tmp/trtllm-orch-{os.geteuid()}")


def parse_host_port(value: str, field_name: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UsageError(field_name, value, "expected HOST:PORT, e.g. 0.0.0.0:8080")
    return host.strip("[]") or "0.0.0.0", int(port)


FIELDS = {f.name: f for f in dataclasses.fields(Settings)}

# What a reload (`trtllm-orch reload`, SIGHUP, `systemctl reload`) does with a changed field.
# Refused, with nothing changed: the GPU plan, the ports and sockets, the process layout.
NEEDS_DOWN_UP = ("gpus", "tp", "assume_gpus", "placement", "cpu_affinity", "topology", "base_port",
                 "bind_address", "bind_interface", "launcher", "state_dir", "proxy", "front", "listen", "grpc_listen",
                 "metrics_listen", "nginx", "detach",
                 # whether /v1/ exists and where the side workers listen: the proxies' layout
                 "openai", "openai_listen")
# Part of the launch command: each instance takes them when the rolling restart relaunches it.
APPLIED_AT_RELAUNCH = ("model_repo", "tensorrt_llm_model", "mpirun", "tritonserver", "tritonserver_arg",
                       "slurm_mpi", "srun_arg")
# Every other field (health, backoff, canary, proxy policy knobs, log level, the OpenAI model,
# name, template and tokenizer: re-read by the proxies at once) applies at once.


def reload_changes(old: Settings, new: Settings) -> list[str]:
    """The fields a reload changes; UsageError for the first one that needs `down` and `up`."""
    changed = [name for name in FIELDS if getattr(old, name) != getattr(new, name)]
    for name in changed:
        if name in NEEDS_DOWN_UP:
            raise UsageError(flag(name), _shown(getattr(new, name)),
                             f"cannot change on reload (running: {_shown(getattr(old, name))}); "
                             "needs `trtllm-orch down` and `up`")
    return changed


def _shown(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def _coerce(name: str, value: Any, source: str) -> Any:
    """Turn a TOML or flag value into the field's type, with a one-line error on mismatch."""
    f = FIELDS[name]
    default = f.default
    shown = flag(name) if source == "flag" else name.replace("_", "-")
    if f.metadata["repeat"]:
        items = value if isinstance(value, (list, tuple)) else [value]
        out: list[str] = []
        for item in items:
            if not isinstance(item, str):
                raise UsageError(shown, value, "expected a string or a list of strings")
            # Model names may come comma-separated; tritonserver args never are.
            out.extend(p for p in item.split(",") if p) if name == "tensorrt_llm_model" else out.append(item)
        return tuple(out)
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise UsageError(shown, value, "expected true or false")
        return value
    if isinstance(default, int) or name == "assume_gpus":
        if isinstance(value, bool) or not isinstance(value, int):
            try:
                return int(str(value), 10)
            except ValueError:
                raise UsageError(shown, value, "expected an integer") from None
        return value
    if isinstance(default, float):
        if isinstance(value, bool):
            raise UsageError(shown, value, "expected a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise UsageError(shown, value, "expected a number") from None
    if not isinstance(value, str):
        raise UsageError(shown, value, "expected a string")
    return value


def load_toml(path: str) -> dict[str, Any]:
    """Read a config file into field-name -> value, rejecting keys we do not know."""
    try:
        with open(path, "rb") as fh:
            raw = tomllib.load(fh)
    except FileNotFoundError:
        raise UsageError("--config", path, "file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError("--config", path, f"invalid TOML: {exc}") from None
    values: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in FIELDS or name == "detach":
            raise UsageError("config key", key, f"unknown key in {path}")
        values[name] = _coerce(name, value, "config")
    return values


def settings_to_json(settings: Settings) -> dict[str, Any]:
    """The settings as plain JSON (the data-plane workers' copy; the state dir's record)."""
    return dataclasses.asdict(settings)


def settings_from_json(data: dict[str, Any]) -> Settings:
    """The inverse of settings_to_json; fields this version does not know are dropped (a
    newer daemon may hand an older worker its settings during an upgrade)."""
    known: dict[str, Any] = {name: tuple(v) if isinstance(v, list) else v for name, v in data.items()
                             if name in FIELDS}
    return Settings(**known)


def build_settings(config_file: str | None, flags: dict[str, Any]) -> Settings:
    """defaults < config file < flags (flags holds only what the user actually gave)."""
    merged: dict[str, Any] = load_toml(config_file) if config_file else {}
    for name, value in flags.items():
        if value is not None:
            merged[name] = _coerce(name, value, "flag")
    return Settings(**merged)
