"""Header hygiene: hop-by-hop removal and X-Forwarded-* handling."""

from multidict import CIMultiDict
import pytest

from orchestrator.dataplane.headers import (HOP_BY_HOP, TrustedPeers, client_response_headers,
                                        connection_tokens, upstream_request_headers)

pytestmark = pytest.mark.unit


def h(*pairs):
    return CIMultiDict(pairs)


def test_hop_by_hop_set_matches_rfc_and_go():
    assert HOP_BY_HOP == {"connection", "keep-alive", "proxy-connection", "te", "transfer-encoding",
                          "upgrade", "trailer", "proxy-authenticate", "proxy-authorization"}


def test_connection_tokens_from_several_headers():
    assert connection_tokens(h(("Connection", "Keep-Alive, X-Foo"), ("connection", " x-bar ,"))) == \
        {"keep-alive", "x-foo", "x-bar"}
    assert connection_tokens(h()) == frozenset()


def test_request_strips_hop_by_hop_and_connection_named():
    src = h(("Host", "lb:8080"), ("Connection", "keep-alive, X-Secret"), ("Keep-Alive", "timeout=5"),
            ("Proxy-Connection", "x"), ("TE", "trailers"), ("Transfer-Encoding", "chunked"),
            ("Upgrade", "websocket"), ("Trailer", "X"), ("Proxy-Authorization", "Basic x"),
            ("Proxy-Authenticate", "x"), ("X-Secret", "s"), ("Content-Length", "5"),
            ("Expect", "100-continue"), ("Content-Type", "application/json"),
            ("Authorization", "Bearer t"), ("X-Custom", "1"), ("X-Custom", "2"))
    out = upstream_request_headers(src, "10.0.0.9", trusted=False)
    keys = {k.lower() for k in out}
    assert keys == {"content-type", "authorization", "x-custom", "x-forwarded-for",
                    "x-forwarded-proto", "x-forwarded-host"}
    assert out.getall("X-Custom") == ["1", "2"]
    assert out["X-Forwarded-For"] == "10.0.0.9"
    assert out["X-Forwarded-Proto"] == "http"
    assert out["X-Forwarded-Host"] == "lb:8080"


def test_spoofed_forwarding_headers_dropped_for_untrusted_peer():
    src = h(("X-Forwarded-For", "1.2.3.4"), ("X-Forwarded-For", "5.6.7.8"), ("Forwarded", "for=1.2.3.4"),
            ("X-Real-IP", "1.2.3.4"), ("X-Forwarded-Proto", "https"), ("X-Forwarded-Host", "evil"),
            ("Host", "lb"))
    out = upstream_request_headers(src, "192.168.1.5", trusted=False)
    assert out.getall("X-Forwarded-For") == ["192.168.1.5"]
    assert "Forwarded" not in out and "X-Real-IP" not in out
    assert out["X-Forwarded-Proto"] == "http"
    assert out["X-Forwarded-Host"] == "lb"


def test_trusted_peer_appends():
    src = h(("X-Forwarded-For", "1.2.3.4, 10.0.0.1"), ("X-Forwarded-For", "10.0.0.2"),
            ("X-Forwarded-Proto", "https"), ("Forwarded", "for=1.2.3.4"), ("Host", "lb"))
    out = upstream_request_headers(src, "10.0.0.3", trusted=True)
    assert out.getall("X-Forwarded-For") == ["1.2.3.4, 10.0.0.1, 10.0.0.2, 10.0.0.3"]
    assert out["X-Forwarded-Proto"] == "https"
    assert out["Forwarded"] == "for=1.2.3.4"


def test_connection_cannot_smuggle_away_our_xff():
    out = upstream_request_headers(h(("Connection", "X-Forwarded-For")), "9.9.9.9", trusted=False)
    assert out["X-Forwarded-For"] == "9.9.9.9"


def test_unknown_peer():
    assert upstream_request_headers(h(), None, trusted=False)["X-Forwarded-For"] == "unknown"


def test_response_strips_hop_by_hop_and_connection_named():
    src = h(("Connection", "close, X-Internal"), ("X-Internal", "1"), ("Keep-Alive", "t=1"),
            ("Transfer-Encoding", "chunked"), ("Content-Type", "text/event-stream"),
            ("Set-Cookie", "a=1"), ("Set-Cookie", "b=2"), ("Trailer", "x"), ("Upgrade", "h2c"))
    out = client_response_headers(src, keep_length=True)
    assert {k.lower() for k in out} == {"content-type", "set-cookie"}
    assert out.getall("Set-Cookie") == ["a=1", "b=2"]


def test_response_content_length_kept_only_when_valid():
    assert client_response_headers(h(("Content-Length", "10")), keep_length=True)["Content-Length"] == "10"
    assert "Content-Length" not in client_response_headers(h(("Content-Length", "10")), keep_length=False)
    both = h(("Content-Length", "10"), ("Transfer-Encoding", "chunked"))
    assert "Content-Length" not in client_response_headers(both, keep_length=True)


def test_trusted_peers():
    t = TrustedPeers(["10.0.0.0/8", "192.168.1.7", "::1", " "])
    assert "10.2.3.4" in t
    assert "192.168.1.7" in t
    assert "192.168.1.8" not in t
    assert "::1" in t
    assert "::ffff:10.1.1.1" in t  # IPv4-mapped
    assert "not-an-ip" not in t
    assert None not in t
    assert bool(t)
    assert not TrustedPeers([])
    assert "127.0.0.1" not in TrustedPeers([])
