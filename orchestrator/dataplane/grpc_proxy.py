"""The embedded gRPC load balancer: one public port in front of every instance's gRPC port.

Messages are forwarded as raw bytes (no protobuf parsing on the hot path): a generic
handler looks the method up in Triton's method table, picks a ready instance and
replays the call on one long-lived channel per instance. Only
`inference.GRPCInferenceService` is served; every other method is UNIMPLEMENTED, and
the admin half of Triton's API (load/unload, shared memory, trace, logging, config,
stats) is PERMISSION_DENIED unless `--allow-admin`. Both method tables come from
`surface.py`; instances are chosen by the same `Balancer` as the HTTP proxy's.

Retries follow what Envoy and NGINX treat as safe: a unary call is retried on another
instance when it fails with UNAVAILABLE (for a unary call nothing has reached the client
yet); a stream is retried only until its first response message reached the client.
Only transport failures (the channel to the instance is not READY afterwards: refused,
reset) and a missed first-byte deadline count against the instance (its passive health,
through its Backend); an UNAVAILABLE that Triton itself answered (e.g. a model being
reloaded) and TRT-LLM's queue-full INTERNAL error are retried on another instance but
not blamed on the instance. While no instance is ready, calls are held (hold.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import grpc.aio

from orchestrator.config import Settings
from orchestrator.errors import OrchError
from orchestrator.routing.backends import Backend, ReadyBackends
from orchestrator.routing.balancer import Balancer
from orchestrator.dataplane.embedded import QUEUE_FULL_TEXT, SAME_INSTANCE_RETRY_DELAY_S
from orchestrator.dataplane.hold import HoldGate
from orchestrator.routing.llm_policies import RouteHints
from orchestrator.dataplane.metrics import ProxyMetrics, TokenTimer
from orchestrator.routing.prompt import prompt_of_grpc
from orchestrator.routing.surface import ADMIN_GRPC_METHODS, GRPC_SERVICE, PUBLIC_GRPC_METHODS, STREAMING_GRPC_METHODS

# Request metadata that belongs to this hop, not to the call: HTTP/2 pseudo headers
# (':'-prefixed), gRPC's own keys (grpc-timeout is re-derived from the deadline) and
# the RFC 9110 hop-by-hop set.
_HOP_BY_HOP = frozenset({
    "te", "content-type", "user-agent", "connection", "keep-alive", "proxy-connection",
    "transfer-encoding", "upgrade", "host", "proxy-authorization", "proxy-authenticate", "trailer",
})

# ServerReadyResponse/ServerLiveResponse are `bool ready|live = 1`: true encodes as
# field 1 varint 1, false as the empty message (proto3 omits defaults). Encoding them
# by hand keeps tritonclient/protobuf out of the daemon's dependencies.
_BOOL_TRUE = b"\x08\x01"
_BOOL_FALSE = b""

# A server-side deadline further away than this means "no deadline" (gRPC reports an
# infinite deadline as a huge remaining time).
_NO_DEADLINE_S = 10 * 365 * 86400.0

NO_READY = "no ready instance"


def _forwardable(metadata: Any) -> tuple[tuple[str, Any], ...] | None:
    if not metadata:
        return None
    out = tuple((k, v) for k, v in metadata
                if k[0] != ":" and not k.startswith("grpc-") and k not in _HOP_BY_HOP)
    return out or None


class _Upstream:
    """One instance's long-lived channel and its method callables (made once each)."""

    __slots__ = ("backend", "channel", "_callables", "failing")

    def __init__(self, backend: Backend, options: list[tuple[str, Any]]) -> None:
        self.backend = backend
        self.failing = False  # logged as unreachable; cleared by the next answer
        self.channel = grpc.aio.insecure_channel(backend.grpc_target, options=options)
        self._callables: dict[str, Any] = {}

    def callable(self, method: str, streaming: bool) -> Any:
        mc = self._callables.get(method)
        if mc is None:
            # serializer None: the request and response are already bytes.
            factory = self.channel.stream_stream if streaming else self.channel.unary_unary
            mc = self._callables[method] = factory(method, request_serializer=None,
                                                   response_deserializer=None)
        return mc

    def transport_failed(self) -> bool:
        # After an UNAVAILABLE, a channel that is no longer READY lost (or never had)
        # its connection: the request did not get an answer from Triton itself.
        return self.channel.get_state(try_to_connect=False) != grpc.ChannelConnectivity.READY


