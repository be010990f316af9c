"""The head of a relayed response, serialized by the proxy itself (pure logic).

Why not aiohttp's StreamResponse for a relayed body: it sends the head in a write of its
own at prepare() and the last chunk in another at write_eof(), so a short answer cost the
worker three sends to the client where one does (each a system call that wakes the
client: the largest part of a small request's cost, bench/README.md "Data plane"). The
relay (UpstreamResponse.pipe) writes this head together with whatever body has arrived,
and the last chunk with the last data. `RelayedResponse` tells aiohttp the bytes are
written and whether the connection stays open; aiohttp writes nothing for it.
"""

from __future__ import annotations

import time
from email.utils import formatdate

from aiohttp import web
from multidict import CIMultiDict

_date = (0, b"")


def _date_line() -> bytes:
    """`Date:` as RFC 9110 wants it, formatted once per second (not per response)."""
    global _date
    now = int(time.time())
    if _date[0] != now:
        _date = (now, b"Date: " + formatdate(now, usegmt=True).encode() + b"\r\n")
    return _date[1]


def response_head(status: int, reason: str, headers: CIMultiDict[str], *, version: tuple[int, int],
                  framed: bool, keep_alive: bool) -> bytes:
    """Status line and headers for the client. `headers`: already filtered (hop-by-hop gone,
    headers.client_response_headers); `framed`: the body goes chunked; `keep_alive`: whether
    the connection stays open after this response (said explicitly where the version's
    default differs)."""
    lines = [b"HTTP/%d.%d %d %s\r\n" % (version[0], version[1], status, reason.encode("latin-1", "replace"))]
    if "Date" not in headers:  # the instance's own, where it sent one (one Date: RFC 9110; the front's rule too)
        lines.append(_date_line())
    lines += [f"{k}: {v}\r\n".encode("utf-8", "surrogateescape") for k, v in headers.items()]
    if framed:
        lines.append(b"Transfer-Encoding: chunked\r\n")
    if version >= (1, 1):
        if not keep_alive:
            lines.append(b"Connection: close\r\n")
    elif keep_alive:
        lines.append(b"Connection: keep-alive\r\n")
    lines.append(b"\r\n")
    return b"".join(lines)


class RelayedResponse(web.StreamResponse):
    """A response whose head and body the proxy wrote to the client's transport itself.
    aiohttp's finish step calls prepare() and write_eof(): both write nothing; it reads
    keep_alive to decide whether to read the connection's next request."""

    def __init__(self, status: int, keep_alive: bool) -> None:
        super().__init__(status=status)
        self._relayed_keep_alive = keep_alive

    async def prepare(self, request: web.BaseRequest) -> None:  # type: ignore[override]
        return None

    async def write_eof(self, data: bytes = b"") -> None:
        return None

    @property
    def keep_alive(self) -> bool:  # type: ignore[override]
        return self._relayed_keep_alive

    def force_close(self) -> None:
        self._relayed_keep_alive = False


__all__ = ["RelayedResponse", "response_head"]
