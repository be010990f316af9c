"""The gRPC proxy routes with the shared Balancer: in-flight counts and the cool-down.

In-process fakes on loopback: one raw-bytes gRPC server, and a port nobody listens on.
"""

from __future__ import annotations

import socket

import grpc
import grpc.aio
import pytest

from orchestrator.config import Settings
from orchestrator.proxy.backends import Backend
from orchestrator.proxy.grpc_proxy import GrpcProxy
from tests.fakes import RecordingBackends

pytestmark = pytest.mark.unit

INFER = "/inference.GRPCInferenceService/ModelInfer"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
