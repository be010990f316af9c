"""The proxies' Prometheus metrics, in a registry of their own.

A private CollectorRegistry (not prometheus_client's global one) so that two
proxies in one process (tests) never collide and the daemon decides where the
metrics are served. Labelled children are cached: `.labels()` costs a lock and
a dict build, too much for the per-request path.
"""

from __future__ import annotations

from collections.abc import Iterable

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from ..config import parse_host_port
from ..errors import OrchError

NO_INSTANCE = "none"  # label for requests answered by the proxy itself (403, 404, 503...)
# Time to response headers: sub-ms for metadata, seconds for long prompts.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0, 30.0, 60.0, float("inf"))
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ProxyMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("trtllm_orch_proxy_requests", "Requests answered, by instance and "
                                "HTTP status ('none': answered by the proxy)",
                                ("instance", "code"), registry=r)
        self.inflight = Gauge("trtllm_orch_proxy_inflight_requests", "Requests in flight per instance",
                              ("instance",), registry=r)
        self.retries = Counter("trtllm_orch_proxy_retries", "Attempts retried on another instance, "
                               "by the failed instance and reason", ("instance", "reason"), registry=r)
        self.upstream_failures = Counter("trtllm_orch_proxy_upstream_failures",
                                         "Upstream failures seen by the proxy",
                                         ("instance", "reason"), registry=r)
        self.latency = Histogram("trtllm_orch_proxy_upstream_latency_seconds",
                                 "Time from sending a request to an instance to its response headers",
                                 ("instance",), buckets=LATENCY_BUCKETS, registry=r)
        self.ready_instances = Gauge("trtllm_orch_proxy_ready_instances",
                                     "Instances the proxy may route to", registry=r)
        self.instance_ready = Gauge("trtllm_orch_proxy_instance_ready",
                                    "1 while the instance is in the ready set", ("instance",),
                                    registry=r)
        self._req_children: dict[tuple[str, int], Counter] = {}
        self._inflight_children: dict[str, Gauge] = {}
        self._latency_children: dict[str, Histogram] = {}
        self._known_instances: set[str] = set()

    # --- per request (hot path) --------------------------------------------------
    def count(self, instance: str, code: int) -> None:
        key = (instance, code)
        c = self._req_children.get(key)
        if c is None:
            c = self._req_children[key] = self.requests.labels(instance, str(code))
        c.inc()

    def inflight_child(self, instance: str) -> Gauge:
        g = self._inflight_children.get(instance)
        if g is None:
            g = self._inflight_children[instance] = self.inflight.labels(instance)
        return g

    def observe_latency(self, instance: str, seconds: float) -> None:
        h = self._latency_children.get(instance)
        if h is None:
            h = self._latency_children[instance] = self.latency.labels(instance)
        h.observe(seconds)

    def retry(self, instance: str, reason: str) -> None:
        self.retries.labels(instance, reason).inc()

    def failure(self, instance: str, reason: str) -> None:
        self.upstream_failures.labels(instance, reason).inc()

    # --- from the ready set -------------------------------------------------------
    def set_ready(self, instance_ids: Iterable[str]) -> None:
        ids = set(instance_ids)
        self.ready_instances.set(len(ids))
        for iid in ids:
            self.instance_ready.labels(iid).set(1)
        for iid in self._known_instances - ids:
            self.instance_ready.labels(iid).set(0)  # keep the series: "was ready, now not" is news
        self._known_instances |= ids

    def render(self) -> bytes:
        return generate_latest(self.registry)


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
        return web.Response(body=self._metrics.render(), headers={"Content-Type": CONTENT_TYPE})
