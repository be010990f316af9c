"""The proxies' Prometheus metrics, in a registry of their own.

A private CollectorRegistry (not prometheus_client's global one) so that two
proxies in one process (tests) never collide and the daemon decides where the
metrics are served. Labelled children are cached: `.labels()` costs a lock and
a dict build, too much for the per-request path.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from orchestrator.config import parse_host_port
from orchestrator.errors import OrchError
from orchestrator.routing.backends import Backend
from orchestrator.dataplane.recent import RecentLLM

NO_INSTANCE = "none"  # label for requests answered by the proxy itself (403, 404, 503...)
# Time to response headers: sub-ms for metadata, seconds for long prompts.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0, 30.0, 60.0, float("inf"))
# Time to first token: tens of ms for a cached prompt, minutes for a long one behind a queue.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                30.0, 60.0, float("inf"))
# Between tokens: an engine iteration (ms to tens of ms), more when the batch is full.
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0,
               2.5, float("inf"))
# Prompt tokens: a question to a long document.
TOKEN_BUCKETS = (64, 256, 1024, 4096, 16384, 65536, float("inf"))
# A TTFT estimate's error, observed - estimated: either way, a few ms to a queue's worth.
ERROR_BUCKETS = (-10.0, -2.5, -1.0, -0.5, -0.25, -0.1, -0.05, -0.025, -0.01, 0.0, 0.01, 0.025, 0.05, 0.1,
                 0.25, 0.5, 1.0, 2.5, 10.0, float("inf"))
HOLD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, float("inf"))
CONTENT_TYPE = CONTENT_TYPE_LATEST
# A scrape renders every data-plane worker's files: 5-12 ms of CPU at 1-8 workers. On the loop
# that relays streams it stopped every stream of that worker for as long (bench/scrape_stall.py).
# It runs on one render thread per process instead, and while it does the interpreter hands
# the GIL back to a waiting thread every RENDER_SWITCH_S (sys.setswitchinterval, 5 ms by
# default), so the loop waits at most about that long for it. One thread: renders of one
# process never overlap, and the interval is restored by the render that lowered it.
RENDER_SWITCH_S = 0.0005
_render_pool: ThreadPoolExecutor | None = None
_render_pool_lock = threading.Lock()


class ProxyMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("trtllm_orch_proxy_requests", "Requests answered, by instance and "
                                "HTTP status ('none': answered by the proxy)",
                                ("instance", "code"), registry=r)
        # multiprocess_mode: how the data-plane workers' values add up (prometheus_client's
        # multiprocess mode, on in a worker; ignored in one process).
        self.inflight = Gauge("trtllm_orch_proxy_inflight_requests", "Requests in flight per instance",
                              ("instance",), registry=r, multiprocess_mode="livesum")
        self.retries = Counter("trtllm_orch_proxy_retries", "Attempts retried on another instance, "
                               "by the failed instance and reason", ("instance", "reason"), registry=r)
        self.upstream_failures = Counter("trtllm_orch_proxy_upstream_failures",
                                         "Upstream failures seen by the proxy",
                                         ("instance", "reason"), registry=r)
        self.latency = Histogram("trtllm_orch_proxy_upstream_latency_seconds",
                                 "Time from sending a request to an instance to its response headers",
                                 ("instance",), buckets=LATENCY_BUCKETS, registry=r)
        self.ready_instances = Gauge("trtllm_orch_proxy_ready_instances",
                                     "Instances the proxy may route to", registry=r,
                                     multiprocess_mode="livemax")
        self.instance_ready = Gauge("trtllm_orch_proxy_instance_ready",
                                    "1 while the instance is in the ready set", ("instance",),
                                    registry=r, multiprocess_mode="livemax")
        # LLM-level: what a client of a generation sees (see TokenTimer).
        self.ttft = Histogram("trtllm_orch_proxy_time_to_first_token_seconds",
                              "From the proxy having the request to its first output event reaching "
                              "the client (holds and retries included), by instance and API",
                              ("instance", "api"), buckets=TTFT_BUCKETS, registry=r)
        self.inter_token = Histogram("trtllm_orch_proxy_inter_token_seconds",
                                     "Time between consecutive output events of a stream",
                                     ("instance", "api"), buckets=ITL_BUCKETS, registry=r)
        self.output_events = Counter("trtllm_orch_proxy_output_events",
                                     "Output events relayed: SSE events of generate_stream, messages of "
                                     "ModelStreamInfer, 1 per non-streamed answer (per-token streaming: "
                                     "1 event = 1 token)", ("instance", "api"), registry=r)
        self.held = Gauge("trtllm_orch_proxy_held_requests",
                          "Requests waiting for an instance to become ready", ("proxy",), registry=r,
                          multiprocess_mode="livesum")
        self.hold_time = Histogram("trtllm_orch_proxy_hold_seconds",
                                   "How long held requests waited, by whether an instance came",
                                   ("proxy", "outcome"), buckets=HOLD_BUCKETS, registry=r)
        self.routing = Counter("trtllm_orch_proxy_routing_decisions",
                               "Instances chosen for an attempt, by policy and the policy's reason",
                               ("policy", "reason", "instance"), registry=r)
        # The routing model's view of each pick (cost-model, routing/cost_policy.py): how much of
        # the prompt it expected cached there, and how far its TTFT estimate was off. Histograms,
        # so a scrape declares them (and a dashboard finds them) before the first pick.
        self.route_prompt_tokens = Histogram("trtllm_orch_proxy_route_prompt_tokens",
                                             "Prompt tokens of each request routed to the instance, as the "
                                             "routing model counts them", ("instance",),
                                             buckets=TOKEN_BUCKETS, registry=r)
        self.route_cached_tokens = Histogram("trtllm_orch_proxy_route_cached_tokens",
                                             "Of those, the tokens the routing model estimated cached there "
                                             "(_sum over the prompt tokens' _sum: the expected hit rate)",
                                             ("instance",), buckets=TOKEN_BUCKETS, registry=r)
        self.route_ttft_error = Histogram("trtllm_orch_proxy_route_ttft_error_seconds",
                                          "Observed minus estimated TTFT of each request the routing model "
                                          "estimated (_sum over _count: its bias)", ("instance",),
                                          buckets=ERROR_BUCKETS, registry=r)
        self.recent = RecentLLM()  # the last minute, for `status` and `top`
        # A data-plane worker: every worker writes its values to files here and a scrape
        # of any worker adds them all up (prometheus_client's multiprocess mode).
        self.multiproc_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR", "")
        self._own_values = False  # ours are not in those files (add_worker_files)
        self.extra_collectors: list[Any] = []  # served beside ours (the workers' own table)
        # Counting queued for after the answers (the compiled front's, front/path.py): done before
        # a read of the metrics, on the loop that queued it.
        self.unsettled: list[Callable[[], None]] = []
        self.write_through: Callable[[], None] | None = None  # a worker's values, to its file now
        self._engines = EngineCollector()
        r.register(self._engines)
        self._held_gauges: dict[str, Callable[[], int]] = {}
        self._routing_children: dict[tuple[str, str, str], Counter] = {}
        self._llm_children: dict[tuple[str, str], tuple[Histogram, Histogram, Counter]] = {}
        self._req_children: dict[tuple[str, int], Counter] = {}
        self._inflight_children: dict[str, Gauge] = {}
        self._latency_children: dict[str, Histogram] = {}
        self._route_children: dict[str, tuple[Histogram, Histogram]] = {}  # prompt, cached tokens
        self._known_instances: set[str] = set()

    # --- per request (hot path) --------------------------------------------------
    def count(self, instance: str, code: int, n: int = 1) -> None:
        key = (instance, code)
        c = self._req_children.get(key)
        if c is None:
            c = self._req_children[key] = self.requests.labels(instance, str(code))
        c.inc(n)

    def inflight_child(self, instance: str) -> Gauge:
        g = self._inflight_children.get(instance)
        if g is None:
            g = self._inflight_children[instance] = self.inflight.labels(instance)
        return g

    def observe_latency(self, instance: str, seconds: float) -> None:
        self._latency_child(instance).observe(seconds)

    def _latency_child(self, instance: str) -> Histogram:
        h = self._latency_children.get(instance)
        if h is None:
            h = self._latency_children[instance] = self.latency.labels(instance)
        return h

    def routed(self, policy: str, reason: str, instance: str, n: int = 1, now: float | None = None) -> None:
        key = (policy, reason, instance)
        c = self._routing_children.get(key)
        if c is None:
            c = self._routing_children[key] = self.routing.labels(policy, reason, instance)
        c.inc(n)
        self.recent.routed(instance, reason, time.monotonic() if now is None else now, n)

    # --- per batch (the compiled front's, front/ledger.py) ---------------------------
    def observe_latencies(self, instance: str, seconds: list[float]) -> None:
        observe_many(self._latency_child(instance), seconds)

    def first_tokens(self, instance: str, api: str, firsts: Sequence[tuple[float, float]]) -> None:
        """Times to first token (seconds, when the event reached the client): the histogram and the
        recent window. What a first token counts, for a batch of the compiled front's and for
        TokenTimer.events' one."""
        observe_many(self.llm_children(instance, api)[0], [first for first, _ in firsts])
        recent = self.recent
        for first, at in firsts:
            recent.first_token(instance, first, at)

    def count_events(self, instance: str, api: str, n: int, now: float) -> None:
        self.llm_children(instance, api)[2].inc(n)
        self.recent.events(instance, n, now)

    def inter_token_counts(self, instance: str, api: str, total: float, counts: list[int] | tuple[int, ...]) -> None:
        """Inter-token times counted per bucket of ITL_BUCKETS (by the compiled front) and their sum."""
        _observe_counts(self.llm_children(instance, api)[1], total, counts)

    def route_decision(self, decision: Any, timer: "TokenTimer") -> None:
        """The routing model's pick of a generation's attempt (Balancer.last_decision: None for
        policies without a model): its prompt and cached tokens now; its TTFT estimate against the
        observed one when the timer sees the first token (which also tells the model its prefill
        is done). An earlier attempt's pick on the same timer (retried elsewhere) is abandoned:
        its prefill will not happen there."""
        if decision is None:
            return
        timer.attempt_over()
        iid = decision.instance
        children = self._route_children.get(iid)
        if children is None:
            children = self._route_children[iid] = (self.route_prompt_tokens.labels(iid),
                                                    self.route_cached_tokens.labels(iid))
        children[0].observe(decision.prompt_tokens)
        children[1].observe(decision.cached_tokens)
        timer.decision = decision

    def route_first_token(self, decision: Any, seconds: float) -> None:
        error = decision.first_token(seconds)
        if error is None:
            return
        iid = decision.instance
        self.route_ttft_error.labels(iid).observe(error)
        if seconds > 0:
            self.recent.estimate_error(iid, abs(error) / seconds, time.monotonic())

    def llm_children(self, instance: str, api: str) -> tuple[Histogram, Histogram, Counter]:
        key = (instance, api)
        children = self._llm_children.get(key)
        if children is None:
            children = self._llm_children[key] = (self.ttft.labels(instance, api),
                                                  self.inter_token.labels(instance, api),
                                                  self.output_events.labels(instance, api))
        return children

    def timer(self, api: str) -> "TokenTimer":
        """The clock of one generation, started now (see TokenTimer)."""
        return TokenTimer(self, api)

    def retry(self, instance: str, reason: str) -> None:
        self.retries.labels(instance, reason).inc()

    def failure(self, instance: str, reason: str) -> None:
        self.upstream_failures.labels(instance, reason).inc()

    # --- from the ready set -------------------------------------------------------
    def set_ready(self, backends: Iterable[Backend]) -> None:
        backends = tuple(backends)
        self._engines.backends = backends
        ids = {b.instance_id for b in backends}
        self.ready_instances.set(len(ids))
        for iid in ids:
            self.instance_ready.labels(iid).set(1)
        for iid in self._known_instances - ids:
            self.instance_ready.labels(iid).set(0)  # keep the series: "was ready, now not" is news
        self._known_instances |= ids

    # --- holds ----------------------------------------------------------------------
    def watch_held(self, proxy: str, count: Callable[[], int]) -> Callable[[float, bool], None]:
        """Export a hold gate's waiting count (read at scrape time); returns its on_held hook."""
        self._held_gauges[proxy] = count
        held = self.held.labels(proxy)
        if not self.multiproc_dir:  # across processes there are no callbacks: the worker's
            held.set_function(count)  # held count is set as it ends (and kept in its table row)
        routed, timed_out = self.hold_time.labels(proxy, "routed"), self.hold_time.labels(proxy, "timed_out")

        def on_held(seconds: float, got_instance: bool) -> None:
            (routed if got_instance else timed_out).observe(seconds)
            if self.multiproc_dir:
                held.set(count())

        return on_held

    def held_now(self) -> int:
        return sum(count() for count in self._held_gauges.values())

    def add_worker_files(self, path: Path) -> None:
        """Serve the values data-plane workers write under `path` beside this process's own:
        NGINX mode's daemon, whose /metrics counts its side workers' requests
        (controlplane/side_workers.py). A family of theirs replaces our empty one."""
        self.multiproc_dir = str(path)
        self._own_values = True

    def settle(self) -> None:
        """Count what is queued (see `unsettled`): from the loop thread, before reading."""
        for account in self.unsettled:
            account()
        if self.write_through is not None:  # a scrape reads this worker's values from its file
            self.write_through()

    async def render_off_loop(self) -> bytes:
        """`render()` on the process's render thread: what a /metrics handler serves."""
        self.settle()
        global _render_pool
        with _render_pool_lock:
            if _render_pool is None:  # idle threads end with the process; none before the first scrape
                _render_pool = ThreadPoolExecutor(1, thread_name_prefix="metrics-render")
            pool = _render_pool
        return await asyncio.get_running_loop().run_in_executor(pool, self._render_yielding)

    def _render_yielding(self) -> bytes:
        before = sys.getswitchinterval()
        sys.setswitchinterval(min(before, RENDER_SWITCH_S))
        try:
            return self.render()
        finally:
            sys.setswitchinterval(before)

    def render(self) -> bytes:
        if self.multiproc_dir:
            registry = CollectorRegistry(auto_describe=False)
            registry.register(_EveryWorker(self.multiproc_dir, self.registry, (self._engines, *self.extra_collectors),
                                           own_values=self._own_values))
            return generate_latest(registry)
        return generate_latest(self.registry)


