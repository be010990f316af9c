"""Data-plane scaling (issue 22): the endpoint's worker processes against NGINX, at equal
worker counts, on a many-core machine.

    python3 -m bench.dataplane_bench [--workers 1,2,4,8,12] [--seconds 8] [--out DIR]

Backends: SOURCES copies of bench/sse_source.c (32 events per stream, Triton
generate_stream shape, no gap: the engines are not the bottleneck). Targets, each fronting
the same sources:
  - embedded: the product's data plane, `controlplane.workers.WorkerPool` with W workers,
    exactly as `trtllm-orch up --proxy-workers W` starts it (shared listening socket,
    shared table and prefix index, the default routing policy), minus the daemon's
    instances: the ready set is the sources;
  - nginx: NGINX with W workers, the anchor's config (../shared/notes/dataplane-anchor.md:
    least_conn, upstream keep-alive, proxy_buffering off);
  - split: the design the issue asks to measure, not a product mode: NGINX with W workers
    carries the bytes, W Python deciders (bench/_route_decider.py: the product's balancer
    and default policy on the workers' shared table and prefix index) choose each route;
  - embedded-front: the product's workers with --front compiled (the C front of
    orchestrator/dataplane/front/ serving the native generations with the embedded path's rules);
    the sources' engine numbers published as the daemon publishes what it scrapes (Embedded), so
    the default decides on fresh snapshots as in a deployment; embedded-front-stale: the same
    without (every run before 2026-11-29: the default's stale path, our counts alone);
  - front-*: the compiled front of issue 22's plan as a bare relay, not a product mode: W processes relaying in
    C (orchestrator/dataplane/front/_front.c), deciding in C (front-c: least requests in flight) or calling
    the product's balancer and default policy once per request (front-py); front-py-loop is
    front-py driven by an asyncio loop (uvloop), as a data-plane worker would run it, and
    front-py-drain the same taking up to 16 batches of events per wakeup (front-py-lo: routing by
    least-outstanding instead of the default); front-full is front-py
    with the product's other per-request Python (headers, metrics) called from the front too;
    front-rules is front-py-drain with the rules the front keeps in C (front/compiled.py: header
    hygiene both ways, slow-client deadlines, hand-off of what is not its own).
Pinning: worker i of any proxy (and decider i) on core i (cores 0..W-1); the rest of the machine split
between the sources and wrk (4 threads at most). Past ~8 workers the sources have few cores
left: each row reports the sources' CPU use, and a row whose sources ran near their cores'
capacity measures the sources, not the relay.

Measures per W: SSE events/s (wrk, 256 streams), tiny-generate req/s (the same sources
answering one event: the smallest answer, 256 connections), relay CPU-seconds per 1k
events; at the default worker count: added time to first event over direct, p50/p99, at 1
and 256 concurrent streams (a raw-socket asyncio client, 10 ms per event); and a py-spy flame graph
of one worker under load. Writes <out>/dataplane_bench-<stamp>.{json,md,png,svg}.

Needs wrk, nginx and sse_source on PATH (../shared/tools/relay-kit packs them).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import gc
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import psutil  # noqa: E402

from bench.wrk import SseSource, cpu_seconds, run_wrk  # noqa: E402

SOURCES = 8
EVENTS = 32
CONNECTIONS = 256
STREAM_PATH = "/v2/models/ensemble/generate_stream"
QUESTION = "What is the capital of France?"


def body_of(prompt_chars: int = 0) -> bytes:
    """The request every client sends: the short question, or (--prompt-chars N) a tenant's system
    prompt of about N characters before it, as a deployment with shared system prompts sends: the
    default policy then parses it, hashes its chunks and finds its holder in the shared index."""
    head = ""
    if prompt_chars > 0:
        line = "You are the support assistant of one tenant; answer in its voice and briefly. "
        head = (line * (prompt_chars // len(line) + 1))[:prompt_chars]
    return json.dumps({"text_input": head + QUESTION, "max_tokens": EVENTS, "stream": True,
                       "bad_words": "", "stop_words": ""}).encode()


BODY = body_of()  # main sets it from --prompt-chars


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def pin(pid: int, cpus: list[int]) -> None:
    """Every thread of `pid` on `cpus` (sched_setaffinity of a pid moves one thread only)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass


