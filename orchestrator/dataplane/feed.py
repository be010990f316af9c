"""The feed between the daemon (control plane) and the data-plane workers.

One Unix stream socket in the state dir (owner-only, like the control socket),
one JSON object per line. The daemon listens; each worker connects, says who it
is, and from then on:

    daemon -> worker   members   the ready set (addresses), whole, on every change
                       engine    one instance's engine snapshot, as scraped (10 Hz)
                       settings  the proxy knobs after a reload
                       abort     an instance stopped answering: fail what waits on it
                       drain     stop accepting, finish what is in flight, exit
    worker -> daemon   hello     slot, pid, version, listening ports (first line)
                       health    a passive outcome: failure (each), ok (after a failure)
                       stats     every second: the last minute per instance, counts, the
                                 instances that answered (their canary waits)
                       listening its proxies accept (the pool waits for it at start)

Why a socket and not shared memory for these: they are events with an owner
(the daemon is the only writer of membership; an instance's PassiveHealth decides
ejections), rare next to requests, and must reach a worker that was started by a
previous daemon. A worker that loses the daemon keeps the last membership it got
and reconnects; the new daemon sends everything again on connect.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from orchestrator.tasks import cancel_and_wait

Message = dict[str, Any]
# A worker that stops reading (stopped, wedged) must not grow the daemon's memory:
# past this much unsent data its connection is closed; it gets everything anew when
# it reconnects.
MAX_BACKLOG_BYTES = 8 * 1024 * 1024
RECONNECT_MIN_S = 0.1
RECONNECT_MAX_S = 0.5  # a new daemon (live restore) waits for the first worker's socket handover
MAX_LINE = 1024 * 1024


def encode(msg: Message) -> bytes:
    return json.dumps(msg, separators=(",", ":")).encode() + b"\n"


class FeedServer:
    """The daemon's end: one connection per live worker, keyed by its slot."""

    def __init__(self, path: Path, *, on_connect: Callable[[int, Message], list[Message]],
                 on_message: Callable[[int, Message], None],
                 on_disconnect: Callable[[int], None] = lambda slot: None,
                 logger: logging.Logger | None = None) -> None:
        self.path = path
        self._on_connect = on_connect  # hello -> the messages that bring the worker up to date
        self._on_message = on_message
        self._on_disconnect = on_disconnect
        self._log = logger or logging.getLogger("trtllm-orch.feed")
        self._writers: dict[int, asyncio.StreamWriter] = {}
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # a dead daemon's socket file
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path), limit=MAX_LINE)
        os.chmod(self.path, 0o600)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers.values()):
            writer.close()
        await cancel_and_wait(*self._tasks)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def connected(self) -> set[int]:
        return set(self._writers)

    def broadcast(self, msg: Message) -> None:
        line = encode(msg)
        for slot, writer in list(self._writers.items()):
            self._write(slot, writer, line)

    def send(self, slot: int, msg: Message) -> bool:
        writer = self._writers.get(slot)
        if writer is None:
            return False
        self._write(slot, writer, encode(msg))
        return True

    def _write(self, slot: int, writer: asyncio.StreamWriter, line: bytes) -> None:
        if writer.is_closing():
            return
        if writer.transport.get_write_buffer_size() > MAX_BACKLOG_BYTES:
            self._log.warning("data-plane worker %d does not read its feed: disconnected", slot)
            writer.close()
            return
        writer.write(line)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        slot = -1
        try:
            first = await reader.readline()
            hello = json.loads(first) if first else None
            if not isinstance(hello, dict) or hello.get("t") != "hello" or not isinstance(hello.get("slot"), int):
                return
            slot = hello["slot"]
            old = self._writers.get(slot)
            if old is not None:
                old.close()  # a replacement took the slot over
            self._writers[slot] = writer
            for msg in self._on_connect(slot, hello):
                writer.write(encode(msg))
            while True:
                line = await reader.readline()
                if not line:
                    break
                try:
                    msg = json.loads(line)
                except ValueError:
                    self._log.warning("data-plane worker %d sent a bad feed line: %r", slot, line[:80])
                    break
                if isinstance(msg, dict):
                    self._on_message(slot, msg)
        except (ConnectionError, ValueError, asyncio.LimitOverrunError):
            pass
        finally:
            self._tasks.discard(task)
            if slot >= 0 and self._writers.get(slot) is writer:
                del self._writers[slot]
                self._on_disconnect(slot)
            writer.close()


class FeedClient:
    """A worker's end: connects, says hello, hands every message on, reconnects forever.

    Owned by the worker, which runs `run()` as a task and cancels it at stop. While
    disconnected, `send` drops what it is given (the daemon learns the present again
    from the next messages) and `connected` is False: the worker then decides on its
    own what it would otherwise leave to the daemon (passive ejections).
    """

    def __init__(self, path: Path, hello: Callable[[], Message],
                 on_message: Callable[[Message], None],
                 on_connection: Callable[[bool], Awaitable[None] | None] = lambda up: None,
                 logger: logging.Logger | None = None) -> None:
        self.path = path
        self._hello = hello
        self._on_message = on_message
        self._on_connection = on_connection
        self._log = logger or logging.getLogger("trtllm-orch.feed")
        self._writer: asyncio.StreamWriter | None = None
        self.connected = False
        self.connects = 0

    def send(self, msg: Message) -> None:
        writer = self._writer
        if writer is not None and not writer.is_closing():
            writer.write(encode(msg))

    async def run(self) -> None:
        delay = RECONNECT_MIN_S
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(str(self.path), limit=MAX_LINE)
            except OSError:
                await asyncio.sleep(delay)
                delay = min(delay * 2, RECONNECT_MAX_S)
                continue
            delay = RECONNECT_MIN_S
            self._writer = writer
            writer.write(encode(self._hello()))
            self.connected = True
            self.connects += 1
            await self._tell(True)
            try:
                while True:
                    line = await reader.readline()
                    if not line:
                        break
                    msg = json.loads(line)
                    if isinstance(msg, dict):
                        self._on_message(msg)
            except (ConnectionError, ValueError, asyncio.LimitOverrunError) as exc:
                self._log.warning("feed from the daemon broke: %r", exc)
            finally:
                self.connected = False
                self._writer = None
                writer.close()
            await self._tell(False)

    async def _tell(self, up: bool) -> None:
        result = self._on_connection(up)
        if result is not None:
            await result