class _EveryWorker:
    """A worker's scrape: every data-plane worker's values (prometheus_client's
    multiprocess files), what is read at scrape time (engines, the workers' table), and
    the HELP/TYPE of each metric no worker has a sample of yet: one process showed those
    too, and a dashboard or alert rule must find a family before its first retry."""

    def __init__(self, path: str, local: CollectorRegistry, live: tuple[Any, ...], own_values: bool = False) -> None:
        """own_values: the local families' samples are this process's own, not in the files (a
        daemon's beside its workers'): served where no file has the family."""
        self._files = MultiProcessCollector(None, path=path)
        self._local = local
        self._live = live
        self._own_values = own_values

    def collect(self) -> Any:
        from prometheus_client.metrics_core import Metric
        seen = set()
        for source in (self._files, *self._live):
            for family in source.collect():
                if family.name not in seen:
                    seen.add(family.name)
                    yield family
        for family in self._local.collect():
            if family.name not in seen:
                seen.add(family.name)
                yield family if self._own_values else Metric(family.name, family.documentation, family.type)


class EngineCollector:
    """What each ready instance's engine last reported, read at scrape time from the
    views the instances' engine monitors keep (nothing on the request path). A stale
    view exports nothing: no number is better than an old one."""

    # (metric suffix, help, snapshot -> value)
    GAUGES = (
        ("waiting", "Requests the engine holds but does not run (TRT-LLM waiting + Triton's pending)",
         lambda s, v: s.queued),
        ("active", "Requests in the engine's active batch", lambda s, v: s.active),
        ("max_active", "The engine's batch limit", lambda s, v: s.max_active),
        ("kv_fraction", "Fraction of the engine's KV cache blocks in use", lambda s, v: s.kv_fraction),
        ("kv_reuse_hit_rate", "Prompt blocks of the last minute served from the KV cache",
         lambda s, v: v.reuse_hit_rate()),
    )

    def __init__(self) -> None:
        self.backends: tuple[Backend, ...] = ()

    def describe(self) -> list[GaugeMetricFamily]:
        return [GaugeMetricFamily(f"trtllm_orch_engine_{name}", doc, labels=("instance",))
                for name, doc, _ in self.GAUGES]

    def collect(self) -> Iterable[GaugeMetricFamily]:
        families = self.describe()
        for backend in self.backends:
            view = backend.engine
            snap = view.fresh() if view is not None else None
            if snap is None:
                continue
            for family, (_, _, value_of) in zip(families, self.GAUGES):
                value = value_of(snap, view)
                if value is not None:
                    family.add_metric((backend.instance_id,), value)
        return families


