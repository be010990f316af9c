"""The public/admin surface: pure classification, including path tricks."""

import pytest

from orchestrator.routing.surface import (ADMIN, BAD_PATH, LIVE, METHOD_NOT_ALLOWED, NOT_FOUND, PUBLIC,
                                        READY, Surface, classify, normalise)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("method,path", [
    ("POST", "/v2/models/ensemble/infer"),
    ("POST", "/v2/models/ensemble/generate"),
    ("POST", "/v2/models/ensemble/generate_stream"),
    ("POST", "/v2/models/ensemble/versions/1/infer"),
    ("POST", "/v2/models/ensemble/versions/12/generate_stream"),
    ("GET", "/v2"),
    ("GET", "/v2/models/ensemble"),
    ("GET", "/v2/models/ensemble/versions/3"),
    ("GET", "/v2/models/ensemble/ready"),
    ("GET", "/v2/models/ensemble/versions/3/ready"),
    ("GET", "/v2/models/versions"),  # a model may be called "versions"
])
def test_public(method, path):
    r = classify(method, path)
    assert r.kind == PUBLIC
    assert r.path == path


def test_stream_flag():
    assert classify("POST", "/v2/models/m/generate_stream").stream
    assert not classify("POST", "/v2/models/m/generate").stream


@pytest.mark.parametrize("path,kind", [("/v2/health/live", LIVE), ("/v2/health/ready", READY)])
def test_local_health(path, kind):
    assert classify("GET", path).kind == kind
    r = classify("POST", path)
    assert r.kind == METHOD_NOT_ALLOWED and r.allow == "GET"


@pytest.mark.parametrize("method,path", [
    ("POST", "/v2/repository/index"),
    ("POST", "/v2/repository/models/m/load"),
    ("POST", "/v2/repository/models/m/unload"),
    ("GET", "/v2/repository"),
    ("POST", "/v2/systemsharedmemory/region/r/register"),
    ("GET", "/v2/systemsharedmemory/status"),
    ("POST", "/v2/cudasharedmemory/region/r/unregister"),
    ("GET", "/v2/cudasharedmemory/status"),
    ("POST", "/v2/trace/setting"),
    ("GET", "/v2/trace/setting"),
    ("POST", "/v2/models/m/trace/setting"),
    ("POST", "/v2/logging"),
    ("GET", "/v2/models/m/config"),
    ("GET", "/v2/models/m/versions/1/config"),
    ("GET", "/v2/models/m/stats"),
    ("GET", "/v2/models/m/versions/2/stats"),
    ("GET", "/v2/models/stats"),
])
def test_admin(method, path):
    assert classify(method, path).kind == ADMIN


@pytest.mark.parametrize("path", [
    "/", "/metrics", "/v3/models/m/infer", "/v2/models", "/v2/health", "/v2/health/other",
    "/v2/models/m/versions", "/v2/models/m/versions/abc/infer", "/v2/models/m/versions/١/infer",
    "/v2/models/m/unknown", "/v2/models/m/infer/extra", "/V2/models/m/infer", "/v2/trace",
    "/v2/foo",
])
def test_not_found(path):
    assert classify("POST", path).kind == NOT_FOUND


@pytest.mark.parametrize("method,path,allow", [
    ("GET", "/v2/models/m/infer", "POST"),
    ("PUT", "/v2/models/m/generate", "POST"),
    ("POST", "/v2", "GET"),
    ("DELETE", "/v2/models/m", "GET"),
    ("POST", "/v2/models/m/ready", "GET"),
    ("HEAD", "/v2/models/m/ready", "GET"),
])
def test_wrong_method(method, path, allow):
    r = classify(method, path)
    assert r.kind == METHOD_NOT_ALLOWED and r.allow == allow


@pytest.mark.parametrize("raw,kind,path", [
    ("//v2//models//m//infer", PUBLIC, "/v2/models/m/infer"),
    ("/v2/models/m/infer/", PUBLIC, "/v2/models/m/infer"),
    ("/v2/./models/m/./infer", PUBLIC, "/v2/models/m/infer"),
    ("/v2/models/x/../m/infer", PUBLIC, "/v2/models/m/infer"),
    ("/v2/models/%6d/infer", PUBLIC, "/v2/models/m/infer"),
    ("/v2/models/m/%69nfer", PUBLIC, "/v2/models/m/infer"),
    # dot-dot tricks that would reach the admin API after the upstream normalises
    ("/v2/models/m/infer/../../../repository/index", ADMIN, "/v2/repository/index"),
    ("/v2/models/m/%2e%2e/%2E%2E/repository/index", ADMIN, "/v2/repository/index"),
    ("/v2/models/m/%2e%2e/%2E%2E/%2e%2e/repository/index", NOT_FOUND, "/repository/index"),
    ("/v2/models/x/%2e%2e/stats", ADMIN, "/v2/models/stats"),
    ("/v2/%72epository/index", ADMIN, "/v2/repository/index"),
    ("/v2/models/m/config/", ADMIN, "/v2/models/m/config"),
    ("/v2//logging", ADMIN, "/v2/logging"),
    # a model name that needs encoding is forwarded encoded
    ("/v2/models/my%20model/infer", PUBLIC, "/v2/models/my%20model/infer"),
    ("/v2/models/a%25b/infer", PUBLIC, "/v2/models/a%25b/infer"),
])
def test_normalisation(raw, kind, path):
    r = classify("POST" if path.endswith("infer") else "GET", raw)
    assert (r.kind, r.path) == (kind, path)


@pytest.mark.parametrize("raw", [
    "/v2/models/a%2Fb/infer",  # encoded slash: ambiguous
    "/v2/models/a%2fb/infer",
    "/v2/models/a%5Cb/infer",  # encoded backslash
    "/v2/models/a\\b/infer",
    "/v2/models/a%00b/infer",  # NUL
    "/v2/models/a%0Ab/infer",  # newline (header injection downstream)
    "/v2/models/%ff/infer",  # not UTF-8
    "/../v2",
    "/v2/../../v2",
    "v2/models/m/infer",  # no leading slash
    "",
])
def test_bad_paths(raw):
    assert classify("POST", raw).kind == BAD_PATH


def test_double_encoding_is_not_decoded_twice():
    r = classify("POST", "/v2/models/%252e%252e/infer")
    assert r.kind == PUBLIC and r.path == "/v2/models/%252e%252e/infer"


def test_normalise_segments():
    assert normalise("/a//b/./c/..") == ("a", "b")
    assert normalise("/") == ()


def test_surface_cache_is_bounded_and_consistent():
    s = Surface()
    for i in range(10000):
        assert s.route("POST", f"/v2/models/m{i}/infer").kind == PUBLIC
    assert len(s._cache) <= 4096
    assert s.route("POST", "/v2/models/m/infer") is s.route("POST", "/v2/models/m/infer")