def layout(workers: int, ncpu: int) -> tuple[list[int], list[int], list[int]]:
    """(relay cores, source cores, wrk cores) for W workers."""
    relay = list(range(workers))
    rest = list(range(workers, ncpu)) or [ncpu - 1]
    # wrk: 4 threads on the 16-core machine; 8 where many cores are left (a 64-core host at 12
    # workers relays a few million events/s, more than 4 wrk threads read)
    nwrk = max(1, min(4 if len(rest) < 32 else 8, len(rest) // 2))
    return relay, (rest[:-nwrk] or rest), rest[-nwrk:]


# --- sources ------------------------------------------------------------------------------------
class Sources:
    def __init__(self, n: int, events: int, gap_us: int, procs: int = 1) -> None:
        self.items = [SseSource(events, gap_us, procs) for _ in range(n)]

    def __enter__(self) -> "Sources":
        for s in self.items:
            s.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        for s in self.items:
            s.stop()

    @property
    def ports(self) -> list[int]:
        return [s.port for s in self.items]

    @property
    def pids(self) -> list[int]:
        return [p.pid for s in self.items for p in s.procs]

    def pin(self, cpus: list[int]) -> None:
        for i, pid in enumerate(self.pids):
            pin(pid, [cpus[i % len(cpus)]])


# --- targets --------------------------------------------------------------------------------
def shared_routing_files(directory: Path) -> tuple[Any, Any]:
    """The workers' shared in-flight table and prefix index in `directory`, created zeroed as the
    daemon makes them for its workers (the Python deciders of split and front-* open them)."""
    from orchestrator.dataplane.shared_prefix import SharedPrefixIndex
    from orchestrator.dataplane.shared_table import SharedTable
    return SharedTable.create(directory / "table"), SharedPrefixIndex.create(directory / "prefixes")


def wait_ready(procs: list[subprocess.Popen], paths: list[Path], what: str, timeout_s: float = 30.0) -> None:
    """Until every one of `paths` exists (each process writes its own once it listens); a
    RuntimeError if any of `procs` exits first or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a {what} did not start")
        time.sleep(0.05)


def stop_all(procs: list[subprocess.Popen]) -> None:
    """SIGTERM to every one still running, then wait for each (10 s, then SIGKILL)."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


class Nginx:
    """NGINX with W workers relaying to the sources: the anchor's config
    (../shared/notes/dataplane-anchor.md: least_conn, upstream keep-alive, no buffering)."""

    def __init__(self, workers: int, ports: list[int], port: int) -> None:
        self.prefix = Path(tempfile.mkdtemp(prefix="bench-dp-nginx-"))
        self.prefix.chmod(0o755)  # workers run as nobody when the master is root
        for d in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (self.prefix / d).mkdir()
        self.workers = workers
        self.port = port
        self.proc: subprocess.Popen | None = None
        servers = "".join(f"server 127.0.0.1:{p};" for p in ports)
        self._write_conf("access_log off;\n"
                         f"  upstream llm {{ least_conn; {servers} keepalive 256; }}\n",
                         "location / { proxy_pass http://llm; proxy_http_version 1.1; "
                         "proxy_set_header Connection \"\";\n"
                         "      proxy_buffering off; proxy_request_buffering off; }")

    def _write_conf(self, http: str, locations: str) -> None:
        masks = " ".join("1" + "0" * i for i in range(self.workers))
        temps = "".join(f"{d}_temp_path {self.prefix / d};" for d in ("client_body", "proxy", "fastcgi", "uwsgi",
                                                                         "scgi"))
        (self.prefix / "nginx.conf").write_text(
            f"worker_processes {self.workers}; worker_cpu_affinity {masks}; worker_rlimit_nofile 65536;\n"
            f"pid {self.prefix}/nginx.pid;\n"
            "events { worker_connections 16384; multi_accept on; }\n"
            f"http {{ {temps}\n  {http}"
            f"  server {{ listen 127.0.0.1:{self.port} reuseport backlog=4096;\n    {locations} }} }}\n")

    def __enter__(self) -> "Nginx":
        self.proc = subprocess.Popen(["nginx", "-e", str(self.prefix / "error.log"), "-p", str(self.prefix),
                                      "-c", str(self.prefix / "nginx.conf"), "-g", "daemon off;"],
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        from bench.common import wait_port
        wait_port(self.port, proc=self.proc)
        return self

    def pids(self) -> list[int]:
        assert self.proc is not None
        return [c.pid for c in psutil.Process(self.proc.pid).children()]

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        shutil.rmtree(self.prefix, ignore_errors=True)


class Split(Nginx):
    """The split design: NGINX carries the bytes, Python decides the route
    (bench/_route_decider.py says how). W NGINX workers and W deciders share W cores: worker
    i and decider i on core i, the same cores the other targets get. Every request is two
    hops through NGINX (to a decider and back, then to the instance); every answer is one
    access-log datagram to the decider whose route it was, which releases its count."""

    def __init__(self, workers: int, ports: list[int], port: int) -> None:
        super().__init__(workers, ports, port)
        from orchestrator.config import Settings
        self.state = self.prefix / "state"
        self.state.mkdir()
        self._table, self._prefixes = shared_routing_files(self.state)
        self.policy = Settings().lb_policy
        socks = [self.prefix / f"route-{k}.sock" for k in range(workers)]
        self._deciders_argv = [
            [sys.executable, "-m", "bench._route_decider", "--state", str(self.state), "--slot", str(k),
             "--sock", str(socks[k]), "--done", str(self.prefix / f"done-{k}.sock"),
             "--ports", ",".join(map(str, ports)), "--policy", self.policy] for k in range(workers)]
        self.deciders: list[subprocess.Popen] = []
        maps = "".join(f"  map $upstream_addr $done{k} {{ \"~^unix:{sock} \" 1; default 0; }}\n"
                       for k, sock in enumerate(socks))
        logs = "".join(f"  access_log syslog:server=unix:{self.prefix}/done-{k}.sock,nohostname done "
                       f"if=$done{k};\n" for k in range(workers))
        routes = "".join(f"server unix:{sock};" for sock in socks)
        instances = "".join(f"  upstream i{i} {{ server 127.0.0.1:{p}; keepalive 64; }}\n"
                            for i, p in enumerate(ports))
        named = "".join(f"location @i{i} {{ proxy_pass http://i{i}; proxy_http_version 1.1; "
                        "proxy_set_header Connection \"\"; proxy_buffering off; }\n    "
                        for i in range(len(ports)))
        self._write_conf("log_format done '$upstream_addr';\n" + maps + logs +
                         f"  upstream route {{ {routes} keepalive 256; }}\n" + instances,
                         # The whole body is read before the decider sees it (it routes on
                         # the prompt) and kept in memory for the replay to the instance.
                         "location / { proxy_pass http://route; proxy_http_version 1.1; "
                         "proxy_set_header Connection \"\"; client_body_buffer_size 64k; }\n    " + named)

    def __enter__(self) -> "Split":
        for argv in self._deciders_argv:
            self.deciders.append(subprocess.Popen(argv, cwd=REPO, stdin=subprocess.DEVNULL,
                                                  start_new_session=True))
        try:
            wait_ready(self.deciders, [Path(a[a.index("--done") + 1]) for a in self._deciders_argv], "route decider")
        except RuntimeError:
            self.__exit__()
            raise
        super().__enter__()
        return self

    def pids(self) -> list[int]:
        # worker i and decider i: `measure` pins the i-th pid on relay core i % W
        return super().pids() + [d.pid for d in self.deciders]

    def __exit__(self, *exc: Any) -> None:
        stop_all(self.deciders)
        super().__exit__(*exc)  # NGINX, then its prefix (the state and sockets in it)


# The engine numbers the daemon's monitor would publish for each source (Embedded.engine_numbers),
# every SCRAPE_S as the daemon scrapes: a TRT-LLM engine of SLOTS batch slots running every request
# sent there (a source serves them all at once), with a KV cache half full.
SCRAPE_S = 0.1
SLOTS = 256


class Embedded:
    """The product's WorkerPool on its own event loop thread (wrk runs beside it).

    With `engine_numbers` (the default; --no-engine-numbers: the runs before 2026-11-29) each
    source's engine snapshots are published as the daemon publishes what its engine monitor
    scrapes, with every worker's count (`routed`): the workers' policy decides on fresh snapshots,
    as it does in a deployment of TRT-LLM engines. Without, the sources export no TRT-LLM metrics
    and every decision takes the stale path (ours alone: llm_policies._counted)."""

    front = "aiohttp"  # --front (the product's default is auto, the C front where built: EmbeddedFront)
    policy: str | None = None  # --lb-policy (None: the default)
    engine_numbers = True  # main's --no-engine-numbers

    def __init__(self, workers: int, ports: list[int], port: int) -> None:
        from orchestrator.config import Settings
        from orchestrator.health.engine_state import EngineView
        from orchestrator.routing.backends import Backend, ReadyBackends
        self.settings = Settings(listen=f"127.0.0.1:{port}", grpc_listen="", metrics_listen="",
                                 proxy_workers=str(workers), log_level="warning", front=self.front,
                                 **({"lb_policy": self.policy} if self.policy else {}))
        self.backends = ReadyBackends()
        self.backends.publish(tuple(Backend(str(i), "127.0.0.1", p, p, p,
                                            engine=EngineView() if self.engine_numbers else None)
                                    for i, p in enumerate(ports)))
        self.state = Path(tempfile.mkdtemp(prefix="bench-dp-state-"))
        self.port = port
        self.loop = asyncio.new_event_loop()
        self.pool: Any = None
        self._scrapes: Any = None  # the engine monitor's stand-in (a future on self.loop), this object's

    def __enter__(self) -> "Embedded":
        import threading
        from orchestrator.controlplane.workers import WorkerPool
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.pool = WorkerPool(self.settings, self.backends, self.state, logging.getLogger("bench.dataplane"))
        asyncio.run_coroutine_threadsafe(self.pool.start(), self.loop).result(60)
        if self.engine_numbers:
            self._scrapes = asyncio.run_coroutine_threadsafe(self._scrape(), self.loop)
        return self

    async def _scrape(self) -> None:
        """Every SCRAPE_S, each source's engine as a TRT-LLM engine would report it: what the pool
        has in flight there is active (the pool publishes it to the workers with `routed`)."""
        from orchestrator.health.engine_state import EngineSnapshot
        k = 0
        while True:
            inflight = self.pool.inflight()
            now = time.monotonic()
            for b in self.backends.current():
                n = inflight.get(b.instance_id, 0)
                b.engine.update(EngineSnapshot(at=now, active=n, max_active=SLOTS, scheduled=n, kv_max=4096,
                                               kv_used=2048, kv_free=2048, tokens_per_block=64,
                                               iteration=float(k), timestamp_us=int(now * 1e6)))
            k += 1
            await asyncio.sleep(SCRAPE_S)

    def pids(self) -> list[int]:
        return self.pool.pids()

    def complaints(self, limit: int = 8) -> list[str]:
        """The workers' last warning and error lines: why answers were not 2xx."""
        lines = []
        for log_file in sorted((self.state / "dataplane").glob("worker-*.log")):
            lines += [ln for ln in log_file.read_text(errors="replace").splitlines()
                      if " WARNING " in ln or " ERROR " in ln]
        return lines[-limit:]

    def __exit__(self, *exc: Any) -> None:
        if self._scrapes is not None:
            self._scrapes.cancel()
        asyncio.run_coroutine_threadsafe(self.pool.stop(2.0), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        shutil.rmtree(self.state, ignore_errors=True)


class EmbeddedFront(Embedded):
    """The product's workers with --front compiled: the native generations served by the C front
    with the embedded path's rules (front/path.py), everything else by aiohttp."""

    front = "compiled"


class EmbeddedFrontStale(EmbeddedFront):
    """The same with no engine numbers for the sources (every run before 2026-11-29): the default
    decides on its stale path (our counts alone), where instances export no TRT-LLM metrics."""

    engine_numbers = False


class EmbeddedFrontRoundRobin(EmbeddedFront):
    """The same with --lb-policy round-robin: what a cheap decision buys (the default's pick,
    prompt parse and hints are about 13 us of a 17 us decision on the 2-core box; round-robin's
    whole decision about 4 us)."""

    policy = "round-robin"


class CompiledFront:
    """The compiled front (orchestrator/dataplane/front/_front.c): W processes, each its own SO_REUSEPORT socket
    on the port as NGINX's workers here, relaying in C. `decide`: "c" (least requests in flight in
    C) or "python" (the product's balancer and default policy called per request from C, on the
    workers' shared table and prefix index, as the split's deciders)."""

    decide = "c"
    policy = ""  # the Python route's policy: the product's default where empty
    loop = "c"  # "asyncio": a uvloop loop drives the front (poll() when its epoll fd is readable)
    rules = False  # the product's rules (front/compiled.py: hand-off, header hygiene, deadlines)

    def __init__(self, workers: int, ports: list[int], port: int) -> None:
        from bench._compiled_front import load
        load()  # built by setup.py, or a clear error now rather than W failed workers
        self.port = port
        self.dir = Path(tempfile.mkdtemp(prefix="bench-dp-front-"))
        argv = [sys.executable, "-m", "bench._compiled_front", "--port", str(port),
                "--ports", ",".join(map(str, ports)), "--decide", self.decide, "--loop", self.loop,
                *(["--handoff"] if self.rules else [])]
        if self.decide != "c":
            from orchestrator.config import Settings
            self._table, self._prefixes = shared_routing_files(self.dir)
            argv += ["--state", str(self.dir), "--policy", self.policy or Settings().lb_policy]
        self._argv = [argv + ["--slot", str(k), "--ready", str(self.dir / f"ready-{k}")] for k in range(workers)]
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> "CompiledFront":
        self.procs = [subprocess.Popen(a, cwd=REPO, stdin=subprocess.DEVNULL, start_new_session=True)
                      for a in self._argv]
        try:  # every worker's socket, not the first's
            wait_ready(self.procs, [Path(a[-1]) for a in self._argv], "compiled front worker")
        except RuntimeError:
            self.__exit__()
            raise
        return self

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def __exit__(self, *exc: Any) -> None:
        stop_all(self.procs)
        shutil.rmtree(self.dir, ignore_errors=True)


class CompiledFrontPython(CompiledFront):
    decide = "python"


class CompiledFrontOnLoop(CompiledFrontPython):
    """front-py as a data-plane worker would run it: on the worker's asyncio loop (uvloop)."""

    loop = "asyncio"


class CompiledFrontOnLoopDrained(CompiledFrontPython):
    """front-py-loop taking up to 16 batches of ready events per wakeup of the loop."""

    loop = "asyncio-drain"


class CompiledFrontLeastOutstanding(CompiledFrontOnLoopDrained):
    """front-py-drain routing by least-outstanding: the shared in-flight table alone, no prefix
    index and no turns' stamps written per request (is the shared state what limits scaling?)."""

    policy = "least-outstanding"


class CompiledFrontWithRules(CompiledFrontOnLoopDrained):
    """front-py-drain keeping the product's rules in C: header hygiene both ways (headers.py's
    tables), slow-client deadlines, and the hand-off of every request that is not its own."""

    rules = True


class CompiledFrontFullRules(CompiledFront):
    """front-py with the product's other per-request Python too (headers, metrics): what a front
    that keeps every rule in Python would pay (bench/_compiled_front.py, `_full_rules`)."""

    decide = "python-full"


# nginx first: the anchor every row is divided by. split, front-c and front-py: designs issue 22
# asks to measure beside the product (NGINX carries the bytes and Python decides the route; a
# compiled relay deciding in C, or calling the product's Python policy), not product modes.
TARGETS: tuple[tuple[str, Any], ...] = (("nginx", Nginx), ("embedded", Embedded),
                                        ("embedded-front", EmbeddedFront),
                                        ("embedded-front-stale", EmbeddedFrontStale),
                                        ("embedded-front-rr", EmbeddedFrontRoundRobin),
                                        ("split", Split),
                                        ("front-c", CompiledFront), ("front-py", CompiledFrontPython),
                                        ("front-py-loop", CompiledFrontOnLoop),
                                        ("front-py-drain", CompiledFrontOnLoopDrained),
                                        ("front-py-lo", CompiledFrontLeastOutstanding),
                                        ("front-rules", CompiledFrontWithRules),
                                        ("front-full", CompiledFrontFullRules))
STYLES = (("embedded", "o-"), ("embedded-front", "o-."), ("embedded-front-stale", "d-."), ("embedded-front-rr", "o:"),
          ("split", "^-"),
          ("front-c", "v-"), ("front-py", "D-"), ("front-py-loop", "x-"),
          ("front-py-drain", "+-"), ("front-py-lo", "<-"), ("front-rules", ">-"), ("front-full", "*-"),
          ("nginx", "s--"))
# the designs measured beside the product, each divided by NGINX in its own columns
DESIGNS = ("embedded-front", "embedded-front-stale", "embedded-front-rr", "split", "front-c", "front-py",
           "front-py-loop", "front-py-drain", "front-py-lo", "front-rules", "front-full")


# --- one measurement ------------------------------------------------------------------------------
def measure(target: Any, cores: tuple[list[int], list[int], list[int]], sources: Sources, seconds: float,
            events_per_answer: int) -> dict[str, Any]:
    relay, src_cores, wrk_cores = cores
    for i, pid in enumerate(target.pids()):
        pin(pid, [relay[i % len(relay)]])
    url = f"http://127.0.0.1:{target.port}{STREAM_PATH}"
    run_wrk(url, BODY, connections=CONNECTIONS, seconds=1, threads=len(wrk_cores), cpus=tuple(wrk_cores))  # warm
    pids = target.pids()
    c0, s0 = cpu_seconds(pids), cpu_seconds(sources.pids)
    res = run_wrk(url, BODY, connections=CONNECTIONS, seconds=seconds, threads=len(wrk_cores),
                  cpus=tuple(wrk_cores))
    cpu, src_cpu = cpu_seconds(pids) - c0, cpu_seconds(sources.pids) - s0
    events = res["requests"] * events_per_answer
    dur = res["duration_s"] or seconds
    why = target.complaints() if res["failed"] and hasattr(target, "complaints") else []
    return {"rps": res["rps"], "events_per_s": round(events / dur), "failed": res["failed"], "errors": res["errors"],
            **({"why_failed": why} if why else {}),
            "p50_ms": res["p50_ms"], "p99_ms": res["p99_ms"],
            "cpu_s_per_1k_events": round(1000 * cpu / events, 4) if events else None,
            "relay_cores_busy": round(cpu / dur, 2),
            "source_cores_busy": round(src_cpu / dur / len(src_cores), 2)}


def scaling(workers: list[int], seconds: float, ncpu: int, events: int, source_procs: int = 1) -> dict[str, Any]:
    from bench.common import free_port
    rows: dict[str, dict[str, Any]] = {}
    for w in workers:
        cores = layout(w, ncpu)
        with Sources(SOURCES, events, 0, source_procs) as sources:
            sources.pin(cores[1])
            for name, cls in TARGETS:
                with cls(w, sources.ports, free_port()) as target:
                    r = measure(target, cores, sources, seconds, events)
                dead = [s.port for s in sources.items if s.dead]
                if dead:  # a row measured on fewer sources than the others is not comparable
                    raise RuntimeError(f"sse_source on port(s) {dead} died during the {name} row")
                rows.setdefault(name, {})[str(w)] = r
                log(f"events={events} W={w} {name}: {r}")
    return rows


def ttft(workers: int, seconds: float, ncpu: int, counts: tuple[int, ...] = (1, 256)) -> dict[str, Any]:
    """Added time to first event over direct: 1 and 256 concurrent streams, 10 ms per event."""
    from bench.common import free_port
    out: dict[str, Any] = {"workers": workers, "event_gap_ms": 10, "events": 16}
    cores = layout(workers, ncpu)
    with Sources(SOURCES, 16, 10_000) as sources:
        sources.pin(cores[1])
        direct = [f"http://127.0.0.1:{p}{STREAM_PATH}" for p in sources.ports]
        for streams in counts:
            row = {"direct": _ttft(direct, streams, seconds, cores[2])}
            for name, cls in TARGETS:
                with cls(workers, sources.ports, free_port()) as target:
                    for i, pid in enumerate(target.pids()):
                        pin(pid, [cores[0][i % len(cores[0])]])
                    row[name] = _ttft([f"http://127.0.0.1:{target.port}{STREAM_PATH}"], streams, seconds, cores[2])
            for name, _ in TARGETS:
                for p in ("p50_ms", "p99_ms", "p99_warm_ms"):
                    if row[name].get(p) is not None and row["direct"].get(p) is not None:
                        row[name]["added_" + p] = round(row[name][p] - row["direct"][p], 3)
            out[f"streams_{streams}"] = row
            keys = ("p50_ms", "p99_ms", "added_p50_ms", "added_p99_ms", "added_p99_warm_ms")
            log(f"ttft {streams} streams: " + json.dumps({k: {x: v.get(x) for x in keys} for k, v in row.items()}))
    return out


def _ttft(urls: list[str], streams: int, seconds: float, cpus: list[int]) -> dict[str, Any]:
    os.sched_setaffinity(0, cpus)
    # The client's own collector off while it times: a full collection of this process (the bench
    # and its Embedded target's pool) took 20-55 ms on the 16-core machine, and one landing in a
    # row would stall its 256 streams at once, whichever target was measured then. (With it off,
    # the front's p99 at 256 streams stayed +21-25 ms: that tail is the workers', not the client's.)
    gc.collect()
    gc.disable()
    try:
        return asyncio.run(raw_ttft([int(u.split(":")[2].split("/")[0]) for u in urls], streams, seconds))
    finally:
        gc.enable()
        os.sched_setaffinity(0, range(os.cpu_count() or 1))


async def raw_ttft(ports: list[int], streams: int, seconds: float) -> dict[str, Any]:
    """`streams` keep-alive connections, each a closed loop of streams; TTFT = request
    written to the first `data:` byte read. Raw sockets, not an HTTP client library: at one
    stream aiohttp's client added more than the hop it measured (1.8 ms against 0.24 ms).
    `p99_warm_ms` leaves out each connection's first request (its accept by the relay and the
    relay's first connection to the instance: at 256 streams, 256 of a few thousand samples)."""
    req_tail = (f"Content-Type: application/json\r\nContent-Length: {len(BODY)}\r\n\r\n").encode() + BODY
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    ttft: list[float] = []
    warm: list[float] = []  # each connection's requests after its first
    failed = 0

    async def one(i: int) -> None:
        nonlocal failed
        port = ports[i % len(ports)]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        req = f"POST {STREAM_PATH} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n".encode() + req_tail
        answered = False  # this connection's first request is behind it
        try:
            while loop.time() < deadline:
                t0 = time.perf_counter()
                writer.write(req)
                buf = b""
                first = None
                while not buf.endswith(b"0\r\n\r\n"):
                    data = await reader.read(65536)
                    if not data:
                        failed += 1
                        return
                    buf = buf[-16:] + data if first is not None else buf + data
                    if first is None and b"data:" in buf:
                        first = (time.perf_counter() - t0) * 1000
                if first is None or not buf:
                    failed += 1
                else:
                    if answered:
                        warm.append(first)
                    answered = True
                    ttft.append(first)
        finally:
            writer.close()

    await asyncio.gather(*(one(i) for i in range(streams)))
    from bench.common import pct
    return {"n": len(ttft), "failed": failed, "p50_ms": pct(ttft, 50), "p90_ms": pct(ttft, 90),
            "p99_ms": pct(ttft, 99), "p99_warm_ms": pct(warm, 99)}


def profile(out_dir: Path, stamp: str, seconds: float, ncpu: int, front: bool = False) -> str | None:
    """A py-spy flame graph of one worker relaying streams (W=1); `front`: the worker of
    --front compiled, its C frames too (--native)."""
    from bench.common import free_port
    spy = shutil.which("py-spy")
    if spy is None:
        log("py-spy not found: no flame graph")
        return None
    cores = layout(1, ncpu)
    svg = out_dir / f"dataplane_bench-{stamp}-{'front-' if front else ''}worker.svg"
    with Sources(SOURCES, EVENTS, 0) as sources:
        sources.pin(cores[1])
        with (EmbeddedFront if front else Embedded)(1, sources.ports, free_port()) as target:
            pid = target.pids()[0]
            pin(pid, [0])
            url = f"http://127.0.0.1:{target.port}{STREAM_PATH}"
            spy_proc = subprocess.Popen([spy, "record", "-p", str(pid), "-d", str(int(seconds)), "-r", "200",
                                         "-o", str(svg), "-f", "flamegraph",
                                         *(["--native"] if front else ["--nonblocking"])],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            run_wrk(url, BODY, connections=CONNECTIONS, seconds=seconds, threads=len(cores[2]), cpus=tuple(cores[2]))
            _, err = spy_proc.communicate(timeout=60)
            if spy_proc.returncode != 0:
                log(f"py-spy failed: {err.decode()[-300:]}")
                return None
    return svg.name


# --- report ---------------------------------------------------------------------------------------
def ratios(rows: dict[str, Any], key: str, target: str = "embedded") -> dict[str, float | None]:
    out = {}
    for w, e in rows.get(target, {}).items():
        n = rows["nginx"].get(w, {}).get(key)
        out[w] = round(e[key] / n, 3) if n else None
    return out


def _present(result: dict[str, Any], key: str) -> list[str]:
    """The designs measured in this run's `key` rows (older runs: none, or only split)."""
    return [d for d in DESIGNS if d in result[key]]


def _stream_table(result: dict[str, Any], key: str, events: int) -> list[str]:
    procs = result.get("source_procs", 1)
    backends = f"{result.get('sources', SOURCES)} sse_source backends" + (
        f" of {procs} processes each" if procs > 1 else "")
    names = ["embedded", *_present(result, key), "nginx"]
    short = " / ".join(n.replace("embedded", "emb") for n in names)
    lines = [f"## SSE events/s (wrk, 256 streams x {events} events, {backends})", "",
             "| workers | " + " | ".join(f"{n} ev/s" for n in names) + " | " +
             " | ".join(f"{n} / nginx" for n in names[:-1]) +
             f" | CPU-s/1k ev {short} | p99 ms {short} | sources busy {short} |",
             "|---|" + "---|" * (2 * len(names) + 2)]
    st = result[key]
    for w in st["embedded"]:
        rows = [st.get(n, {}).get(w, {}) for n in names]
        ratio = [result[key + "_ratio"][w]] + [result.get(f"{key}_{d}_ratio", {}).get(w) for d in names[1:-1]]
        lines.append(f"| {w} | " + " | ".join(f"{r.get('events_per_s', 0):,}" for r in rows) + " | " +
                     " | ".join(str(x) for x in ratio) + " | " +
                     " | ".join(" / ".join(str(r.get(f)) for r in rows)
                                for f in ("cpu_s_per_1k_events", "p99_ms", "source_cores_busy")) + " |")
    return lines


def _engine_numbers(result: dict[str, Any]) -> str:
    if result.get("engine_numbers"):
        return f"published every {SCRAPE_S:g} s as the daemon's monitor does (the policy's fresh path)"
    return "none (the policy's stale path: ours alone)"


def report(result: dict[str, Any]) -> str:
    prompt = (f"a {result['prompt_chars']}-character tenant prompt + a question ({result['body_bytes']}-byte body)"
              if result.get("prompt_chars") else "a short question (shorter than one prefix chunk)")
    lines = [f"# dataplane_bench {result['stamp']}", "", f"Machine: {result['machine']}; workers' event loop: "
             f"{result.get('event_loop', 'not recorded')}; every request: {prompt}; the sources' engine "
             f"numbers: {_engine_numbers(result)}", ""]
    lines += _stream_table(result, "stream", result["events_per_stream"])
    if result.get("stream_long"):
        lines += [""] + _stream_table(result, "stream_long", result["long_events_per_stream"])
    tiny = result["tiny"]
    designs = _present(result, "tiny")
    names = ["embedded", *designs, "nginx"]
    lines += ["", "## Tiny generate req/s (one-event answers, 256 connections)", "",
              "| workers | " + " | ".join(f"{n} req/s" for n in names) + " | " +
              " | ".join(f"{n} / nginx" for n in names[:-1]) + " |",
              "|---|" + "---|" * (2 * len(names) - 1)]
    for w in tiny["embedded"]:
        ratio = [result["tiny_ratio"][w]] + [result.get(f"tiny_{d}_ratio", {}).get(w) for d in designs]
        lines.append(f"| {w} | " + " | ".join(f"{tiny[n][w]['rps']:,}" for n in names) + " | " +
                     " | ".join(str(x) for x in ratio) + " |")
    if result.get("ttft"):
        t = result["ttft"]
        lines += ["", f"## Added time to first event over direct ({t['workers']} workers, 10 ms per event)", "",
                  "| streams | target | p50 ms | p99 ms | added p50 | added p99 | added p99, warm |",
                  "|---|---|---|---|---|---|---|"]
        for streams in ("streams_1", "streams_256"):
            for name, r in t[streams].items():
                lines.append(f"| {streams.split('_')[1]} | {name} | {r['p50_ms']} | {r['p99_ms']} | "
                             f"{r.get('added_p50_ms', '')} | {r.get('added_p99_ms', '')} | "
                             f"{r.get('added_p99_warm_ms', '')} |")
    failed = [(key, name, w, r) for key in ("stream", "stream_long", "tiny") if result.get(key)
              for name, rows in result[key].items() for w, r in rows.items() if r["failed"]]
    if failed:
        lines += ["", "## Answers that were not 2xx", ""]
        for key, name, w, r in failed:
            of = f" of {round(r['rps'] * result['seconds'])}" if "seconds" in result else ""  # older runs: no length
            whys = "".join(f"\n  - `{why[-200:]}`" for why in r.get("why_failed", []))
            lines.append(f"- {key}, {name}, {w} workers: {r['failed']}{of} ({r.get('errors', 'not recorded')})" + whys)
    lines += ["", "## Goals", ""] + [f"- {k}: {v}" for k, v in result["goals"].items()]
    return "\n".join(lines) + "\n"


def goals(result: dict[str, Any]) -> dict[str, Any]:
    # The product's default is the compiled front (embedded-front) where it was measured; `embedded`
    # is the workers with --front aiohttp (the default before 2026-11-28's fourteenth session).
    product = "embedded-front" if "embedded-front" in result["stream"] else "embedded"
    best = max(r["events_per_s"] for r in result["stream"][product].values())
    g: dict[str, Any] = {f"max {product} events/s >= 250k": f"{best:,} {'MET' if best >= 250_000 else 'MISSED'}"}
    for w, r in result["stream_ratio"].items():
        g[f"(--front aiohttp) embedded/nginx events at {w} workers >= 1.0 (floor 0.85)"] = r
    for d in _present(result, "stream"):
        for w, r in (result.get(f"stream_{d}_ratio") or {}).items():
            what = {"embedded-front": "the product's default, --front compiled",
                    "embedded-front-rr": "the product's default front, --lb-policy round-robin"}.get(
                        d, "design measured, not the product")
            g[f"({what}) {d}/nginx events at {w} workers >= 1.0 (floor 0.85)"] = r
    for name in dict.fromkeys((product, "embedded", "nginx")):
        rows = result["stream"].get(name, {})
        if "1" in rows and "8" in rows:
            s = round(rows["8"]["events_per_s"] / rows["1"]["events_per_s"], 2)
            g[f"{name}: 1 -> 8 workers >= 6x"] = f"{s}x {'MET' if s >= 6 else 'MISSED'}"
    t = result.get("ttft") or {}
    if t:
        for name in ("embedded", "embedded-front"):
            if name in t["streams_1"]:
                g[f"{name}: added TTFT p50 at 1 stream <= 0.3 ms"] = t["streams_1"][name].get("added_p50_ms")
    return g


def plot(result: dict[str, Any], plt: Any) -> Any:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    panels = [("stream", f", {result['events_per_stream']}-event streams", "")]
    if result.get("stream_long"):
        panels.append(("stream_long", f", {result['long_events_per_stream']}-event streams", ":"))
    for key, suffix, dotted in panels:
        for name, style in STYLES:
            if name not in result[key]:
                continue
            rows = result[key][name]
            ws = [int(w) for w in rows]
            axes[0].plot(ws, [rows[str(w)]["events_per_s"] for w in ws], style[0] + (dotted or style[1:]),
                         label=name + suffix)
    for name, style in STYLES:
        if name not in result["tiny"]:
            continue
        rows = result["tiny"][name]
        ws = [int(w) for w in rows]
        axes[1].plot(ws, [rows[str(w)]["rps"] for w in ws], style, label=name)
    for ax, title in ((axes[0], "SSE events/s"), (axes[1], "tiny generate req/s")):
        ax.set_xlabel("workers")
        ax.set_ylabel(title)
        ax.set_title(title + " against workers")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"dataplane_bench {result['stamp']}: {result['machine']}", fontsize=9)
    fig.tight_layout()
    return fig


def _event_loop() -> str:
    try:
        import uvloop  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        return "asyncio (uvloop not installed: slower than a real install)"
    return "uvloop"


def main(argv: list[str] | None = None) -> int:
    global TARGETS, BODY
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="1,2,4,8,12")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--ttft-seconds", type=float, default=5.0)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--profile-front", action="store_true",
                    help="profile the worker of --front compiled (with its C frames), not aiohttp's")
    ap.add_argument("--targets", default=",".join(name for name, _ in TARGETS),
                    help="a subset of " + ", ".join(name for name, _ in TARGETS))
    ap.add_argument("--long-events", type=int, default=0,
                    help="also measure streams of this many events (per-event relay cost, less per-request)")
    ap.add_argument("--source-procs", type=int, default=1,
                    help="processes per source (one port, SO_REUSEPORT) in the scaling rows: a source is one "
                         "core's worth (~250k events/s), so 8 of them cap a relay with many workers; "
                         "4 on a 64-core host")
    ap.add_argument("--prompt-chars", type=int, default=0,
                    help="a tenant's system prompt of this many characters before every request's question "
                         "(0: the short question alone, shorter than one prefix chunk)")
    ap.add_argument("--no-engine-numbers", action="store_true",
                    help="publish no engine snapshots for the sources (as the runs before 2026-11-29): every "
                         "decision of the embedded targets takes the stale path")
    args = ap.parse_args(argv)
    if args.no_engine_numbers:
        Embedded.engine_numbers = False
    BODY = body_of(args.prompt_chars)
    chosen = args.targets.split(",")
    unknown = sorted(set(chosen) - {name for name, _ in TARGETS})
    if unknown or not {"embedded", "nginx"} <= set(chosen):
        print(f"dataplane_bench: --targets {args.targets}: embedded and nginx (the report compares them), "
              f"and any of {', '.join(DESIGNS)}", file=sys.stderr)
        return 2
    TARGETS = tuple((name, cls) for name, cls in TARGETS if name in chosen)
    if any(name.startswith("embedded-front") for name in chosen):
        from orchestrator.dataplane.front.compiled import NATIVE
        if NATIVE is None:  # the workers would serve with aiohttp, and the rows would say front
            print("dataplane_bench: the compiled front is not built here (python setup.py build_ext --inplace; "
                  "TRTLLM_ORCH_PURE_PYTHON unset): embedded-front would measure aiohttp's path", file=sys.stderr)
            return 2
    for tool in ("wrk", "nginx", "sse_source"):
        if shutil.which(tool) is None:
            print(f"dataplane_bench: {tool} not on PATH (../shared/tools/relay-kit packs it)", file=sys.stderr)
            return 2
    SseSource._binary = Path(shutil.which("sse_source"))  # type: ignore[arg-type]
    ncpu = len(os.sched_getaffinity(0))
    workers = [w for w in (int(x) for x in args.workers.split(",")) if w < ncpu]
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    args.out.mkdir(parents=True, exist_ok=True)
    from orchestrator.config import Settings
    default_w = Settings().worker_count(ncpu)
    result: dict[str, Any] = {"stamp": stamp, "machine": f"{ncpu} cores, {os.uname().release}, Python "
                              f"{sys.version.split()[0]}", "workers": workers, "default_workers": default_w,
                              "connections": CONNECTIONS, "sources": SOURCES, "source_procs": args.source_procs,
                              "events_per_stream": EVENTS, "prompt_chars": args.prompt_chars,
                              "engine_numbers": Embedded.engine_numbers,
                              "body_bytes": len(BODY),
                              "seconds": args.seconds,
                              # the workers run this interpreter: uvloop when it imports (a dependency)
                              "event_loop": _event_loop(),
                              "layout": {str(w): dict(zip(("relay", "sources", "wrk"), layout(w, ncpu)))
                                         for w in workers}}
    log(f"stream scaling on {ncpu} cores: workers {workers}")
    result["stream"] = scaling(workers, args.seconds, ncpu, EVENTS, args.source_procs)
    if args.long_events:
        log(f"long streams ({args.long_events} events)")
        result["long_events_per_stream"] = args.long_events
        result["stream_long"] = scaling(workers, args.seconds, ncpu, args.long_events, args.source_procs)
    log("tiny generate")
    result["tiny"] = scaling(workers, args.seconds / 2, ncpu, 1, args.source_procs)
    for key, field in (("stream", "events_per_s"), ("stream_long", "events_per_s"), ("tiny", "rps")):
        if key in result:
            result[key + "_ratio"] = ratios(result[key], field)
            for d in _present(result, key):
                result[f"{key}_{d}_ratio"] = ratios(result[key], field, d)
    log("time to first event")
    result["ttft"] = ttft(default_w, args.ttft_seconds, ncpu)
    if not args.no_profile:
        result["profile_svg"] = profile(args.out, stamp, 6, ncpu, args.profile_front)
    result["goals"] = goals(result)
    path = args.out / f"dataplane_bench-{stamp}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    (args.out / f"dataplane_bench-{stamp}.md").write_text(report(result))
    try:
        from bench.common import write_plot
        write_plot(path, result, plot)
    except Exception as exc:  # the numbers never depend on the picture
        log(f"no plot: {exc!r}")
    print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