class TokenTimer:
    """One generation's clock, from the moment the proxy has the request.

    The proxy calls `events(instance, n)` as output events reach the client: the first
    one is the time to first token (a non-streamed answer is one event, so its TTFT is
    its whole latency), the gaps after it are inter-token times. Retries and holds fall
    inside the TTFT, as the client sees them. One per request, on the event loop.
    """

    __slots__ = ("_metrics", "api", "started", "_last", "_children", "decision")

    def __init__(self, metrics: ProxyMetrics, api: str) -> None:
        self._metrics = metrics
        self.api = api
        self.started = time.monotonic()
        self._last: float | None = None
        self._children: tuple[Histogram, Histogram, Counter] | None = None
        self.decision: Any = None  # the routing model's pick (ProxyMetrics.route_decision)

    def attempt_over(self) -> None:
        """The attempt ended (answered, failed, retried or the client left). A pick still
        waiting for its first token will see none: its prefill is pending there no more."""
        decision = self.decision
        if decision is not None:
            self.decision = None
            decision.abandoned()

    def events(self, instance: str, n: int = 1, now: float | None = None) -> None:
        """`now`: when they reached the client, where that was earlier than the call."""
        if n <= 0:
            return
        if now is None:
            now = time.monotonic()
        children = self._children
        if children is None:
            children = self._children = self._metrics.llm_children(instance, self.api)
        _, itl, count = children
        if self._last is None:
            first = now - self.started
            self._metrics.first_tokens(instance, self.api, ((first, now),))
            self.first_token(first, now)
        else:
            itl.observe(now - self._last)
        if n > 1:  # events that arrived in the same read came together
            _observe_zeros(itl, n - 1)
        self._last = now
        count.inc(n)
        self._metrics.recent.events(instance, n, now)

    def first_token(self, first: float, now: float) -> None:
        """The routing model's pick, where one waits, learns its first token came `first` s after
        the request (at `now`); the compiled front tells it so (front/path.py) and counts the
        rest in its batch."""
        if self.decision is not None:
            decision, self.decision = self.decision, None
            # From the pick (a hold or an earlier attempt before it is not the model's to see).
            since = now - decision.at
            self._metrics.route_first_token(decision, since if 0.0 <= since <= first else first)


