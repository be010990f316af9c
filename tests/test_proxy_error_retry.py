"""Errors from an instance that cannot serve are retried elsewhere; real client errors are not."""

import aiohttp
from aiohttp import web
import pytest

from orchestrator.config import Settings
from orchestrator.proxy.backends import Backend, ReadyBackends
from orchestrator.proxy.embedded import EmbeddedProxy
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