class GrpcProxy:
    def __init__(self, settings: Settings, backends: ReadyBackends,
                 logger: logging.Logger | None = None, metrics: ProxyMetrics | None = None, *,
                 shared: Any = None, reuseport: bool = False) -> None:
        """shared: a data-plane worker's global in-flight view and its row (Balancer);
        reuseport: every worker binds the gRPC port itself (grpcio takes no listening
        socket), so the kernel spreads HTTP/2 connections over them."""
        self._settings = settings
        self._backends = backends
        self._log = logger or logging.getLogger("trtllm_orch.grpc_proxy")
        self._balancer = Balancer(settings.lb_policy, shared=shared)
        # Served on the HTTP proxy's metrics listener when make_proxies shares it.
        self.metrics = metrics or ProxyMetrics()
        self._hold = HoldGate(backends, settings.hold_s, settings.max_held,
                              on_held=self.metrics.watch_held("grpc", lambda: self._hold.held))
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}
        self.apply_settings(settings)
        size = settings.max_body_bytes
        self._channel_options = [
            ("grpc.max_send_message_length", size),
            ("grpc.max_receive_message_length", size),
            # The connect timeout: gRPC waits max(backoff, this) for one connect attempt.
            ("grpc.min_reconnect_backoff_ms", int(settings.connect_timeout_s * 1000)),
            # An instance that restarts on the same port must be reachable again within
            # seconds, not after gRPC's default 120 s backoff cap.
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 2000),
        ]
        self._server_options = [
            ("grpc.max_send_message_length", size),
            ("grpc.max_receive_message_length", size),
            # gRPC sets SO_REUSEPORT by default: a second daemon on the same port would
            # then bind "successfully" and steal half the connections. Only the workers of
            # one data plane share it (`up` checks the port is free first).
            ("grpc.so_reuseport", 1 if reuseport else 0),
        ]
        self._upstreams: dict[str, _Upstream] = {}
        self._retired: set[_Upstream] = set()  # left the ready set; closing once idle
        self._tasks: set[asyncio.Task[Any]] = set()  # their closes; owned here, ended in stop()
        self._server: grpc.aio.Server | None = None
        self._unsubscribe: Callable[[], None] | None = None
        self._port = 0

    def apply_settings(self, settings: Settings) -> None:
        """The knobs a reload changes in place (the listen address needs `down`/`up`)."""
        self._settings = settings
        if settings.lb_policy != self._balancer.policy:
            self._balancer.set_policy(settings.lb_policy)
        self._max_attempts = settings.max_attempts
        self._first_byte_s = settings.first_byte_timeout_s or None
        self._hold.hold_s, self._hold.max_held = settings.hold_s, settings.max_held
        # In place: the server's generic handler holds this dict (allow_admin may change).
        handlers = self._build_handlers()
        self._handlers.clear()
        self._handlers.update(handlers)

    # --- lifecycle ---------------------------------------------------------------
    async def start(self) -> None:
        address = self._settings.grpc_listen
        if not address:
            raise OrchError("--grpc-listen is empty: the gRPC proxy is disabled")
        server = grpc.aio.server(options=self._server_options)
        server.add_generic_rpc_handlers((_Handler(self._handlers),))
        try:
            port = server.add_insecure_port(address)
        except RuntimeError:  # grpcio >= 1.51 raises instead of returning 0
            port = 0
        if port == 0:
            raise OrchError(f"--grpc-listen={address!r}: cannot bind (address in use or not local?)")
        await server.start()
        self._server, self._port = server, port
        self._unsubscribe = self._backends.subscribe(self._on_ready_set)
        self._hold.start()
        self._log.info("grpc proxy listening on %s (port %d, policy %s)", address, port,
                       self._settings.lb_policy)

    async def stop(self, grace_s: float = 5.0) -> None:
        self._hold.close()
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._server is not None:
            # Stops accepting at once; open calls get grace_s, then are cancelled.
            await self._server.stop(grace_s)
            self._server = None
        upstreams = list(self._upstreams.values()) + list(self._retired)
        self._upstreams, self._retired = {}, set()
        for up in upstreams:
            await up.channel.close(None)  # cancels whatever the server's grace left running
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    @property
    def bound_port(self) -> int:
        return self._port

    def inflight(self) -> dict[str, int]:
        counts = {b.instance_id: 0 for b in self._backends.current()}
        counts.update(self._balancer.inflight)
        return counts

    # --- ready set -----------------------------------------------------------------
    def _on_ready_set(self, backends: tuple[Backend, ...]) -> None:
        keep = {b.instance_id: b for b in backends}
        for iid, up in list(self._upstreams.items()):
            if keep.get(iid) != up.backend:
                del self._upstreams[iid]
                self._retire(up)
                self._balancer.forget(iid)

    def _retire(self, up: _Upstream) -> None:
        # Calls already on the channel may finish (a long generation is not cut because
        # its instance stopped being routable); new calls never see this channel.
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # published from outside the loop: nothing can be open on it
            return
        self._retired.add(up)
        task = loop.create_task(up.channel.close(self._settings.idle_timeout_s))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda _: self._retired.discard(up))

    def _upstream(self, backend: Backend) -> _Upstream:
        up = self._upstreams.get(backend.instance_id)
        if up is None or up.backend != backend:
            if up is not None:
                self._retire(up)
            up = self._upstreams[backend.instance_id] = _Upstream(backend, self._channel_options)
        return up

    async def _pick(self, tried: set[str] | None, hints: RouteHints | None,
                    timer: TokenTimer | None = None) -> Backend | None:
        # Unlike the HTTP proxy, never back to an instance this call already tried: a
        # gRPC UNAVAILABLE may be the instance's own answer, and would be again. An
        # instance that restarted since is a new one: the hold waits for it.
        backends = self._backends.current() or await self._hold.ready()
        chosen = self._balancer.pick(backends, tried or (), hints)
        if chosen is None and backends and tried:
            # Only tried ones left: usually the one that just failed, not yet out of
            # rotation. Give the daemon a moment to see it go, then hold for a restart.
            await asyncio.sleep(SAME_INSTANCE_RETRY_DELAY_S)
            if not self._backends.current():
                tried.clear()  # everything left rotation: what comes back is restarted
            backends = self._backends.current() or await self._hold.ready()
            chosen = self._balancer.pick(backends, tried, hints)
        if chosen is not None:
            self.metrics.routed(self._balancer.policy, self._balancer.last_reason, chosen.instance_id)
            if timer is not None:  # a generation: its first token ends the pick's pending prefill
                self.metrics.route_decision(self._balancer.last_decision, timer)
        return chosen

    def _hints(self, message: bytes | None) -> RouteHints | None:
        if message is None or not self._balancer.wants_prompt_of(len(message)):
            return None
        return RouteHints.from_prompt(prompt_of_grpc(message))

    def _answered(self, up: _Upstream) -> None:
        up.failing = False
        self._balancer.succeeded(up.backend.instance_id)
        up.backend.report_success()

    def _on_unavailable(self, up: _Upstream, err: grpc.aio.AioRpcError) -> None:
        if up.transport_failed():
            self._balancer.connect_failed(up.backend.instance_id)  # cool down: try others first
            if not up.failing:  # once per outage, not once per call
                up.failing = True
                self._log.warning("instance %s (%s) unreachable: %s", up.backend.instance_id,
                                  up.backend.grpc_target, err.details())
            up.backend.report_failure(f"grpc: {err.details()}")

    def _retrying(self, iid: str, err: grpc.aio.AioRpcError, tried: set[str] | None) -> set[str]:
        """The instances a call retried after `err` from `iid` must not be sent to again (unary and
        streaming calls alike); the retry counted by its cause."""
        tried = tried or set()
        tried.add(iid)
        self.metrics.retry(iid, _retry_cause(err))
        return tried

    def _timeout(self, context: grpc.aio.ServicerContext) -> tuple[float, bool]:
        """Upstream timeout, and whether it is ours (the client gave no deadline)."""
        remaining = context.time_remaining()
        if remaining is None or remaining > _NO_DEADLINE_S:
            # No client deadline: bound the call anyway, so a hung instance cannot hold
            # a unary call forever.
            return self._settings.idle_timeout_s, True
        return remaining, False

    # --- handlers --------------------------------------------------------------------
    def _build_handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        handlers: dict[str, grpc.RpcMethodHandler] = {}
        for name in PUBLIC_GRPC_METHODS + ADMIN_GRPC_METHODS:
            method = f"/{GRPC_SERVICE}/{name}"
            if name in ADMIN_GRPC_METHODS and not self._settings.allow_admin:
                handlers[method] = grpc.unary_unary_rpc_method_handler(_deny_admin)
            elif name in STREAMING_GRPC_METHODS:
                handlers[method] = grpc.stream_stream_rpc_method_handler(self._make_stream(method))
            else:
                handlers[method] = grpc.unary_unary_rpc_method_handler(self._make_unary(method, name))
        return handlers

    def _make_unary(self, method: str, name: str):
        local_answer = {"ServerReady": _BOOL_FALSE, "ServerLive": _BOOL_TRUE}.get(name)

        async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            metadata = _forwardable(context.invocation_metadata())
            tried: set[str] | None = None
            last: grpc.aio.AioRpcError | None = None
            hints = self._hints(request) if local_answer is None else None
            timer = self.metrics.timer(name) if name == "ModelInfer" else None
            for _ in range(self._max_attempts):
                backend = await self._pick(tried, hints, timer) if local_answer is None else \
                    self._balancer.pick(self._backends.current(), tried or ())
                if backend is None:
                    break
                iid = backend.instance_id
                up = self._upstream(backend)
                timeout, ours = self._timeout(context)
                first_byte = self._first_byte_s is not None and self._first_byte_s < timeout
                if first_byte:
                    timeout, ours = self._first_byte_s, True  # type: ignore[assignment]  # first_byte: set
                self._balancer.acquire(iid)
                try:
                    # Awaiting the call cancels it upstream if this handler is cancelled
                    # (the client went away or its deadline passed).
                    response = await up.callable(method, False)(request, metadata=metadata,
                                                                 timeout=timeout)
                except grpc.aio.AioRpcError as err:
                    code = err.code()
                    retry = code is grpc.StatusCode.UNAVAILABLE or _queue_full(err) or (
                        code is grpc.StatusCode.DEADLINE_EXCEEDED and first_byte)
                    if code is grpc.StatusCode.UNAVAILABLE:
                        self._on_unavailable(up, err)
                    elif code is grpc.StatusCode.DEADLINE_EXCEEDED and ours:
                        backend.report_failure(f"grpc: no answer within {timeout:g} s")
                    if retry:
                        last = err
                        tried = self._retrying(iid, err, tried)
                        continue
                    await context.abort(code, err.details() or "",
                                        _forwardable(err.trailing_metadata()) or ())
                else:
                    self._answered(up)
                    if timer is not None:
                        timer.events(iid)
                    return response
                finally:
                    self._balancer.release(iid)
                    if timer is not None:
                        timer.attempt_over()
            # Nothing answered. The proxy itself is alive; it is "not ready" when no
            # instance is, which is an answer, not an error, for ServerReady.
            if local_answer is not None:
                return local_answer
            if last is not None:
                await context.abort(last.code(), last.details() or "",
                                    _forwardable(last.trailing_metadata()) or ())
            await context.abort(grpc.StatusCode.UNAVAILABLE, NO_READY)

        return unary

    def _make_stream(self, method: str):
        async def stream(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
            metadata = _forwardable(context.invocation_metadata())
            inbox = _Inbox(requests)
            try:
                await self._stream_attempts(method, metadata, inbox, context)
            finally:
                inbox.close()

        return stream

    async def _stream_attempts(self, method: str, metadata: Any, inbox: "_Inbox",
                               context: grpc.aio.ServicerContext) -> None:
        """A stream's attempts: pick, open, relay messages both ways, retry before the first
        answer. Long on purpose (every ModelStreamInfer message passes through its loop):
        the relay's state stays in locals."""
        tried: set[str] | None = None
        last: grpc.aio.AioRpcError | None = None
        # The first request message (kept for the replay) starts the generation's clock: a
        # client may open the stream well before it sends (the upstream call waits with it).
        first = await inbox.first()
        hints = self._hints(first)
        timer = self.metrics.timer("ModelStreamInfer")
        for _ in range(self._max_attempts):
            backend = await self._pick(tried, hints, timer)
            if backend is None:
                break
            iid = backend.instance_id
            up = self._upstream(backend)
            remaining = context.time_remaining()
            timeout = None if remaining is None or remaining > _NO_DEADLINE_S else remaining
            # No proxy-imposed timeout on streams: Triton clients keep one stream open
            # and idle between requests for as long as they like.
            call = up.callable(method, True)(metadata=metadata, timeout=timeout)
            pump = asyncio.create_task(inbox.pump(call))
            self._balancer.acquire(iid)
            try:
                while True:
                    if inbox.committed or self._first_byte_s is None:
                        response = await call.read()
                    else:
                        try:
                            response = await asyncio.wait_for(call.read(), self._first_byte_s)
                        except asyncio.TimeoutError:
                            backend.report_failure(f"grpc: no first message within {self._first_byte_s:g} s")
                            tried = tried or set()
                            tried.add(iid)
                            self.metrics.retry(iid, "first_byte_timeout")
                            break  # the finally cancels this call; the next attempt replays
                    if response is grpc.aio.EOF:
                        return
                    if not inbox.committed:
                        inbox.commit()
                        self._answered(up)
                    await context.write(response)
                    timer.events(iid)
                continue
            except grpc.aio.AioRpcError as err:
                code = err.code()
                if code is grpc.StatusCode.UNAVAILABLE:
                    self._on_unavailable(up, err)
                if (code is grpc.StatusCode.UNAVAILABLE or _queue_full(err)) and not inbox.committed:
                    last = err
                    tried = self._retrying(iid, err, tried)
                    continue
                await context.abort(code, err.details() or "",
                                    _forwardable(err.trailing_metadata()) or ())
            finally:
                self._balancer.release(iid)
                timer.attempt_over()
                pump.cancel()
                call.cancel()  # no-op when finished; stops the upstream when the client left
        if last is not None:
            await context.abort(last.code(), last.details() or "",
                                _forwardable(last.trailing_metadata()) or ())
        await context.abort(grpc.StatusCode.UNAVAILABLE, NO_READY)


def _queue_full(err: grpc.aio.AioRpcError) -> bool:
    # INTERNAL from the model itself; through an ensemble Triton may report another code.
    return QUEUE_FULL_TEXT.decode() in (err.details() or "")


def _retry_cause(err: grpc.aio.AioRpcError) -> str:
    """The retries metric's reason, in the HTTP proxy's words where they mean the same."""
    if _queue_full(err):
        return "queue_full"
    if err.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
        return "first_byte_timeout"
    return "unavailable"


class _Inbox:
    """The client's side of a stream, readable by successive upstream attempts.

    One task reads the client for the whole call (cancelling a read of gRPC's request
    iterator would end it), and every request is kept until the first response reached
    the client, so a retry can replay them; after that nothing is kept.
    """

    __slots__ = ("_queue", "_reader", "_replay", "_client_done", "committed")

    _DONE = object()

    def __init__(self, requests: AsyncIterator[bytes]) -> None:
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._replay: list[bytes] = []
        self._client_done = False
        self.committed = False
        self._reader = asyncio.create_task(self._read(requests))

    async def _read(self, requests: AsyncIterator[bytes]) -> None:
        try:
            async for message in requests:
                self._queue.put_nowait(message)
        except Exception:  # noqa: BLE001 - the client went away; the call ends on its own
            pass
        finally:
            self._queue.put_nowait(self._DONE)

    def commit(self) -> None:
        self.committed = True
        self._replay = []

    async def first(self) -> bytes | None:
        """The client's first message (kept for the replay), for routing on its prompt."""
        if not self._replay and not self._client_done:
            message = await self._queue.get()
            if message is self._DONE:
                self._client_done = True
                return None
            self._replay.append(message)
        return self._replay[0] if self._replay else None

    async def pump(self, call: Any) -> None:
        try:
            for message in list(self._replay):
                await call.write(message)
            while not self._client_done:
                message = await self._queue.get()
                if message is self._DONE:
                    self._client_done = True
                    break
                if not self.committed:
                    self._replay.append(message)  # before the write: a failed write is replayed
                await call.write(message)
            await call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass  # the call ended; its status reaches the client through the read side

    def close(self) -> None:
        self._reader.cancel()


class _Handler(grpc.GenericRpcHandler):
    __slots__ = ("_handlers",)

    def __init__(self, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self._handlers = handlers

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        # None: gRPC answers UNIMPLEMENTED (unknown service or method).
        return self._handlers.get(handler_call_details.method)


async def _deny_admin(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                        "admin API disabled on the load balancer (see --allow-admin)")
    return b""
