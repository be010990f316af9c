"""The least a Python relay can do per request: a bound for the embedded proxy (issue 12).

    python -m bench._min_relay PORT UPSTREAM_PORT [UPSTREAM_PORT...]

On uvloop: an asyncio Protocol server parsing with httptools, the embedded proxy's own
upstream client (orchestrator/dataplane/upstream.py), round robin, each answer read whole and
sent with a Content-Length in one write. Nothing else: no limits, deadlines, surface,
hold, retries, health, metrics, header hygiene or error handling. Not for use; it shows
what CPU per request is left for a Python data plane on a given box (bench/README.md).
"""

from __future__ import annotations

import asyncio
import sys

import httptools
import uvloop

from orchestrator.dataplane.upstream import UpstreamPool


class _Relay(asyncio.Protocol):
    pool: UpstreamPool
    upstreams: list[int]
    turn = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body, self.body = b"".join(self.body), []
        asyncio.get_running_loop().create_task(self._relay(self.url.decode(), body))

    async def _relay(self, target: str, body: bytes) -> None:
        _Relay.turn += 1
        port = self.upstreams[_Relay.turn % len(self.upstreams)]
        up = await self.pool.request("127.0.0.1", port, "POST", target, {"Content-Type": "application/json"},
                                     body, connect_timeout_s=2.0, idle_timeout_s=300.0)
        data = await up.read()
        up.release()
        if not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 %d OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                                 % (up.status, len(data)) + data)


async def main(port: int, upstreams: list[int]) -> None:
    _Relay.pool = UpstreamPool(limit_per_host=1024)
    _Relay.upstreams = upstreams
    server = await asyncio.get_running_loop().create_server(_Relay, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    uvloop.install()
    asyncio.run(main(int(sys.argv[1]), [int(p) for p in sys.argv[2:]]))
