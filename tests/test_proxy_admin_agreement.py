"""The admin surface is one table (surface.ADMIN_API); every proxy must refuse the same calls.

Expectations are derived from the table, then checked against each surface's own
decision: the embedded HTTP proxy's classify(), NGINX's location selection over the
rendered config, and the gRPC proxy answering on loopback (no instance behind it).
The explicit path lists in test_proxy_surface.py / test_nginx_render.py keep the
table itself honest.
"""

from __future__ import annotations

import re
from pathlib import Path

import grpc
import grpc.aio
import pytest

from orchestrator.config import Settings
from orchestrator.routing.backends import Backend, ReadyBackends
from orchestrator.dataplane.grpc_proxy import GrpcProxy
from orchestrator.nginx.proxy import render_nginx_config
from orchestrator.routing.surface import (ADMIN, ADMIN_API, ADMIN_GRPC_METHODS, GRPC_SERVICE,
                                        PUBLIC_GRPC_METHODS, classify)

pytestmark = pytest.mark.unit

TWO = (Backend("0", "127.0.0.1", 8000, 8001, 8002), Backend("1", "127.0.0.1", 8003, 8004, 8005))


def admin_paths() -> list[str]:
    out: list[str] = []
    for api in ADMIN_API:
        for p in api.subtree:
            out += [f"/v2/{p}", f"/v2/{p}/x", f"/v2/{p}/models/m/load"]
        out += [f"/v2/{p}" for p in api.exact]
        for a in api.model_action:
            out += [f"/v2/models/m/{a}", f"/v2/models/m/versions/3/{a}", f"/v2/models/versions/{a}"]
    return out


# Public or unknown: near misses of admin paths included. Neither proxy may refuse these
# as admin (unknown paths are 404 in both, decided elsewhere).
NOT_ADMIN = [
    "/v2", "/v2/models/m", "/v2/models/m/ready", "/v2/models/m/infer", "/v2/models/m/generate",
    "/v2/models/m/generate_stream", "/v2/models/m/versions/2/infer", "/v2/models/stats/infer",
    "/v2/models/config", "/v2/models/m/configx", "/v2/models/m/versions/x/config",
    "/v2/repositoryx", "/v2/trace", "/v2/trace/settings", "/v2/loggingx", "/v2/models/m/stats/x",
]


# --- HTTP: embedded classify() ------------------------------------------------------
@pytest.mark.parametrize("path", admin_paths())
@pytest.mark.parametrize("method", ["GET", "POST"])
def test_embedded_refuses_every_table_path(method, path):
    assert classify(method, path).kind == ADMIN


@pytest.mark.parametrize("path", NOT_ADMIN)
def test_embedded_passes_non_admin(path):
    assert classify("GET", path).kind != ADMIN and classify("POST", path).kind != ADMIN


# --- HTTP and gRPC: NGINX location selection on the rendered config ----------------
def server_blocks(text: str) -> list[str]:
    out = []
    for m in re.finditer(r"^server \{$", text, re.M):
        depth, i = 0, m.end() - 1
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                out.append(text[i + 1:j])
                break
    return out


def locations(server: str) -> list[tuple[str, str, str]]:
    """(modifier, pattern, body) of each location, in config order."""
    out = []
    for m in re.finditer(r"^    location (=|~|) ?(\S+) \{$(.*?)^    \}$", server, re.M | re.S):
        out.append((m.group(1), m.group(2), m.group(3)))
    return out


def nginx_pick(server: str, uri: str) -> str:
    """The body of the location NGINX picks for `uri` (exact, then regexes in order, then
    the longest prefix; no ^~ locations in our config)."""
    locs = locations(server)
    for mod, pattern, body in locs:
        if mod == "=" and pattern == uri:
            return body
    for mod, pattern, body in locs:
        if mod == "~" and re.search(pattern, uri):
            return body
    prefixes = [(len(p), body) for mod, p, body in locs if mod == "" and uri.startswith(p)]
    return max(prefixes)[1]


@pytest.fixture(scope="module")
def nginx_servers() -> tuple[str, str]:
    http, grpc_server = server_blocks(render_nginx_config(
        Settings(listen="127.0.0.1:18080", grpc_listen="127.0.0.1:18081"), TWO, Path("/p")))
    assert "http2" in grpc_server
    return http, grpc_server


def test_nginx_http_refuses_the_same_paths(nginx_servers):
    http, _ = nginx_servers
    for path in admin_paths():
        assert "return 403 " in nginx_pick(http, path), path
    for path in NOT_ADMIN:
        assert "return 403 " not in nginx_pick(http, path), path


def test_nginx_grpc_refuses_the_same_methods(nginx_servers):
    _, grpc_server = nginx_servers
    for name in ADMIN_GRPC_METHODS:
        assert "grpc-status 7 " in nginx_pick(grpc_server, f"/{GRPC_SERVICE}/{name}"), name
    for name in PUBLIC_GRPC_METHODS:
        assert "grpc_pass" in nginx_pick(grpc_server, f"/{GRPC_SERVICE}/{name}"), name


def test_table_parts_are_consistent():
    assert not set(ADMIN_GRPC_METHODS) & set(PUBLIC_GRPC_METHODS)
    assert len(set(ADMIN_GRPC_METHODS)) == len(ADMIN_GRPC_METHODS)
    assert all(api.grpc for api in ADMIN_API), "every admin HTTP feature has a gRPC twin in Triton"


# --- gRPC: the embedded gRPC proxy's answers -----------------------------------------
async def grpc_codes(allow_admin: bool, names) -> dict[str, grpc.StatusCode]:
    proxy = GrpcProxy(Settings(grpc_listen="127.0.0.1:0", allow_admin=allow_admin, hold_s=0), ReadyBackends())
    await proxy.start()
    codes: dict[str, grpc.StatusCode] = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{proxy.bound_port}") as ch:
            for name in names:
                method = f"/{GRPC_SERVICE}/{name}"
                try:
                    if name == "ModelStreamInfer":
                        call = ch.stream_stream(method)(iter([b""]), timeout=5)
                        async for _ in call:
                            pass
                    else:
                        await ch.unary_unary(method)(b"", timeout=5)
                    codes[name] = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as exc:
                    codes[name] = exc.code()
    finally:
        await proxy.stop(0.5)
    return codes


async def test_grpc_proxy_refuses_exactly_the_table():
    names = ADMIN_GRPC_METHODS + PUBLIC_GRPC_METHODS + ("NoSuchMethod",)
    codes = await grpc_codes(False, names)
    denied = {n for n, c in codes.items() if c == grpc.StatusCode.PERMISSION_DENIED}
    assert denied == set(ADMIN_GRPC_METHODS)
    assert codes["NoSuchMethod"] == grpc.StatusCode.UNIMPLEMENTED
    # Public methods are forwarded: with no instance ready that is UNAVAILABLE (or the
    # proxy's own answer for liveness/readiness).
    assert all(codes[n] in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.OK) for n in PUBLIC_GRPC_METHODS)


async def test_grpc_proxy_forwards_the_table_with_allow_admin():
    codes = await grpc_codes(True, ADMIN_GRPC_METHODS)
    assert set(codes.values()) == {grpc.StatusCode.UNAVAILABLE}  # forwarded; nothing is ready
