"""Errors from an instance that cannot serve are retried elsewhere; real client errors are not."""

import asyncio

import aiohttp
from aiohttp import web
import pytest

from orchestrator.config import Settings
from orchestrator.routing.backends import Backend, ReadyBackends
from orchestrator.dataplane.embedded import EmbeddedProxy
from tests.test_proxy_embedded import AppUpstream

pytestmark = pytest.mark.unit

GEN = "/v2/models/ensemble/generate"


def backend(iid: str, port: int) -> Backend:
    return Backend(iid, "127.0.0.1", port, 1, 2)


async def start(*upstreams: AppUpstream) -> tuple[EmbeddedProxy, ReadyBackends]:
    backends = ReadyBackends()
    backends.publish(tuple(backend(str(i), u.port) for i, u in enumerate(upstreams)))
    proxy = EmbeddedProxy(Settings(listen="127.0.0.1:0", metrics_listen="", lb_policy="round-robin"), backends)
    await proxy.start()
    return proxy, backends


async def post(proxy: EmbeddedProxy) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{proxy.bound_port}{GEN}", json={"text_input": "x"}) as r:
            return r.status, await r.json()


async def test_503_from_an_instance_is_retried_on_another():
    async def unavailable(request):
        return web.json_response({"error": "peer rank lost"}, status=503)
    bad, good = await AppUpstream(unavailable).start(), await AppUpstream().start()
    proxy, _ = await start(bad, good)
    try:
        results = [await post(proxy) for _ in range(4)]
        assert all(code == 200 and body["port"] == good.port for code, body in results), results
        assert len(bad.requests) >= 1  # it was tried, and its 503 never reached the client
    finally:
        await proxy.stop()
        await bad.close()
        await good.close()


async def test_error_from_instance_that_left_rotation_is_retried():
    box = {}

    async def dying(request):
        # The daemon takes this instance out of rotation while it is answering.
        box["backends"].publish((backend("1", box["good"].port),))
        return web.json_response({"error": "in ensemble: peer rank closed the connection"}, status=400)

    bad = await AppUpstream(dying).start()
    good = await AppUpstream().start()
    box["good"] = good
    proxy, backends = await start(bad, good)
    box["backends"] = backends
    try:
        code, body = await post(proxy)  # round robin starts with instance 0
        assert code == 200 and body["port"] == good.port
        assert len(bad.requests) == 1
    finally:
        await proxy.stop()
        await bad.close()
        await good.close()


async def test_client_error_from_ready_instance_is_passed_through():
    async def invalid(request):
        return web.json_response({"error": "unexpected inference input 'foo'"}, status=400)
    a, b = await AppUpstream(invalid).start(), await AppUpstream(invalid).start()
    proxy, _ = await start(a, b)
    try:
        code, body = await post(proxy)
        assert code == 400 and "unexpected inference input" in body["error"]
        assert len(a.requests) + len(b.requests) == 1  # no retry of a genuine client error
    finally:
        await proxy.stop()
        await a.close()
        await b.close()


async def start_with(settings: Settings, *upstreams: AppUpstream) -> EmbeddedProxy:
    backends = ReadyBackends()
    backends.publish(tuple(backend(str(i), u.port) for i, u in enumerate(upstreams)))
    proxy = EmbeddedProxy(settings, backends)
    await proxy.start()
    return proxy


def silent_for(seconds: float, cancelled: list[bool]):
    async def handler(request):
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            cancelled.append(True)  # the proxy gave up on it and closed the connection
            raise
        return web.json_response({"port": request.transport.get_extra_info("sockname")[1]})
    return handler


async def test_no_first_byte_in_time_is_cancelled_and_retried_elsewhere():
    cancelled: list[bool] = []
    slow, good = await AppUpstream(silent_for(30, cancelled)).start(), await AppUpstream().start()
    proxy = await start_with(Settings(listen="127.0.0.1:0", metrics_listen="", lb_policy="round-robin",
                                      first_byte_timeout_s=0.3), slow, good)
    try:
        results = [await post(proxy) for _ in range(4)]
        assert all(code == 200 and body["port"] == good.port for code, body in results), results
        assert len(slow.requests) >= 1
        for _ in range(50):  # the cancel reaches the slow upstream's handler through its socket
            if len(cancelled) == len(slow.requests):
                break
            await asyncio.sleep(0.05)
        assert len(cancelled) == len(slow.requests), (cancelled, len(slow.requests))
        metrics = proxy.metrics.render().decode()
        assert 'trtllm_orch_proxy_retries_total{instance="0",reason="first_byte_timeout"}' in metrics
    finally:
        await proxy.stop()
        await slow.close()
        await good.close()


async def test_without_a_first_byte_deadline_a_slow_instance_is_waited_for():
    cancelled: list[bool] = []
    slow = await AppUpstream(silent_for(0.6, cancelled)).start()
    proxy = await start_with(Settings(listen="127.0.0.1:0", metrics_listen=""), slow)
    try:
        code, body = await post(proxy)
        assert code == 200 and body["port"] == slow.port and not cancelled
    finally:
        await proxy.stop()
        await slow.close()


async def test_instance_dying_mid_answer_before_any_byte_reached_the_client_is_retried():
    """A small plain answer is read whole before it is sent (one write). An instance that
    dies in the middle of it (a TP rank killed under load) has sent the client nothing:
    the request goes to another instance instead of failing 502."""
    from tests.test_proxy_embedded import RawUpstream

    async def dies_mid_body(reader, writer, head, body):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"5\r\n{\"tex\r\n")
        await writer.drain()
        return False  # close the connection in the middle of the chunked body

    dying, good = await RawUpstream(dies_mid_body).start(), await AppUpstream().start()
    proxy, _ = await start(dying, good)
    try:
        results = [await post(proxy) for _ in range(4)]
        assert all(code == 200 and body["port"] == good.port for code, body in results), results
        assert len(dying.requests) >= 1
        assert 'reason="disconnected"' in proxy.metrics.render().decode()
    finally:
        await proxy.stop()
        await dying.close()
        await good.close()
