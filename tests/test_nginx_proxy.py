"""A real nginx (NginxProxy) in front of small aiohttp upstreams on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
from pathlib import Path

import aiohttp
import pytest
import yarl
from aiohttp import web

from orchestrator.config import Settings
from orchestrator.errors import EnvironmentProblem, OrchError
from orchestrator.proxy.backends import Backend, ReadyBackends
from orchestrator.proxy.nginx import NginxProxy, _live_group_members

NGINX = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")
pytestmark = pytest.mark.skipif(NGINX is None, reason="nginx binary not installed")


class Upstream:
    """One fake Triton instance: records hits; streams can be held open by the test."""

    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        self.hits: list[str] = []
        self.headers: list[dict[str, str]] = []
        self.release = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.port = 0
        self.grpc_port = 1  # nothing listens there: the gRPC test runs its own server

    async def start(self) -> "Upstream":
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    @property
    def backend(self) -> Backend:
        return Backend(self.instance_id, "127.0.0.1", self.port, self.grpc_port, 1)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.hits.append(request.path)
        self.headers.append(dict(request.headers))
        await request.read()
        if request.path.endswith("/generate_stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b'data: {"chunk":1,"instance":"%s"}\n\n' % self.instance_id.encode())
            await self.release.wait()  # the test lets the stream finish
            await resp.write(b'data: {"chunk":2}\n\n')
            await resp.write_eof()
            return resp
        return web.json_response({"instance": self.instance_id, "path": request.path,
                                  "xff": request.headers.get("X-Forwarded-For")})


@pytest.fixture
async def upstreams():
    ups = [await Upstream(str(i)).start() for i in range(2)]
    yield ups
    for u in ups:
        u.release.set()
        await u.stop()


def make_settings(**kw) -> Settings:
    base = dict(listen="127.0.0.1:0", grpc_listen="127.0.0.1:0", nginx=NGINX, idle_timeout_s=30.0,
                connect_timeout_s=1.0)
    base.update(kw)
    return Settings(**base)


@pytest.fixture
async def proxy_factory(tmp_path: Path):
    made: list[NginxProxy] = []

    async def make(ready: ReadyBackends, **kw) -> NginxProxy:
        proxy = NginxProxy(make_settings(**kw), ready, tmp_path / f"state{len(made)}")
        await proxy.start()
        made.append(proxy)
        return proxy

    yield make
    for proxy in made:
        await proxy.stop(grace_s=1.0)


def url(proxy: NginxProxy, path: str) -> str:
    return f"http://127.0.0.1:{proxy.bound_port}{path}"


@pytest.mark.process
async def test_routes_to_both_and_replaces_forwarded_for(upstreams, proxy_factory) -> None:
    ready = ReadyBackends()
    ready.publish(tuple(u.backend for u in upstreams))
    proxy = await proxy_factory(ready)
    seen = set()
    async with aiohttp.ClientSession() as session:
        for _ in range(10):
            async with session.post(url(proxy, "/v2/models/ensemble/generate"), json={"text_input": "hi"},
                                    headers={"X-Forwarded-For": "6.6.6.6"}) as resp:
                assert resp.status == 200
                body = await resp.json()
                seen.add(body["instance"])
                assert body["xff"] == "127.0.0.1"
        async with session.get(url(proxy, "/v2/models/ensemble/versions/1/ready")) as resp:
            assert resp.status == 200
        async with session.get(url(proxy, "/v2/health/ready")) as resp:
            assert resp.status == 200 and (await resp.json())["backends"] == 2
    assert seen == {"0", "1"}
    assert proxy.inflight() == {}
    assert proxy.pids() and all(isinstance(p, int) for p in proxy.pids())


@pytest.mark.process
async def test_stream_is_not_buffered(upstreams, proxy_factory) -> None:
    up = upstreams[0]
    ready = ReadyBackends()
    ready.publish((up.backend,))
    proxy = await proxy_factory(ready)
    async with aiohttp.ClientSession() as session:
        async with session.post(url(proxy, "/v2/models/m/generate_stream"), json={}) as resp:
            assert resp.status == 200
            # The upstream holds chunk 2 until we have chunk 1: a buffering proxy deadlocks here.
            first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
            assert b'"chunk":1' in first
            up.release.set()
            rest = await asyncio.wait_for(resp.content.read(), 5)
            assert b'"chunk":2' in rest


@pytest.mark.process
async def test_admin_and_unknown_paths_never_reach_upstream(upstreams, proxy_factory) -> None:
    ready = ReadyBackends()
    ready.publish(tuple(u.backend for u in upstreams))
    proxy = await proxy_factory(ready)
    async with aiohttp.ClientSession() as session:
        for method, path in (("POST", "/v2/repository/index"), ("POST", "/v2/repository/models/m/load"),
                             ("GET", "/v2/systemsharedmemory/status"), ("POST", "/v2/logging"),
                             ("GET", "/v2/models/m/config"), ("GET", "/v2/models/m/versions/1/stats"),
                             ("GET", "/v2/models/stats"), ("POST", "/v2/trace/setting")):
            async with session.request(method, url(proxy, path)) as resp:
                assert resp.status == 403, path
                assert resp.content_type == "application/json"
                assert "admin" in (await resp.json())["error"]
        for method, path, status in (("GET", "/metrics", 404), ("GET", "/v2/models/m/generate", 405),
                                     ("POST", "/v2/models/m", 405),
                                     ("POST", "/v2/models/m/infer/../../../repository/index", 400),
                                     ("POST", "/v2/models/m%2Fx/infer", 400),
                                     ("POST", "/v2//models/m/infer", 400),
                                     ("POST", "/v2/models/m/versions/abc/infer", 404)):
            # encoded=True: sent as written (yarl would resolve the dot segments itself).
            async with session.request(method, yarl.URL(url(proxy, path), encoded=True)) as resp:
                assert resp.status == status, path
                if status == 405:
                    assert resp.headers["Allow"] in ("GET", "POST")
        async with session.post(url(proxy, "/v2/models/m/generate"), data=b"x" * (2 * 1024 * 1024)) as resp:
            assert resp.status == 200  # under --max-body-bytes (64 MiB default): body goes to a temp file
    assert all(u.hits == ["/v2/models/m/generate"] or u.hits == [] for u in upstreams)


@pytest.mark.process
async def test_allow_admin_passes_admin_paths(upstreams, proxy_factory) -> None:
    ready = ReadyBackends()
    ready.publish((upstreams[0].backend,))
    proxy = await proxy_factory(ready, allow_admin=True)
    async with aiohttp.ClientSession() as session:
        async with session.post(url(proxy, "/v2/repository/index")) as resp:
            assert resp.status == 200
    assert upstreams[0].hits == ["/v2/repository/index"]


@pytest.mark.process
async def test_body_limit(upstreams, proxy_factory) -> None:
    ready = ReadyBackends()
    ready.publish((upstreams[0].backend,))
    proxy = await proxy_factory(ready, max_body_bytes=1000)
    async with aiohttp.ClientSession() as session:
        async with session.post(url(proxy, "/v2/models/m/infer"), data=b"x" * 5000) as resp:
            assert resp.status == 413
            assert "too large" in (await resp.json())["error"]
    assert upstreams[0].hits == []


@pytest.mark.process
async def test_no_backend_then_one_becomes_ready(upstreams, proxy_factory) -> None:
    ready = ReadyBackends()
    proxy = await proxy_factory(ready)
    async with aiohttp.ClientSession() as session:
        for path in ("/v2/health/ready", "/v2/models/m/generate"):
            async with session.request("GET" if "health" in path else "POST", url(proxy, path)) as resp:
                assert resp.status == 503, path
                assert resp.headers["Retry-After"] == "5"
                assert (await resp.json())["error"] == "no ready backend"
    ready.publish((upstreams[1].backend,))
    await proxy.wait_reloaded()
    assert proxy.reloads == 1
    # A new connection: one kept alive to an old worker could still see the old config.
    async with aiohttp.ClientSession() as session:
        async with session.post(url(proxy, "/v2/models/m/generate")) as resp:
            assert resp.status == 200 and (await resp.json())["instance"] == "1"
        async with session.get(url(proxy, "/v2/health/ready")) as resp:
            assert resp.status == 200


@pytest.mark.process
async def test_reload_keeps_in_flight_stream(upstreams, proxy_factory) -> None:
    a, b = upstreams
    ready = ReadyBackends()
    ready.publish((a.backend,))
    proxy = await proxy_factory(ready)
    async with aiohttp.ClientSession() as session:
        async with session.post(url(proxy, "/v2/models/m/generate_stream")) as stream:
            first = await asyncio.wait_for(stream.content.readuntil(b"\n\n"), 5)
            assert b'"instance":"0"' in first
            # A is no longer ready; several changes in a row collapse into serialized reloads.
            ready.publish((a.backend, b.backend))
            ready.publish((b.backend,))
            await proxy.wait_reloaded()
            async with aiohttp.ClientSession() as fresh:
                for _ in range(4):
                    async with fresh.post(url(proxy, "/v2/models/m/generate")) as resp:
                        assert (await resp.json())["instance"] == "1"
            a.release.set()
            rest = await asyncio.wait_for(stream.content.read(), 5)
            assert b'"chunk":2' in rest
    assert "trtllm_http" in proxy.config_path.read_text()
    assert f"127.0.0.1:{a.port}" not in proxy.config_path.read_text()


@pytest.mark.process
async def test_bad_config_on_reload_keeps_the_old_one(upstreams, proxy_factory, monkeypatch) -> None:
    ready = ReadyBackends()
    ready.publish((upstreams[0].backend,))
    proxy = await proxy_factory(ready)
    before = proxy.config_path.read_text()
    monkeypatch.setattr(proxy, "_render", lambda backends: before.replace("least_conn;", "least_conn bogus;"))
    ready.publish((upstreams[1].backend,))
    await proxy.wait_reloaded()
    assert "keeping the old one" in proxy.last_error
    assert proxy.reloads == 0
    assert proxy.config_path.read_text() == before
    async with aiohttp.ClientSession() as session:
        async with session.post(url(proxy, "/v2/models/m/generate")) as resp:
            assert (await resp.json())["instance"] == "0"


def _group_alive(pgid: int) -> bool:
    # Zombies count as gone: here PID 1 may never reap the workers a killed master left.
    return bool(_live_group_members(pgid))


def _zombie_or_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.process
async def test_stop_leaves_no_nginx_process(upstreams, tmp_path) -> None:
    ready = ReadyBackends()
    ready.publish((upstreams[0].backend,))
    proxy = NginxProxy(make_settings(), ready, tmp_path)
    await proxy.start()
    try:
        master = proxy.pids()[0]
        workers = [int(p) for p in Path(f"/proc/{master}/task/{master}/children").read_text().split()]
        assert workers
    finally:
        await proxy.stop(grace_s=2.0)
    assert proxy.pids() == []
    assert not _group_alive(master)
    assert all(_zombie_or_gone(p) for p in [master, *workers])
    assert len(ready._listeners) == 0


@pytest.mark.process
async def test_stop_kills_when_graceful_quit_hangs(upstreams, tmp_path) -> None:
    """SIGQUIT waits for open requests; after the grace the whole group is killed."""
    up = upstreams[0]
    ready = ReadyBackends()
    ready.publish((up.backend,))
    proxy = NginxProxy(make_settings(), ready, tmp_path)
    await proxy.start()
    master = proxy.pids()[0]
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(url(proxy, "/v2/models/m/generate_stream")) as stream:
                await asyncio.wait_for(stream.content.readuntil(b"\n\n"), 5)
                await proxy.stop(grace_s=0.5)
    finally:
        await proxy.stop(grace_s=0.5)
    assert not _group_alive(master)


@pytest.mark.process
async def test_wait_exited_reports_a_dead_master(upstreams, tmp_path) -> None:
    ready = ReadyBackends()
    ready.publish((upstreams[0].backend,))
    proxy = NginxProxy(make_settings(), ready, tmp_path)
    await proxy.start()
    master = proxy.pids()[0]
    try:
        os.kill(master, signal.SIGKILL)
        assert await asyncio.wait_for(proxy.wait_exited(), 5) == -signal.SIGKILL
        assert _group_alive(master)  # its workers are orphans now ...
    finally:
        await proxy.stop()
    assert not _group_alive(master)  # ... until stop() kills the group


@pytest.mark.unit
async def test_port_taken_is_one_line_error(upstreams, tmp_path) -> None:
    blocker = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = blocker.sockets[0].getsockname()[1]
    try:
        proxy = NginxProxy(make_settings(listen=f"127.0.0.1:{port}"), ReadyBackends(), tmp_path)
        with pytest.raises(OrchError) as info:
            await proxy.start()
        assert f"127.0.0.1:{port}" in str(info.value) and "\n" not in str(info.value)
        assert proxy.pids() == []
    finally:
        blocker.close()
        await blocker.wait_closed()


@pytest.mark.unit
async def test_missing_binary_names_the_flag(tmp_path) -> None:
    proxy = NginxProxy(make_settings(nginx="/nonexistent/nginx"), ReadyBackends(), tmp_path)
    with pytest.raises(EnvironmentProblem, match="--nginx='/nonexistent/nginx'"):
        await proxy.start()


# --- gRPC ----------------------------------------------------------------------------
grpc = pytest.importorskip("grpc")


@pytest.mark.process
async def test_grpc_admin_blocked_and_inference_passed(tmp_path) -> None:
    from grpc import aio

    calls: list[str] = []

    def handler(method: str):
        def unary(request: bytes, context) -> bytes:
            calls.append(method)
            return b"pong:" + request
        return grpc.unary_unary_rpc_method_handler(unary)

    class Generic(grpc.GenericRpcHandler):
        def service(self, details):
            return handler(details.method)

    server = aio.server()
    server.add_generic_rpc_handlers((Generic(),))
    gport = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    ready = ReadyBackends()
    proxy = NginxProxy(make_settings(), ready, tmp_path)
    try:
        await proxy.start()
        target = f"127.0.0.1:{proxy.bound_grpc_port}"
        async with aio.insecure_channel(target) as channel:
            infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            with pytest.raises(aio.AioRpcError) as info:
                await infer(b"x", timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # nothing ready yet

        ready.publish((Backend("0", "127.0.0.1", 1, gport, 1),))
        await proxy.wait_reloaded()
        # A new channel: the old one's HTTP/2 connection belongs to an old worker.
        async with aio.insecure_channel(target) as channel:
            infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            assert await infer(b"x", timeout=5) == b"pong:x"
            for method in ("RepositoryModelLoad", "RepositoryIndex", "SystemSharedMemoryRegister",
                           "CudaSharedMemoryStatus", "LogSettings", "TraceSetting", "ModelConfig",
                           "ModelStatistics"):
                call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")
                with pytest.raises(aio.AioRpcError) as info:
                    await call(b"x", timeout=5)
                assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, method
            other = channel.unary_unary("/some.Other/Method")
            with pytest.raises(aio.AioRpcError) as info:
                await other(b"x", timeout=5)
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert calls == ["/inference.GRPCInferenceService/ModelInfer"]
    finally:
        await proxy.stop(grace_s=1.0)
        await server.stop(None)