def observe_many(histogram: Histogram, values: list[float]) -> None:
    """Each of `values` observed, as observe() would one by one (a bucket is the first bound at
    or above the value): one increment per bucket in use and one of the sum, where
    prometheus_client's private per-bucket values are there; else one by one."""
    buckets = getattr(histogram, "_buckets", None)
    bounds = getattr(histogram, "_upper_bounds", None)
    hsum = getattr(histogram, "_sum", None)
    if buckets is None or bounds is None or hsum is None or len(values) < 2:
        for v in values:
            histogram.observe(v)
        return
    counts: dict[int, int] = {}
    for v in values:
        i = bisect_left(bounds, v)
        counts[i] = counts.get(i, 0) + 1
    for i, n in counts.items():
        buckets[i].inc(n)
    hsum.inc(sum(values))


def _observe_counts(histogram: Histogram, total: float, counts: list[int] | tuple[int, ...]) -> None:
    """Observations already counted per bucket (non-cumulative, as prometheus_client keeps them)
    and their sum; without its private per-bucket values, each is observed at its bucket's bound."""
    buckets = getattr(histogram, "_buckets", None)
    hsum = getattr(histogram, "_sum", None)
    if buckets is not None and hsum is not None and len(buckets) == len(counts):
        for bucket, n in zip(buckets, counts):
            if n:
                bucket.inc(n)
        hsum.inc(total)
        return
    for bound, n in zip(ITL_BUCKETS, counts):
        for _ in range(n):
            histogram.observe(min(bound, 1e9))


