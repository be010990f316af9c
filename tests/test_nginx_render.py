"""configs/nginx.conf.j2: pure rendering, then `nginx -t` on what was rendered."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from orchestrator.config import Settings
from orchestrator.routing.backends import Backend
from orchestrator.nginx.proxy import render_nginx_config
from orchestrator.templates import configs_dir

NGINX = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")
needs_nginx = pytest.mark.skipif(NGINX is None, reason="nginx binary not installed")

TWO = (Backend("0", "127.0.0.1", 8000, 8001, 8002), Backend("1", "127.0.0.1", 8003, 8004, 8005))


def settings(**kw) -> Settings:
    base = dict(listen="127.0.0.1:18080", grpc_listen="127.0.0.1:18081", idle_timeout_s=123.0,
                max_body_bytes=1234567, max_attempts=4, connect_timeout_s=1.5)
    base.update(kw)
    return Settings(**base)


def block(text: str, header: str) -> str:
    """The body of the first `header { ... }` block (brace-matched)."""
    start = text.index(header)
    i = text.index("{", start + len(header) - 1)
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    raise AssertionError("unbalanced braces after " + header)


def grpc_server(text: str) -> str:
    second = text.index("server {", text.index("server {") + 1)
    body = block(text[second:], "server {")
    assert "http2;" in body
    return body


def directives(text: str) -> list[str]:
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]


@pytest.mark.unit
def test_nginx_runs_as_many_workers_as_proxy_workers(tmp_path: Path) -> None:
    text = render_nginx_config(settings(proxy_workers="6"), TWO, tmp_path)
    assert "worker_processes 6;" in directives(text)


@pytest.mark.unit
def test_templates_dir_is_the_repo_configs() -> None:
    assert configs_dir() == Path(__file__).resolve().parent.parent / "configs"


@pytest.mark.unit
def test_full_config_keeps_everything_in_prefix(tmp_path: Path) -> None:
    text = render_nginx_config(settings(), TWO, tmp_path)
    lines = directives(text)
    assert f"pid {tmp_path}/nginx.pid;" in lines
    assert any(ln.startswith(f"error_log {tmp_path}/error.log") for ln in lines)
    for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
        assert f"{kind}_temp_path {tmp_path}/temp/{kind};" in lines
    assert f"worker_processes {settings().worker_count()};" in lines  # as many as the embedded data plane
    assert "access_log off;" in lines
    # `daemon off;` comes from -g; a second one in the file would be a duplicate.
    assert not any(ln.startswith("daemon") for ln in lines)
    assert "events {" in text and "http {" in text


@pytest.mark.unit
def test_the_side_workers_are_the_http_upstreams_backup() -> None:
    """NGINX holds no request: what no instance took goes to the side workers, which hold it
    (controlplane/side_workers.py); gRPC has no such server. One attempt more for the backup."""
    text = render_nginx_config(settings(), TWO, Path("/p"), backup="127.0.0.1:7000")
    assert directives(block(text, "upstream trtllm_http"))[-3:-2] == ["server 127.0.0.1:7000 max_fails=0 backup;"]
    assert not any("backup" in ln for ln in directives(block(text, "upstream trtllm_grpc")))
    assert f"proxy_next_upstream_tries {settings().max_attempts + 1};" in directives(block(text, "server {"))
    assert "backup;" not in render_nginx_config(settings(), TWO, Path("/p"))  # none given: none rendered


@pytest.mark.unit
def test_upstream_and_proxy_settings() -> None:
    text = render_nginx_config(settings(), TWO, Path("/p"))
    up = directives(block(text, "upstream trtllm_http"))
    assert up[0] == "least_conn;"
    assert any(ln.startswith("zone trtllm_http ") for ln in up)
    assert "server 127.0.0.1:8000 max_fails=1 fail_timeout=2s;" in up
    assert "server 127.0.0.1:8003 max_fails=1 fail_timeout=2s;" in up
    assert any(re.fullmatch(r"keepalive \d+;", ln) for ln in up)
    # Idle pooled connections close soon: a draining Triton waits for every open one.
    assert "keepalive_timeout 1s;" in up
    grpc_up = directives(block(text, "upstream trtllm_grpc"))
    assert "server 127.0.0.1:8001 max_fails=1 fail_timeout=2s;" in grpc_up
    assert "keepalive_timeout 1s;" in grpc_up

    server = block(text, "server {")
    lines = directives(server)
    for expected in ("proxy_http_version 1.1;", 'proxy_set_header Connection "";',
                     "proxy_set_header Host $host;", "proxy_set_header X-Forwarded-For $trtllm_forwarded_for;",
                     "proxy_read_timeout 123000ms;", "proxy_connect_timeout 1500ms;",
                     "client_max_body_size 1234567;",
                     "proxy_next_upstream error timeout http_503 non_idempotent;", "proxy_next_upstream_tries 4;",
                     "listen 127.0.0.1:18080;"):
        assert expected in lines, expected
    assert any(ln.startswith("client_header_timeout ") for ln in lines)
    assert any(ln.startswith("client_body_timeout ") for ln in lines)
    assert any(ln.startswith("keepalive_timeout ") for ln in lines)
    # Without trusted proxies every client's X-Forwarded-For is replaced.
    geo = directives(block(text, "geo $trtllm_trusted_peer"))
    assert geo == ["default 0;"]
    assert "0 $remote_addr;" in directives(block(text, "map $trtllm_trusted_peer"))


@pytest.mark.unit
def test_trusted_proxy_keeps_chain() -> None:
    text = render_nginx_config(settings(trusted_proxy=("10.1.2.3", "192.168.0.0/16")), TWO, Path("/p"))
    geo = directives(block(text, "geo $trtllm_trusted_peer"))
    assert "10.1.2.3 1;" in geo and "192.168.0.0/16 1;" in geo


@pytest.mark.unit
def test_client_timeouts_follow_settings() -> None:
    text = render_nginx_config(settings(client_header_timeout_s=2.5, client_body_timeout_s=7.0), TWO,
                               Path("/p"))
    http = directives(block(text, "server {"))
    assert "client_header_timeout 2500ms;" in http and "client_body_timeout 7000ms;" in http
    assert "client_header_timeout 2500ms;" in directives(grpc_server(text))


@pytest.mark.unit
def test_stream_location_is_unbuffered() -> None:
    text = render_nginx_config(settings(), TWO, Path("/p"))
    stream = directives(block(text, "location ~ ^/v2/models/[^/]+(/versions/[0-9]+)?/generate_stream$"))
    assert "proxy_buffering off;" in stream
    assert "proxy_cache off;" in stream
    assert "chunked_transfer_encoding on;" in stream
    assert "proxy_pass http://trtllm_http;" in stream


@pytest.mark.unit
def test_admin_blocked_by_default_and_first_in_order() -> None:
    text = render_nginx_config(settings(), TWO, Path("/p"))
    server = block(text, "server {")
    regexes = re.findall(r"location ~ (\S+) \{", server)
    assert "repository" in regexes[0] and "stats" in regexes[1]
    for header in ("location ~ " + regexes[0], "location ~ " + regexes[1]):
        body = directives(block(server, header))
        assert any(ln.startswith("return 403 ") for ln in body)
        assert not any("proxy_pass" in ln for ln in body)
    admin = re.compile(regexes[0])
    model_admin = re.compile(regexes[1])
    for path in ("/v2/repository/index", "/v2/repository/models/m/load", "/v2/systemsharedmemory/status",
                 "/v2/cudasharedmemory/region/r/register", "/v2/logging", "/v2/trace/setting"):
        assert admin.search(path), path
    for path in ("/v2/models/m/config", "/v2/models/m/stats", "/v2/models/m/versions/1/stats",
                 "/v2/models/stats", "/v2/models/m/trace/setting"):
        assert model_admin.search(path), path
    for path in ("/v2/models/m/infer", "/v2/models/m", "/v2/models/m/ready"):
        assert not admin.search(path) and not model_admin.search(path), path


@pytest.mark.unit
def test_allow_admin_proxies_admin_paths() -> None:
    text = render_nginx_config(settings(allow_admin=True), TWO, Path("/p"))
    server = block(text, "server {")
    first = re.findall(r"location ~ (\S+) \{", server)[0]
    assert "proxy_pass http://trtllm_http;" in directives(block(server, "location ~ " + first))
    grpc = grpc_server(text)
    assert "grpc_pass" in block(grpc, "location ~ ^/inference\\.GRPCInferenceService/(Repository")


@pytest.mark.unit
def test_no_backend_renders_503_and_no_upstream() -> None:
    text = render_nginx_config(settings(), (), None)
    assert not any(ln.startswith("upstream ") for ln in directives(text))
    assert not any(ln.startswith(("proxy_pass", "grpc_pass")) for ln in directives(text))
    ready = directives(block(text, "location = /v2/health/ready"))
    assert any(ln.startswith("return 503 ") for ln in ready)
    assert any(ln.startswith("add_header Retry-After ") and ln.endswith(" always;") for ln in ready)
    stream = directives(block(text, "location ~ ^/v2/models/[^/]+(/versions/[0-9]+)?/generate_stream$"))
    assert any(ln.startswith("return 503 ") for ln in stream)


@pytest.mark.unit
def test_health_ready_answered_by_nginx() -> None:
    # A system nginx (snippet): static, every listed instance counts.
    text = render_nginx_config(settings(), TWO, None)
    ready = directives(block(text, "location = /v2/health/ready"))
    assert ready == ["return 200 '{\"ready\":true,\"backends\":2}';"]


@pytest.mark.unit
def test_ready_set_comes_from_a_file_not_from_the_config() -> None:
    """Item 10: the managed config never changes with the ready set (no reload, nothing lost)."""
    text = render_nginx_config(settings(), TWO, Path("/p"))
    ready = directives(block(text, "location = /v2/health/ready"))
    assert ready == ["root /p/health;", "try_files /ready.json @trtllm_no_backend;"]
    no_backend = directives(block(text, "location @trtllm_no_backend"))
    assert "add_header Retry-After 5 always;" in no_backend and any(ln.startswith("return 503 ") for ln in no_backend)
    # Nobody answered: 503 + Retry-After while none is READY, else 502.
    bad_gateway = block(text, "location @trtllm_bad_gateway")
    assert "if (!-f /p/health/ready.json) {" in bad_gateway
    assert directives(bad_gateway)[-1].startswith("return 502 ")


@pytest.mark.unit
def test_grpc_server_and_admin_methods() -> None:
    text = render_nginx_config(settings(), TWO, Path("/p"))
    grpc = grpc_server(text)
    lines = directives(grpc)
    assert "grpc_read_timeout 123000ms;" in lines
    assert "grpc_next_upstream_tries 4;" in lines
    admin = directives(block(grpc, "location ~ ^/inference\\.GRPCInferenceService/(Repository"))
    assert "add_header grpc-status 7 always;" in admin
    assert "default_type application/grpc;" in admin
    assert "return 200;" in admin
    header = re.search(r"location ~ (\^/inference\S+) \{", grpc).group(1)
    methods = re.compile(header)
    for m in ("RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload", "SystemSharedMemoryStatus",
              "SystemSharedMemoryRegister", "CudaSharedMemoryUnregister", "TraceSetting", "LogSettings",
              "ModelConfig", "ModelStatistics"):
        assert methods.search(f"/inference.GRPCInferenceService/{m}"), m
    for m in ("ModelInfer", "ModelStreamInfer", "ServerReady", "ModelMetadata", "ServerLive", "ModelReady"):
        assert not methods.search(f"/inference.GRPCInferenceService/{m}"), m
    assert "grpc_pass grpc://trtllm_grpc;" in directives(block(grpc, "location /inference.GRPCInferenceService/"))


@pytest.mark.unit
def test_grpc_disabled() -> None:
    text = render_nginx_config(settings(grpc_listen=""), TWO, Path("/p"))
    assert "http2" not in text and "trtllm_grpc" not in text


@pytest.mark.unit
def test_ipv6_listen_is_bracketed() -> None:
    text = render_nginx_config(settings(listen="[::1]:18080"), TWO, Path("/p"))
    assert "listen [::1]:18080;" in directives(text)


@pytest.mark.unit
def test_snippet_has_no_main_context() -> None:
    text = render_nginx_config(settings(), TWO, None)
    lines = directives(text)
    for word in ("pid", "error_log", "worker_processes", "events", "http", "client_body_temp_path", "user"):
        assert not any(ln.split()[0] == word for ln in lines), word
    assert "access_log off;" in directives(block(text, "server {"))


# --- nginx -t ------------------------------------------------------------------------
def nginx_t(conf: Path, prefix: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([NGINX, "-t", "-q", "-p", str(prefix), "-c", str(conf), "-e", str(prefix / "error.log"),
                           "-g", "daemon off;"], capture_output=True, text=True, timeout=30)


@pytest.mark.process
@needs_nginx
@pytest.mark.parametrize("variant", ["two", "none", "admin", "no-grpc", "trusted", "ipv6"])
def test_rendered_full_config_passes_nginx_t(tmp_path: Path, variant: str) -> None:
    (tmp_path / "temp").mkdir()
    s, backends = {
        "two": (settings(), TWO),
        "none": (settings(), ()),
        "admin": (settings(allow_admin=True), TWO),
        "no-grpc": (settings(grpc_listen=""), TWO[:1]),
        "trusted": (settings(trusted_proxy=("10.0.0.1", "fd00::/8")), TWO),
        "ipv6": (settings(listen="[::1]:18080", grpc_listen="[::1]:18081"), TWO),
    }[variant]
    conf = tmp_path / "nginx.conf"
    conf.write_text(render_nginx_config(s, backends, tmp_path, worker_user="root"))
    result = nginx_t(conf, tmp_path)
    assert result.returncode == 0, result.stderr


@pytest.mark.process
@needs_nginx
def test_snippet_passes_nginx_t_inside_an_http_block(tmp_path: Path) -> None:
    (tmp_path / "site.conf").write_text(render_nginx_config(settings(), TWO, None))
    conf = tmp_path / "nginx.conf"
    conf.write_text(f"pid {tmp_path}/nginx.pid;\nevents {{}}\nhttp {{\n"
                    f"  client_body_temp_path {tmp_path}/cb; proxy_temp_path {tmp_path}/pt;\n"
                    f"  fastcgi_temp_path {tmp_path}/ft; uwsgi_temp_path {tmp_path}/ut; scgi_temp_path {tmp_path}/st;\n"
                    f"  include {tmp_path}/site.conf;\n}}\n")
    result = nginx_t(conf, tmp_path)
    assert result.returncode == 0, result.stderr
