"""The daemon's control API: JSON over HTTP on a Unix socket private to its owner.

Never TCP (supervisor's lesson): the socket lives in the 0700 state directory
and is itself 0600, so only the daemon's user can stop or restart instances.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any, Protocol

import aiohttp
from aiohttp import web

from orchestrator.errors import DaemonNotRunning, OrchError


class ControlTarget(Protocol):
    """What the control API drives (the daemon); named here so neither imports the other's module."""

    async def status(self) -> dict[str, Any]: ...

    def request_stop(self, reason: str) -> None: ...

    def request_detach(self, reason: str) -> None: ...

    def restart_instance(self, instance_id: str) -> str | None: ...

    async def reload(self, why: str) -> bool: ...


class ControlServer:
    def __init__(self, daemon: ControlTarget, path: Path):
        self._daemon = daemon
        self._path = path
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/status", self._status)
        app.router.add_post("/down", self._down)
        app.router.add_post("/detach", self._detach)
        app.router.add_post("/restart/{id}", self._restart)
        app.router.add_post("/reload", self._reload)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        self._path.unlink(missing_ok=True)  # a stale socket of a killed daemon (we hold the lock)
        old_umask = os.umask(0o177)  # the socket is born 0600: no window where others can connect
        try:
            await web.UnixSite(self._runner, str(self._path)).start()
        finally:
            os.umask(old_umask)
        os.chmod(self._path, 0o600)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self._path.unlink(missing_ok=True)

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response(await self._daemon.status())

    async def _down(self, request: web.Request) -> web.Response:
        self._daemon.request_stop("down requested")
        return web.json_response({"stopping": True}, status=202)

    async def _detach(self, request: web.Request) -> web.Response:
        self._daemon.request_detach("detach requested (upgrade)")
        return web.json_response({"detaching": True}, status=202)

    async def _restart(self, request: web.Request) -> web.Response:
        iid = request.match_info["id"]
        error = self._daemon.restart_instance(iid)
        if error:
            return web.json_response({"error": error}, status=404)
        return web.json_response({"restarting": iid}, status=202)

    async def _reload(self, request: web.Request) -> web.Response:
        try:
            restarting = await self._daemon.reload("reload requested")
        except OrchError as exc:
            # exit_code tells the CLI whether the config was bad (2) or the time was (1).
            return web.json_response({"error": str(exc), "exit_code": exc.exit_code}, status=409)
        return web.json_response({"rolling_restart": restarting}, status=202)


async def call(socket_path: Path, method: str, path: str, timeout_s: float = 10.0) -> tuple[int, Any]:
    if not socket_path.exists():
        raise DaemonNotRunning(f"no daemon: {socket_path} does not exist (is `trtllm-orch up` running "
                               f"with this --state-dir?)")
    connector = aiohttp.UnixConnector(path=str(socket_path))
    try:
        async with aiohttp.ClientSession(connector=connector,
                                         timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            async with session.request(method, f"http://daemon{path}") as resp:
                return resp.status, await resp.json(content_type=None)
    except (aiohttp.ClientConnectionError, FileNotFoundError, ConnectionRefusedError) as exc:
        raise DaemonNotRunning(f"no daemon answers on {socket_path}: {exc}") from None
    except asyncio.TimeoutError:
        raise OrchError(f"the daemon did not answer {method} {path} within {timeout_s:g}s") from None
    except json.JSONDecodeError as exc:
        raise OrchError(f"bad answer from the daemon: {exc}") from None


def call_sync(socket_path: Path, method: str, path: str, timeout_s: float = 10.0) -> tuple[int, Any]:
    return asyncio.run(call(socket_path, method, path, timeout_s))
