"""NGINX mode's /v1/: rendered to the side workers' listener, errors in OpenAI's shape, and `nginx -t`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from orchestrator.controlplane.side_workers import upstream_address
from orchestrator.nginx.proxy import render_nginx_config
from tests.test_nginx_render import NGINX, TWO, block, needs_nginx, nginx_t, settings


def v1_location(text: str) -> str:
    return block(text, "location /v1/ {")


@pytest.mark.unit
def test_v1_goes_to_the_openai_listener_unbuffered() -> None:
    text = render_nginx_config(settings(), TWO, None, openai_upstream="127.0.0.1:39000")
    up = block(text, "upstream trtllm_openai {")
    assert "server 127.0.0.1:39000;" in up
    loc = v1_location(text)
    assert "proxy_pass http://trtllm_openai;" in loc
    assert "proxy_buffering off;" in loc  # SSE chunks go out as they come
    assert "proxy_next_upstream off;" in loc  # the listener retries on instances itself
    # error_page is not inherited once a location sets one: every code it may meet is listed
    assert "error_page 413 = @trtllm_openai_too_large;" in loc and "error_page 502 504" in loc
    # before the catch-all 404
    assert text.index("location /v1/ {") < text.index("location / {")


@pytest.mark.unit
def test_nginx_own_errors_on_v1_are_openai_shaped() -> None:
    text = render_nginx_config(settings(), TWO, None, openai_upstream="127.0.0.1:39000")
    for name, status in (("@trtllm_openai_too_large", 413), ("@trtllm_openai_unavailable", 503)):
        body = block(text, f"location {name} {{")
        m = re.search(rf"return {status} '(.*)';", body)
        assert m, body
        err = json.loads(m.group(1))["error"]
        assert set(err) == {"message", "type", "param", "code"}


@pytest.mark.unit
def test_no_v1_without_a_listener_or_with_openai_off() -> None:
    assert "/v1/" not in render_nginx_config(settings(), TWO, None)  # snippet, no --openai-listen
    snippet = render_nginx_config(settings(openai_listen="0.0.0.0:8085"), TWO, None)
    assert "server 127.0.0.1:8085;" in block(snippet, "upstream trtllm_openai {")  # a system NGINX's target
    assert "/v1/" not in render_nginx_config(settings(openai="off", openai_listen="127.0.0.1:8085"), TWO, None)


@pytest.mark.process
@needs_nginx
def test_full_config_with_v1_passes_nginx_t(tmp_path: Path) -> None:
    assert NGINX
    (tmp_path / "temp").mkdir()
    conf = tmp_path / "nginx.conf"
    conf.write_text(render_nginx_config(settings(), TWO, tmp_path, worker_user="root",
                                        openai_upstream="127.0.0.1:39000"))
    result = nginx_t(conf, tmp_path)
    assert result.returncode == 0, result.stderr


@pytest.mark.unit
def test_the_openai_upstream_is_the_listen_host_or_loopback() -> None:
    assert upstream_address("", 7001) == "127.0.0.1:7001"  # the default: loopback, a free port
    assert upstream_address("0.0.0.0:8085", 8085) == "127.0.0.1:8085"
    assert upstream_address("[::]:8085", 8085) == "127.0.0.1:8085"
    assert upstream_address("10.1.2.3:8085", 8085) == "10.1.2.3:8085"
    assert upstream_address("[::1]:8085", 8085) == "[::1]:8085"
