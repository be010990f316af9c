"""The head the proxy writes for a relayed response (orchestrator/dataplane/response_head.py)."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict

from orchestrator.dataplane.response_head import RelayedResponse, response_head

pytestmark = pytest.mark.unit


def lines(head: bytes) -> list[str]:
    assert head.endswith(b"\r\n\r\n")
    return head[:-4].decode().split("\r\n")


def test_a_chunked_keep_alive_answer_to_http_1_1():
    head = lines(response_head(200, "OK", CIMultiDict({"Content-Type": "text/event-stream"}), version=(1, 1),
                               framed=True, keep_alive=True))
    assert head[0] == "HTTP/1.1 200 OK"
    assert head[1].startswith("Date: ") and head[1].endswith(" GMT")
    assert head[2:] == ["Content-Type: text/event-stream", "Transfer-Encoding: chunked"]


def test_the_instances_own_date_is_kept_and_not_doubled():
    # Triton sends none; an instance that does (any HTTP server in front of one) keeps its own:
    # two Date lines make an invalid answer (RFC 9110: one value). The compiled front's rule too.
    head = lines(response_head(200, "OK", CIMultiDict({"Date": "Sun, 29 Nov 2026 10:00:00 GMT"}), version=(1, 1),
                               framed=True, keep_alive=True))
    assert [h for h in head if h.startswith("Date: ")] == ["Date: Sun, 29 Nov 2026 10:00:00 GMT"]


def test_connection_is_said_only_where_the_version_default_differs():
    h11_close = lines(response_head(502, "Bad Gateway", CIMultiDict(), version=(1, 1), framed=False,
                                    keep_alive=False))
    assert h11_close[-1] == "Connection: close"
    h10_keep = lines(response_head(200, "OK", CIMultiDict({"Content-Length": "2"}), version=(1, 0), framed=False,
                                   keep_alive=True))
    assert h10_keep[0].startswith("HTTP/1.0 200") and h10_keep[-1] == "Connection: keep-alive"
    h10_close = lines(response_head(200, "OK", CIMultiDict(), version=(1, 0), framed=False, keep_alive=False))
    assert not any(x.startswith("Connection") for x in h10_close)


async def test_aiohttp_writes_nothing_for_a_relayed_response():
    resp = RelayedResponse(200, keep_alive=True)
    assert await resp.prepare(None) is None  # type: ignore[arg-type]
    await resp.write_eof()
    assert resp.keep_alive
    resp.force_close()
    assert not resp.keep_alive
