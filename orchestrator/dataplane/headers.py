"""Header hygiene between client and instance, both ways. Pure logic.

RFC 9110 7.6.1: a proxy removes `Connection`, every header `Connection` names,
and the classic hop-by-hop set (Keep-Alive, Proxy-Connection, TE,
Transfer-Encoding, Upgrade); like Go's ReverseProxy we also drop Trailer,
Proxy-Authenticate and Proxy-Authorization. Each hop frames its own body, so
Content-Length is recomputed on each side rather than copied.

X-Forwarded-For is rebuilt from the socket peer. A client-supplied value (and
Forwarded, X-Forwarded-Proto/Host, X-Real-IP) is trusted only when the peer is
a configured trusted proxy; otherwise anyone could claim any address.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from multidict import CIMultiDict, CIMultiDictProxy, MultiMapping

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-connection", "te", "transfer-encoding",
    "upgrade", "trailer", "proxy-authenticate", "proxy-authorization",
})
_FORWARDING = frozenset({"x-forwarded-for", "forwarded", "x-forwarded-proto", "x-forwarded-host",
                         "x-real-ip"})
# Host is the instance's (aiohttp sets it from the URL); Expect was answered by
# us (we hold the whole body before connecting); Content-Length is recomputed.
# The compiled front (front/compiled.py) drops the same names: these are its tables too.
UNTRUSTED_REQUEST_DROP = HOP_BY_HOP | _FORWARDING | {"host", "expect", "content-length"}
_REQ_DROP_TRUSTED = HOP_BY_HOP | {"x-forwarded-for", "host", "expect", "content-length"}
RESPONSE_DROP = HOP_BY_HOP
_RESPONSE_DROP_LENGTH = HOP_BY_HOP | {"content-length"}


def connection_tokens(headers: MultiMapping[str]) -> frozenset[str]:
    """Header names listed in every Connection header (lower case)."""
    values = headers.getall("Connection", ())
    if not values:
        return frozenset()
    return frozenset(t.strip().lower() for v in values for t in v.split(",") if t.strip())


def _filter(headers: MultiMapping[str], drop: frozenset[str]) -> CIMultiDict[str]:
    extra = connection_tokens(headers)
    if extra:
        drop = drop | extra
    out: CIMultiDict[str] = CIMultiDict()
    add = out.add
    for k, v in headers.items():
        if k.lower() not in drop:
            add(k, v)
    return out


class TrustedPeers:
    """Peer addresses (exact IPs or CIDR networks) whose forwarding headers we keep."""

    __slots__ = ("_nets", "_cache")

    def __init__(self, entries: Iterable[str]) -> None:
        self._nets = tuple(ipaddress.ip_network(e.strip().strip("[]"), strict=False)
                           for e in entries if e.strip())
        self._cache: dict[str, bool] = {}

    def __bool__(self) -> bool:
        return bool(self._nets)

    def __contains__(self, peer: object) -> bool:
        if not self._nets or not isinstance(peer, str):
            return False
        hit = self._cache.get(peer)
        if hit is None:
            try:
                addr = ipaddress.ip_address(peer)
            except ValueError:
                hit = False
            else:
                if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
                    addr = addr.ipv4_mapped
                hit = any(addr in n for n in self._nets)
            if len(self._cache) > 4096:
                self._cache.clear()
            self._cache[peer] = hit
        return hit


def upstream_request_headers(headers: MultiMapping[str], peer: str | None, trusted: bool,
                             scheme: str = "http") -> CIMultiDict[str]:
    """Headers to send to the instance for a request that arrived with `headers` from `peer`."""
    out = _filter(headers, _REQ_DROP_TRUSTED if trusted else UNTRUSTED_REQUEST_DROP)
    peer = peer or "unknown"
    prior = headers.getall("X-Forwarded-For", ()) if trusted else ()
    out["X-Forwarded-For"] = ", ".join((*prior, peer)) if prior else peer
    if "X-Forwarded-Proto" not in out:
        out["X-Forwarded-Proto"] = scheme
    if "X-Forwarded-Host" not in out:
        host = headers.get("Host")
        if host:
            out["X-Forwarded-Host"] = host
    return out


def client_response_headers(headers: MultiMapping[str] | CIMultiDictProxy[str],
                            keep_length: bool) -> CIMultiDict[str]:
    """Headers to send to the client for an instance response.

    keep_length: copy the instance's Content-Length (only valid when the body is
    relayed byte for byte and the instance did not also send Transfer-Encoding,
    which RFC 9112 says overrides it).
    """
    if keep_length and "Transfer-Encoding" not in headers:
        return _filter(headers, RESPONSE_DROP)
    return _filter(headers, _RESPONSE_DROP_LENGTH)