def _observe_zeros(histogram: Histogram, k: int) -> None:
    """k observations of 0.0 at once (a stream's burst of events: once per event, this was a
    per-event cost of the relay). 0.0 lands in the first bucket and adds nothing to the sum,
    which is all prometheus_client's observe() would do k times; its per-bucket values are
    private, so without them it falls back to observing one by one."""
    buckets = getattr(histogram, "_buckets", None)
    bounds = getattr(histogram, "_upper_bounds", None)
    if buckets and bounds and bounds[0] >= 0.0:
        buckets[0].inc(k)
        return
    for _ in range(k):
        histogram.observe(0.0)


class SseCounter:
    """Counts complete SSE events (blank-line terminated) across arbitrary chunk splits."""

    __slots__ = ("_newline",)

    def __init__(self) -> None:
        self._newline = False  # the last chunk ended inside a terminator ("...\n")

    def feed(self, chunk: bytes) -> int:
        n = chunk.count(b"\n\n")
        if self._newline and chunk.startswith(b"\n"):
            n += 1
        self._newline = chunk.endswith(b"\n") and not chunk.endswith(b"\n\n")
        return n


class NginxMetrics:
    """What only `--proxy nginx` has: its managed master's health (in ProxyMetrics' registry)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.up = Gauge("trtllm_orch_proxy_nginx_up", "1 while the managed nginx master runs", registry=registry)
        self.restarts = Counter("trtllm_orch_proxy_nginx_restarts",
                                "Masters started after the managed nginx master died", registry=registry)


class MetricsServer:
    """GET /metrics on its own listener, for a proxy whose traffic is not served by aiohttp (nginx)."""

    def __init__(self, metrics: ProxyMetrics, address: str, flag: str = "--metrics-listen") -> None:
        self._metrics = metrics
        self._address = address
        self._flag = flag
        self._runner: web.ServerRunner | None = None
        self.port = 0

    async def start(self) -> None:
        host, port = parse_host_port(self._address, self._flag)
        runner = web.ServerRunner(web.Server(self._handle, access_log=None), handle_signals=False)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as exc:
            await runner.cleanup()
            raise OrchError(f"{self._flag}={self._address!r}: cannot listen: {exc.strerror or exc}") from None
        self._runner = runner
        self.port = runner.addresses[0][1]

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.path != "/metrics":
            return web.json_response({"error": "not found"}, status=404)
        if request.method != "GET":
            return web.json_response({"error": "method not allowed"}, status=405, headers={"Allow": "GET"})
        return web.Response(body=await self._metrics.render_off_loop(), headers={"Content-Type": CONTENT_TYPE})
