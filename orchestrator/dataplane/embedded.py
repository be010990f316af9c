"""The embedded HTTP reverse proxy: one public endpoint in front of the ready instances.

Request path, in order:
  head and body deadlines, connection cap (client_guard.py) ->
  surface check (403/404/405 never reach an instance) -> local health answers ->
  body read into memory (bounded: 413) so it can be re-sent -> pick an instance ->
  forward -> relay the response.

Retries happen only before any response byte reached the client: a refused or
timed-out connect, a connection dropped before response headers, a 503, a
queue-full rejection (TRT-LLM's "Maximum queue size ... reached", an HTTP 500, or 400 through an ensemble),
an error from an instance that left rotation, or no first byte within
--first-byte-timeout-s moves the request to another ready instance (max_attempts
in all). Once headers arrived we commit: a failure mid-body truncates the
client's response (the connection is closed without the final chunk), which is
the only honest signal left. When no instance is ready the request is held
(hold.py) until one is, up to --hold-s.

What counts against an instance (its passive health, reached through its
Backend): transport errors, timeouts and 5xx answers. A 4xx is the request's
fault, a 503 or a full queue is the instance saying "busy": neither ejects it.

With --front compiled a worker's native generations take the compiled front instead
(orchestrator/dataplane/front/): the same rules, called from C (`_refusal`, `_attempt_failed`,
`_settle`, the balancer, the metrics), and every other request comes here with its connection.

Lifecycle (one owner, fixed order): start() creates the client session, then
binds the public listener, then the metrics listener; stop() stops accepting,
waits for in-flight requests up to the grace, cancels the rest (which closes
their upstream connections so Triton cancels the generations), then closes the
listeners and the session.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from orchestrator.config import Settings
from orchestrator.tasks import awaiting
from orchestrator.routing.backends import Backend, ReadyBackends
from orchestrator.routing.balancer import Balancer
from orchestrator.dataplane.accept import AcceptingSite, bind_listener
from orchestrator.dataplane.accept_share import AcceptShare
from orchestrator.dataplane.client_guard import BodyTimeout, ClientLimits, GuardedServer
from orchestrator.dataplane.headers import TrustedPeers, client_response_headers, upstream_request_headers
from orchestrator.dataplane.hold import HoldGate
from orchestrator.dataplane.response_head import RelayedResponse, response_head
from orchestrator.routing.llm_policies import RouteHints
from orchestrator.dataplane.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from orchestrator.dataplane.metrics import NO_INSTANCE, ProxyMetrics, SseCounter, TokenTimer
from orchestrator.routing.prompt import prompt_of_json
from orchestrator.routing.surface import (ADMIN, BAD_PATH, LIVE, METHOD_NOT_ALLOWED, NOT_FOUND, OPENAI, PUBLIC, READY,
                                          Surface)
from orchestrator.dataplane.upstream import (BadResponse, ConnectFailed, ConnectTimeout, Disconnected, HeadTimeout,
                                            UpstreamPool, UpstreamResponse)

if TYPE_CHECKING:  # imported at run time only when the OpenAI API is on
    from orchestrator.dataplane.openai_frontend import NativeCall

# Answers of non-streaming routes up to this size are read whole and sent in one write
# with a Content-Length (fewer syscalls, and a drop mid-body becomes a clean 502 instead
# of a truncated response), chunked ones too: Triton answers `generate` chunked, and
# relaying that as it came cost three client writes (head, chunk, last chunk) instead of
# one. Larger bodies and every SSE stream are relayed chunk by chunk as they arrive.
BUFFER_MAX = 256 * 1024
# Per-instance connection cap. Long streams each hold a connection, so no total
# cap (it would starve short requests behind streams); the per-host cap only
# protects an instance's file descriptors. Requests beyond it wait for a free
# connection rather than fail.
CONNECTIONS_PER_INSTANCE = 1024
UPSTREAM_KEEPALIVE_S = 30.0
CLIENT_KEEPALIVE_S = 75.0
RETRY_AFTER_S = "1"
# How long cancelled handlers get to close their upstream connections at stop().
CANCEL_GRACE_S = 1.0
# At stop(), how long a connection accepted just before has to send its first request: a
# client sends it right after the connect, so this only bounds a silent one's wait.
FIRST_REQUEST_GRACE_S = 0.5

_JSON = "application/json"
_LLM_ACTIONS = frozenset({"generate", "generate_stream", "infer"})
_SSE = "text/event-stream"


def error_json(message: str) -> str:
    """The body of an answer the proxy gives itself (here and in the compiled front's)."""
    # json.dumps is not needed for our own fixed messages; keep quotes escaped anyway.
    return '{"error": "' + message.replace("\\", "\\\\").replace('"', '\\"') + '"}'


def _error(status: int, message: str, headers: dict[str, str] | None = None,
           close: bool = False) -> web.Response:
    resp = web.Response(status=status, text=error_json(message), content_type=_JSON, headers=headers)
    if close:
        resp.force_close()
    return resp


class _QuietProtocolErrors(logging.Filter):
    """aiohttp logs malformed client input (scanners, TLS on the HTTP port, bad
    chunking) at ERROR with a traceback. The client already got its 400 and the
    connection is closed: that is debug information, not an operator's problem."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, (HttpProcessingError, ConnectionError)):
            if record.levelno > logging.DEBUG:
                record.levelno, record.levelname = logging.DEBUG, "DEBUG"
                record.exc_info = None
                record.msg = f"{record.msg}: {exc!r}"
        return True


class _Retryable(Exception):
    """An attempt failed before any response byte reached the client.

    `blame`: whether it counts against the instance's passive health (a transport
    failure does; a 503, a full queue or an instance already out of rotation does not).
    """

    def __init__(self, reason: str, blame: bool = True) -> None:
        super().__init__(reason)
        self.reason = reason
        self.blame = blame


# TRT-LLM's executor rejects beyond max_queue_size with this text inside an INTERNAL
# error (HTTP 500, gRPC INTERNAL); see ../shared/notes/trtllm-facts.md.
QUEUE_FULL_TEXT = b"Maximum queue size of"
# Error bodies up to this size are read to tell a full queue from a real failure.
ERROR_PEEK_MAX = 64 * 1024
SAME_INSTANCE_RETRY_DELAY_S = 0.1


class EmbeddedProxy:
    def __init__(self, settings: Settings, backends: ReadyBackends,
                 logger: logging.Logger | None = None, metrics: ProxyMetrics | None = None,
                 openai_only: bool = False, *, shared: Any = None,
                 sockets: dict[str, socket.socket] | None = None,
                 tally: Callable[..., None] | None = None, accept_share: AcceptShare | None = None) -> None:
        """shared: a data-plane worker's view of the global in-flight counts and its own row
        (Balancer); sockets: listening sockets by flag name ("listen", "metrics_listen"), bound
        by the worker's supervisor and shared by every worker, instead of binding our own;
        tally: called once per answered request, or with a count of them (the worker's count in the
        shared table);
        accept_share: this worker's share of the shared public socket's connections."""
        self._settings = settings
        self._backends = backends
        self._log = logger or logging.getLogger("trtllm_orch.proxy")
        # aiohttp's server logger: a private child (not registered globally, so no
        # filter leaks onto a shared logger) that propagates to ours.
        self._http_log = logging.Logger(self._log.name + ".http")
        self._http_log.parent = self._log
        self._http_log.addFilter(_QuietProtocolErrors())
        self._balancer = Balancer(settings.lb_policy, shared=shared)
        self._sockets = sockets or {}
        self._tally = tally
        self._accept_share = accept_share
        self._surface = Surface()
        self.metrics = metrics or ProxyMetrics()  # shared with the gRPC proxy (make_proxies)
        self._hold = HoldGate(backends, settings.hold_s, settings.max_held,
                              on_held=self.metrics.watch_held("http", lambda: self._hold.held))
        self._servers: list[GuardedServer] = []
        self._front: Any = None  # the compiled front (front/compiled.py) where --front compiled
        # The OpenAI API (/v1): translated by the frontend, then sent down this proxy's own
        # forward path. openai_only: the loopback listener NGINX forwards /v1/ to (nginx.py).
        self._openai_only = openai_only
        self._openai = None
        if settings.openai == "on" or openai_only:
            from orchestrator.dataplane.openai_frontend import OpenAIFrontend, ProxyPath
            self._openai = OpenAIFrontend(settings, ProxyPath(
                read_body=self._read_body, forward=self._forward, settle=self._settle,
                fail=self._upstream_failed, retry=_Retryable, metrics=self.metrics,
                stopping=lambda: self._stopping), self._log)
        self.apply_settings(settings)
        self._pool: UpstreamPool | None = None
        self._runner: web.ServerRunner | None = None
        self._metrics_runner: web.ServerRunner | None = None
        self._unsubscribe: Any = None
        # The requests being handled: their tasks, and each request with when it began (for the
        # log line of a stop that has to cancel some).
        self._handlers: dict[asyncio.Task[Any], tuple[web.BaseRequest, float]] = {}
        self._stopping = False
        self._bound_port = 0
        self._metrics_port = 0
        self._ready_ids: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None  # set by start(): the loop it serves on

    def apply_settings(self, settings: Settings) -> None:
        """The knobs a reload changes in place (the listen addresses need `down`/`up`)."""
        self._settings = settings
        if settings.lb_policy != self._balancer.policy:
            self._balancer.set_policy(settings.lb_policy)
        self._trusted = TrustedPeers(settings.trusted_proxy)
        self._max_body = settings.max_body_bytes
        self._max_attempts = settings.max_attempts
        self._allow_admin = settings.allow_admin
        self._first_byte_s = settings.first_byte_timeout_s or None
        self._hold.hold_s, self._hold.max_held = settings.hold_s, settings.max_held
        # Per request, not per pool: a reload changes them for the next request. Idle
        # timeouts only: the wait for the head and the silence between chunks; no total,
        # so long generations are not cut.
        self._connect_s = settings.connect_timeout_s or None
        self._idle_s = settings.idle_timeout_s or None
        self._limits = ClientLimits(settings.client_header_timeout_s, settings.client_body_timeout_s,
                                    settings.max_client_connections)
        for server in self._servers:
            server.limits = self._limits
        if self._front is not None:
            self._front.configure(settings, self._limits, CLIENT_KEEPALIVE_S)
        if self._openai is not None:
            self._openai.apply_settings(settings)

    # --- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        s = self._settings
        self._loop = asyncio.get_running_loop()
        if self._openai is not None:
            await self._openai.start()  # reads the model's facts; a bad --chat-template stops `up` here
        # Our own lean HTTP/1.1 client (upstream.py): bytes are relayed as the instance
        # encoded them, no cookies, no redirects, no headers of its own beyond Host and
        # Content-Length.
        self._pool = UpstreamPool(limit_per_host=CONNECTIONS_PER_INSTANCE, keepalive_s=UPSTREAM_KEEPALIVE_S)
        self._unsubscribe = self._backends.subscribe(self._on_backends)
        self._on_backends(self._backends.current())
        self._hold.start()
        try:
            self._runner = await self._listen(self._handle, s.listen, "listen")
            self._bound_port = self._runner.addresses[0][1]
            if s.metrics_listen:
                self._metrics_runner = await self._listen(self._handle_metrics, s.metrics_listen,
                                                          "metrics_listen")
                self._metrics_port = self._metrics_runner.addresses[0][1]
        except BaseException:
            await self._close_all()
            raise
        self._log.info("proxy listening on %s (metrics: %s, policy %s)", s.listen,
                       s.metrics_listen or "off", s.lb_policy)

    async def _listen(self, handler: Any, address: str, name: str) -> web.ServerRunner:
        flag = "--" + name.replace("_", "-")
        server = GuardedServer(handler, limits=self._limits, log=self._log, handler_cancellation=True,
                               access_log=None, auto_decompress=False,
                               keepalive_timeout=CLIENT_KEEPALIVE_S, logger=self._http_log)
        self._servers.append(server)
        runner = web.ServerRunner(server, handle_signals=False, shutdown_timeout=CANCEL_GRACE_S)
        await runner.setup()
        # A worker serves the supervisor's socket, shared by every worker; a proxy in the
        # daemon's own process binds its own, and its site closes it when it stops.
        sock = self._sockets.get(name)
        owned = sock is None
        try:
            if sock is None:
                sock = bind_listener(address, flag)
            # Client connections are shared out among the workers; scrapes are not worth it.
            share = self._accept_share if name == "listen" and not owned else None
            front = self._start_front(server) if name == "listen" and not owned else None
            await AcceptingSite(runner, sock, self._log, owned=owned, share=share, front=front).start()
        except BaseException:
            await runner.cleanup()
            if owned and sock is not None:
                sock.close()
            raise
        return runner

    def _start_front(self, server: GuardedServer) -> Any:
        """A worker's compiled front for the public listener, where --front auto or compiled and the
        module is built (else aiohttp serves every request, with a warning; `up --front compiled`
        refused to start without it, so here that is auto's case)."""
        if self._settings.front == "aiohttp" or self._openai_only:
            return None
        from orchestrator.dataplane.front import NOT_BUILT
        from orchestrator.dataplane.front.compiled import NATIVE, Front
        if NATIVE is None:
            self._log.warning(NOT_BUILT)
            return None
        self._front = Front(self, server, self._log)
        self._front.start(self._settings, self._limits, CLIENT_KEEPALIVE_S)
        return self._front

    async def stop(self, grace_s: float = 5.0) -> None:
        self._stopping = True
        self._hold.close()  # held requests get their 503 now
        # 1. stop accepting; every connection closes after its next response (those accepted
        #    but silent, or kept alive, get a moment for a next request: client_guard.py, it may
        #    be in the socket unread), answers from now on saying Connection: close.
        for runner in (self._runner, self._metrics_runner):
            if runner is not None:
                for site in list(runner.sites):
                    await site.stop()
                if runner.server is not None:
                    runner.server.pre_shutdown()
        # The front's requests end (or are cut) within the same grace as the handlers below: its
        # stop is awaited before the listeners and the pool close.
        front_stop = asyncio.ensure_future(self._front.stop(grace_s, FIRST_REQUEST_GRACE_S)) \
            if self._front is not None else None
        # together: each may wait the whole first-request grace
        await asyncio.gather(*(server.settle(min(FIRST_REQUEST_GRACE_S, max(grace_s, 0))) for server in self._servers))
        # 2. let in-flight requests finish, up to the grace; meanwhile the connections kept
        #    open past their answer get the first-request grace for a next one (client_guard.py)
        until = asyncio.get_running_loop().time() + max(grace_s, 0)
        lingering = asyncio.gather(*(server.linger(FIRST_REQUEST_GRACE_S, until) for server in self._servers))
        if self._handlers:
            _, pending = await asyncio.wait(list(self._handlers), timeout=max(grace_s, 0))
            # 3. cancel the rest: their upstream responses close, so Triton cancels them.
            if pending:
                self._log.warning("proxy stop: cancelling %d request(s) still running after %.1fs",
                                  len(pending), grace_s)
                now = self._loop.time() if self._loop is not None else 0.0
                for t in pending:
                    request, began = self._handlers.get(t, (None, now))
                    self._log.warning("proxy stop: cancelling %s %s, running %.1fs, waiting in %s",
                                      getattr(request, "method", "?"), getattr(request, "path", "?"),
                                      now - began, awaiting(t))
                    t.cancel()
                await asyncio.wait(pending, timeout=CANCEL_GRACE_S)
        await lingering
        if front_stop is not None:
            await front_stop
        await self._close_all()

    async def _close_all(self) -> None:
        # Listeners before the upstream pool: no handler may start an upstream request
        # on a closed pool.
        for attr in ("_runner", "_metrics_runner"):
            runner = getattr(self, attr)
            if runner is not None:
                setattr(self, attr, None)
                await runner.cleanup()
        if self._pool is not None:
            pool, self._pool = self._pool, None
            await pool.close()
        if self._unsubscribe is not None:
            unsubscribe, self._unsubscribe = self._unsubscribe, None
            unsubscribe()
        if self._openai is not None:
            await self._openai.stop()

    def abort_instance(self, host: str, port: int, reason: str, answering: bool) -> None:
        """The daemon says an instance stopped answering (it is out of the ready set already):
        requests waiting on it are retried on others now, and with `answering` its streams
        are cut, instead of waiting for --idle-timeout-s."""
        if self._front is not None:
            ended = self._front.abort(host, port, answering)
            if ended:
                self._log.warning("instance %s:%d stopped answering (%s): the front ended %d request(s) there",
                                  host, port, reason, ended)
        if self._pool is not None:
            failed = self._pool.abort(host, port, reason, answering=answering)
            if failed:
                self._log.warning("instance %s:%d stopped answering (%s): %d request(s) in flight there "
                                  "ended (%s)", host, port, reason, failed,
                                  "streams cut, the rest retried on others" if answering else "retried on others")

    def inflight(self) -> dict[str, int]:
        out = {b.instance_id: 0 for b in self._backends.current()}
        out.update(self._balancer.inflight)
        return out

    @property
    def bound_port(self) -> int:
        return self._bound_port

    @property
    def metrics_port(self) -> int:
        """Actual port of the metrics listener (0 when off)."""
        return self._metrics_port

    def _on_backends(self, backends: tuple[Backend, ...]) -> None:
        ready = {b.instance_id for b in backends}
        for iid in self._ready_ids - ready:
            self._balancer.forget(iid)  # it restarts: its cache (prefix affinity) is gone
        self._ready_ids = ready
        self.metrics.set_ready(backends)

    # --- metrics listener -------------------------------------------------------------
    async def _handle_metrics(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.path != "/metrics":
            return _error(404, "not found")
        if request.method != "GET":
            return _error(405, "method not allowed", headers={"Allow": "GET"})
        return web.Response(body=await self.metrics.render_off_loop(), headers={"Content-Type": METRICS_CONTENT_TYPE})

    # --- public listener ------------------------------------------------------------
    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        task = asyncio.current_task(self._loop)  # given the loop: no lookup (a getpid() in 3.11)
        assert task is not None
        self._handlers[task] = (request, self._loop.time())  # type: ignore[union-attr]
        try:
            resp = await self._dispatch(request)
        finally:
            self._handlers.pop(task, None)
            if self._tally is not None:
                self._tally()
        if self._stopping and not resp.prepared and not isinstance(resp, RelayedResponse):
            # (a relayed answer's head went out as the relay built it, keep-alive or not: closed
            # after a head that said keep-alive, the client's next request would fail)
            resp.force_close()
        return resp

    async def _dispatch(self, request: web.BaseRequest) -> web.StreamResponse:
        url = request.rel_url
        route = self._surface.route(request.method, url.raw_path)
        kind = route.kind
        if route.api != "v2" and self._openai is not None:
            return await self._openai.handle(request, route)  # /v1: answered in OpenAI's shape
        if self._openai_only and kind is not BAD_PATH:
            kind = NOT_FOUND  # NGINX serves everything else itself
        if kind is PUBLIC or (kind is ADMIN and self._allow_admin):
            return await self._forward(request, route.path, url.raw_query_string, route.stream)
        if kind is READY:
            if self._backends.current():
                resp = web.Response(status=200)
            else:
                resp = _error(503, "no inference instance is ready", {"Retry-After": RETRY_AFTER_S})
        elif kind is LIVE:
            resp = web.Response(status=200)
        elif kind is ADMIN:
            resp = _error(403, "admin API is disabled on this endpoint (see --allow-admin)")
        elif kind is METHOD_NOT_ALLOWED:
            resp = _error(405, f"method {request.method} not allowed", {"Allow": route.allow})
        elif kind is NOT_FOUND or kind is OPENAI:  # OPENAI: the API is off (--openai off)
            resp = _error(404, "not found")
        else:
            assert kind is BAD_PATH
            resp = _error(400, "malformed request path")
        self.metrics.count(NO_INSTANCE, resp.status)
        if self._log.isEnabledFor(logging.DEBUG):
            self._log.debug("%s %s -> %d (%s)", request.method, url.raw_path, resp.status, kind)
        return resp

    async def _read_body(self, request: web.BaseRequest) -> bytes | web.Response:
        """The whole request body, or the error response to send instead."""
        if not request.body_exists:
            return b""
        length = request.content_length
        if length is not None and length > self._max_body:
            return _error(413, f"request body over {self._max_body} bytes", close=True)
        if request.headers.get("Expect", "").lower() == "100-continue" and request.version >= (1, 1):
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0  # as aiohttp's own expect handler: body not started
        content = request.content
        try:
            if length is not None:
                return await content.readexactly(length)
            parts: list[bytes] = []
            total = 0
            while True:
                chunk = await content.readany()
                if not chunk:
                    return b"".join(parts)
                total += len(chunk)
                if total > self._max_body:
                    return _error(413, f"request body over {self._max_body} bytes", close=True)
                parts.append(chunk)
        except BodyTimeout as exc:
            return _error(408, str(exc), close=True)
        except Exception as exc:
            # Truncated or malformed chunked body (aiohttp's payload errors), or the
            # client went away mid-body. Nothing to forward; the connection is done.
            self._log.debug("bad request body from %s: %r", request.remote, exc)
            return _error(400, "incomplete or malformed request body", close=True)

    async def _forward(self, request: web.BaseRequest, path: str, query: str,
                       stream: bool, call: NativeCall | None = None) -> web.StreamResponse:
        """`call`: an OpenAI request, already read and translated (body, timer, relay).

        Long on purpose (the hot path: every request runs it once per attempt): hold, pick,
        send and the retry decision share a dozen locals, and splitting them into helpers
        costs a coroutine frame or a tuple per request in what the flame graph
        (bench/results/dataplane_bench-*-worker.svg) shows is already the worker's cost."""
        if call is None:
            body = await self._read_body(request)
            if not isinstance(body, bytes):
                self.metrics.count(NO_INSTANCE, body.status)
                return body
            # Generations only (generate, generate_stream, infer): their first event is a token.
            action = path.rpartition("/")[2]
            timer = self.metrics.timer(action) if action in _LLM_ACTIONS else None
        else:
            body, timer = call.body, call.timer
        if not await self._hold.ready():
            self.metrics.count(NO_INSTANCE, 503)
            return _error(503, "no inference instance is ready", {"Retry-After": RETRY_AFTER_S})
        hints = None
        # An OpenAI call has its prompt already: no second parse.
        if self._balancer.wants_prompt_of(len(call.prompt or "") if call is not None else len(body)):
            hints = RouteHints.from_prompt(call.prompt if call is not None else prompt_of_json(body))
        peer = request.remote
        headers = upstream_request_headers(request.headers, peer, peer in self._trusted)
        if call is not None:
            call.headers(headers)
        method = request.method
        pool = self._pool
        if pool is None or pool.closed:
            self.metrics.count(NO_INSTANCE, 503)
            return _error(503, "proxy is shutting down", {"Retry-After": RETRY_AFTER_S}, close=True)
        balancer = self._balancer
        tried: list[str] = []
        last = why = "no attempt made"
        loop: asyncio.AbstractEventLoop = self._loop  # type: ignore[assignment]  # serving: start() set it
        for attempt in range(self._max_attempts):
            # Re-read: the set may change between attempts; an instance that just died
            # may have been the only one, then the retry waits for one to be ready.
            backends = self._backends.current() or await self._hold.ready()
            b = balancer.pick(backends, tried, hints)
            if b is None and backends:
                # Only instances this request already tried are left: usually the one that
                # just failed, not yet out of rotation. Give the daemon a moment to see it
                # go (exits are seen in ~30 ms); then the hold waits for its restart.
                await asyncio.sleep(SAME_INSTANCE_RETRY_DELAY_S)
                backends = self._backends.current() or await self._hold.ready()
                b = balancer.pick(backends, (), hints)
            if b is None:
                break
            iid = b.instance_id
            tried.append(iid)
            self.metrics.routed(balancer.policy, balancer.last_reason, iid)
            if timer is not None:  # a generation: its first token ends the pick's pending prefill
                self.metrics.route_decision(balancer.last_decision, timer)
            # Path and query are sent exactly as classified, no requoting.
            target = f"{path}?{query}" if query else path
            balancer.acquire(iid)
            gauge = self.metrics.inflight_child(iid)
            gauge.inc()
            try:
                t0 = loop.time()
                try:
                    sent = pool.request(b.host, b.http_port, method, target, headers, body,
                                        connect_timeout_s=self._connect_s, idle_timeout_s=self._idle_s)
                    # wait_for only when asked for: it costs a task per request.
                    up = await (sent if self._first_byte_s is None else
                                asyncio.wait_for(sent, self._first_byte_s))
                except ConnectFailed as exc:
                    raise _Retryable("connect_refused") from exc
                except ConnectTimeout as exc:
                    raise _Retryable("connect_timeout") from exc
                except HeadTimeout:
                    # The instance took the request and went silent for idle_timeout_s:
                    # not retried (the work may be running), reported as a hang.
                    self._upstream_failed(b, "header_timeout")
                    self.metrics.count(iid, 504)
                    return _error(504, "instance did not answer within the idle timeout")
                except Disconnected as exc:
                    raise _Retryable("disconnected") from exc
                except BadResponse as exc:
                    self._upstream_failed(b, "bad_response")
                    self._log.warning("instance %s: bad response for %s: %r", iid, path, exc)
                    self.metrics.count(iid, 502)
                    return _error(502, "instance sent an invalid response")
                except asyncio.TimeoutError as exc:
                    # No response head within --first-byte-timeout-s: the request was
                    # cancelled there (the connection closed); nothing reached the client.
                    raise _Retryable("first_byte_timeout") from exc
                self.metrics.observe_latency(iid, loop.time() - t0)
                status = up.status
                refusal = self._refusal(status, iid, None)
                peeked = None
                if refusal is None and status >= 400:
                    # Small error bodies are read to tell a full queue apart (_refusal).
                    peeked = await self._peek_error(up)
                    refusal = self._refusal(status, iid, peeked[0] if peeked is not None else None)
                if refusal is not None:
                    up.close()
                    raise _Retryable(refusal, blame=False)
                if call is not None:
                    return await call.relay(request, up, b, peeked, timer)
                return await self._relay(request, up, b, stream, peeked, timer)
            except _Retryable as exc:
                last = f"instance {iid}: {exc.reason}"
                cause = exc.__cause__  # what the OS said, for the log only (the client sees no address)
                why = f"{last} ({cause})" if isinstance(cause, (ConnectFailed, ConnectTimeout)) else last
                self._attempt_failed(b, exc.reason, exc.blame, attempt + 1 < self._max_attempts)
                self._log.debug("attempt %d for %s failed: %s", attempt + 1, path, last)
            finally:
                balancer.release(iid)
                gauge.dec()
                if timer is not None:
                    timer.attempt_over()
        self.metrics.count(NO_INSTANCE, 502)
        self._log.warning("%s %s: all %d attempt(s) failed, last: %s", method, path, len(tried), why)
        return _error(502, f"all upstream attempts failed ({last})")

    def _is_ready(self, iid: str) -> bool:
        return any(b.instance_id == iid for b in self._backends.current())

    def _refusal(self, status: int, iid: str, error_body: bytes | None) -> str | None:
        """Why the instance's answer is retried on another instance, none of it having reached the
        client (None: the answer is the client's). The instance says it cannot serve (503), or it
        answered with an error while leaving rotation (a TP rank died mid-generation: Triton turns
        the model's error into a 400 or 500), or its queue is full (TRT-LLM's queue-full is an
        INTERNAL error: 500 from the model, 400 through an ensemble, Triton 2.51; told apart by
        the start of the error body). Neither says anything about the request. Both paths'
        rule (this one's _forward, the compiled front's front/path.py)."""
        if status == 503 or (status >= 400 and not self._is_ready(iid)):
            return f"http_{status}"
        if error_body is not None and QUEUE_FULL_TEXT in error_body:
            return "queue_full"
        return None

    def _attempt_failed(self, b: Backend, reason: str, blame: bool, retried: bool) -> None:
        """An attempt that reached no client byte, counted (`blame`: against the instance's passive
        health; `retried`: another attempt follows). Both paths'."""
        iid = b.instance_id
        self.metrics.failure(iid, reason)
        if blame:
            b.report_failure(reason)
        if reason != "disconnected":
            self._balancer.connect_failed(iid)  # deprioritise it for a moment
        if retried:
            self.metrics.retry(iid, reason)

    def _upstream_failed(self, b: Backend, reason: str) -> None:
        self.metrics.failure(b.instance_id, reason)
        b.report_failure(reason)

    def _settle(self, b: Backend, status: int) -> None:
        """Passive health and routing feedback for an answer the instance gave."""
        if status >= 500:
            self._upstream_failed(b, f"http_{status}")
        else:
            self._balancer.succeeded(b.instance_id)
            b.report_success()

    @staticmethod
    async def _peek_error(up: UpstreamResponse) -> tuple[bytes, bool] | None:
        """The start of an error body and whether it is all of it (None: too large to look).

        Error bodies are small (Triton answers them chunked); reading one before
        answering lets a full queue be retried elsewhere while nothing reached the
        client. A read that fails is retried like a dropped connection.
        """
        length = up.headers.get("Content-Length")
        if length is not None and (not length.isdigit() or int(length) > ERROR_PEEK_MAX):
            return None
        parts: list[bytes] = []
        total = 0
        try:
            while total <= ERROR_PEEK_MAX:
                chunk = await up.content.readany()
                if not chunk:
                    return b"".join(parts), True
                parts.append(chunk)
                total += len(chunk)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            up.close()
            raise _Retryable("disconnected") from exc
        return b"".join(parts), False

    async def _relay(self, request: web.BaseRequest, up: UpstreamResponse, b: Backend,
                     stream: bool, peeked: tuple[bytes, bool] | None = None,
                     timer: TokenTimer | None = None) -> web.StreamResponse:
        """Send the instance's response to the client; `up` is always closed or released."""
        status = up.status
        iid = b.instance_id
        self._settle(b, status)
        uh = up.headers
        length = uh.get("Content-Length")
        ctype = uh.get("Content-Type", "")
        clean = False
        if status >= 300:
            timer = None  # an error is no generation
        try:
            whole = peeked is not None and peeked[1]
            data = peeked[0] if peeked is not None else b""
            if not whole and not stream and not ctype.startswith(_SSE) and (
                    length is None or (length.isdigit() and int(length) <= BUFFER_MAX)):
                # A plain answer (Triton's are chunked, without a length): read it whole if it
                # is small, to send it in one write.
                try:
                    data, whole = await self._read_upto(up, data, BUFFER_MAX)
                except aiohttp.ClientError as exc:
                    # The instance died in the middle of a small answer we hold back: no byte
                    # of it reached the client, so it is retried like a dropped connection
                    # (a TP rank killed under load: 1 of 500 requests failed 502 before).
                    up.close()
                    raise _Retryable("disconnected") from exc
                except asyncio.TimeoutError as exc:
                    # Silent for idle_timeout_s mid-answer: a hang, not retried (as a
                    # missing head is not: the work may still be running).
                    self._upstream_failed(b, "idle_timeout")
                    self.metrics.count(iid, 502)
                    self._log.debug("instance %s: body failed: %r", iid, exc)
                    return _error(502, "instance dropped the connection mid-response")
            if whole:
                self.metrics.count(iid, status)
                clean = True
                if timer is not None:
                    timer.events(iid)  # the whole answer is its one event
                return web.Response(status=status, reason=up.reason, body=data,
                                    headers=client_response_headers(uh, keep_length=False))
            resp, clean = await self._stream(request, up, b, length, data, timer)
            return resp
        finally:
            # release() returns a fully read connection to the pool; close() drops
            # it, which is how the instance learns that the client went away.
            if clean:
                up.release()
            else:
                up.close()

    @staticmethod
    async def _read_upto(up: UpstreamResponse, head: bytes, limit: int) -> tuple[bytes, bool]:
        """The body from `head` on, up to just past `limit` bytes, and whether that is all of it."""
        parts = [head] if head else []
        total = len(head)
        while total <= limit:
            chunk = await up.readany()
            if not chunk:
                return b"".join(parts), True
            parts.append(chunk)
            total += len(chunk)
        return b"".join(parts), False

    async def _stream(self, request: web.BaseRequest, up: UpstreamResponse, b: Backend,
                      length: str | None, head: bytes = b"",
                      timer: TokenTimer | None = None) -> tuple[web.StreamResponse, bool]:
        """Relay as it arrives (`head`: body already read); True when the response was read to its end."""
        iid = b.instance_id
        headers = client_response_headers(up.headers, keep_length=length is not None)
        # SSE: every event is an output event; any other body is one answer, counted at its end.
        sse = SseCounter() if timer is not None and up.headers.get("Content-Type", "").startswith(_SSE) \
            else None
        if headers.get("Content-Type", "").startswith(_SSE) or length is None:
            headers.setdefault("X-Accel-Buffering", "no")  # tell any proxy in front not to buffer
            headers.setdefault("Cache-Control", "no-cache")
        status = up.status
        # What HTTP lets this response carry, as aiohttp decided it for a StreamResponse: a
        # body of unknown length goes chunked to an HTTP/1.1 client, and to an HTTP/1.0 one
        # ends with the connection.
        empty = request.method == "HEAD" or status in (204, 304) or status < 200
        framed = length is None and not empty and request.version >= (1, 1)
        keep_alive = request.keep_alive and (empty or length is not None or framed) and not self._stopping
        resp = RelayedResponse(status, keep_alive)
        self.metrics.count(iid, status)
        transport = request.transport
        if transport is None or transport.is_closing():
            return resp, False  # client already gone
        if sse is not None:
            def on_data(data: bytes) -> None:
                timer.events(iid, sse.feed(data))  # type: ignore[union-attr]
        else:
            def on_data(data: bytes) -> None:
                pass
        # From here the body goes from the instance's socket to the client's inside the
        # upstream connection's callback (UpstreamResponse.pipe), the head with the first
        # data; this coroutine only waits for the end and drains a slow client.
        up.pipe(transport, framed, on_data, head, response_head(
            status, up.reason, headers, version=request.version, framed=framed, keep_alive=keep_alive))
        try:
            while not await up.piped():
                await request.writer.drain()  # the client is the slow side: reading the instance waits
                up.resume()
        except ConnectionError:
            # Client went away: returning closes `up`, so Triton sees the cancel.
            self._log.debug("client %s disconnected mid-stream from instance %s", request.remote, iid)
            resp.force_close()
            return resp, False
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            # Committed: bytes may have reached the client. Truncate so it can tell.
            reason = "idle_timeout" if isinstance(exc, asyncio.TimeoutError) else "body_error"
            self._upstream_failed(b, reason)
            self._log.warning("instance %s: response cut mid-stream (%s)", iid, reason)
            resp.force_close()
            request.protocol.force_close()
            return resp, False
        if timer is not None and sse is None:
            timer.events(iid)
        return resp, True


def install_uvloop_if_available() -> bool:
    """For the daemon's entry point: use uvloop when installed, never require it."""
    try:
        import uvloop  # type: ignore[import-not-found]
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


__all__ = ["EmbeddedProxy", "install_uvloop_if_available"]
