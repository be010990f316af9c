"""The gRPC proxy routes with the shared Balancer: in-flight counts and the cool-down.

In-process fakes on loopback: one raw-bytes gRPC server, and a port nobody listens on.
"""

from __future__ import annotations

import asyncio

import grpc
import grpc.aio
import pytest

from orchestrator.config import Settings
from orchestrator.routing.backends import Backend
from orchestrator.dataplane.grpc_proxy import GrpcProxy
from tests.fakes import RecordingBackends
from tests.harness import free_port

pytestmark = pytest.mark.unit

INFER = "/inference.GRPCInferenceService/ModelInfer"


class Echo(grpc.GenericRpcHandler):
    def service(self, details):
        async def unary(request: bytes, context) -> bytes:
            return b"ok:" + request
        return grpc.unary_unary_rpc_method_handler(unary)


async def test_refused_instance_cools_down_for_the_next_calls():
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((Echo(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    live = Backend("0", "127.0.0.1", 1, port, 1)
    dead = Backend("1", "127.0.0.1", 1, free_port(), 1)
    ready = RecordingBackends()
    proxy = GrpcProxy(Settings(grpc_listen="127.0.0.1:0"), ready)  # least-outstanding
    await proxy.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{proxy.bound_port}") as ch:
            call = ch.unary_unary(INFER)
            ready.publish((dead,))
            try:
                await call(b"x", timeout=5)
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE
            assert [iid for iid, _ in ready.failures] == ["1"]
            ready.publish((live, dead))
            # Both idle, so least-outstanding alone would pick the dead one about half the
            # time; cooling down (1 s, far longer than these calls) it is not tried at all.
            for i in range(10):
                assert await call(b"%d" % i, timeout=5) == b"ok:%d" % i
            assert [iid for iid, _ in ready.failures] == ["1"]
            assert proxy.inflight() == {"0": 0, "1": 0}
    finally:
        await proxy.stop(0.5)
        await server.stop(None)


class Tagged(grpc.GenericRpcHandler):
    """Answers b"<tag>:<request>" after `delay_s`; counts the calls it took and those cancelled."""

    def __init__(self, tag: bytes, delay_s: float) -> None:
        self.tag, self.delay_s = tag, delay_s
        self.calls = self.cancelled = 0

    def service(self, details):
        async def unary(request: bytes, context) -> bytes:
            self.calls += 1
            try:
                await asyncio.sleep(self.delay_s)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
            return self.tag + b":" + request
        return grpc.unary_unary_rpc_method_handler(unary)


async def serve(handler: grpc.GenericRpcHandler) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def test_no_first_message_in_time_is_cancelled_and_retried_elsewhere():
    silent, fast = Tagged(b"silent", 30.0), Tagged(b"fast", 0.0)
    (s1, p1), (s2, p2) = await serve(silent), await serve(fast)
    ready = RecordingBackends()
    ready.publish((Backend("0", "127.0.0.1", 1, p1, 1), Backend("1", "127.0.0.1", 1, p2, 1)))
    proxy = GrpcProxy(Settings(grpc_listen="127.0.0.1:0", lb_policy="round-robin", first_byte_timeout_s=0.3),
                      ready)
    await proxy.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{proxy.bound_port}") as ch:
            call = ch.unary_unary(INFER)
            for i in range(4):
                assert await call(b"%d" % i, timeout=10) == b"fast:%d" % i
        assert silent.calls >= 1
        for _ in range(50):  # the cancel reaches the silent server through its channel
            if silent.cancelled == silent.calls:
                break
            await asyncio.sleep(0.05)
        assert silent.cancelled == silent.calls
        assert 'reason="first_byte_timeout"' in proxy.metrics.render().decode()
    finally:
        await proxy.stop(0.5)
        await s1.stop(None)
        await s2.stop(None)
