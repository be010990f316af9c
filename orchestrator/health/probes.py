"""Active health probes against one Triton instance's HTTP port.

A probe never raises for a network problem: every failure becomes a ProbeResult
with a one-line reason, because the supervisor's job is to act on failures, and
an exception escaping a probe loop would kill the loop instead.

Passing probes are necessary, not sufficient: a hung TRT-LLM rank leaves
/v2/health/ready at 200 (see canary.py for what catches that).
"""

from __future__ import annotations

import asyncio
import time
import urllib.parse
from dataclasses import dataclass
from typing import Callable

import aiohttp

from orchestrator.tasks import cancel_and_wait

# Enough of an error body to name the problem in a log line, not a whole page.
_DETAIL_CHARS = 160


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    reason: str  # '' when ok; else one line, e.g. "GET /v2/health/ready -> 400"
    latency_s: float


def model_path(model: str, suffix: str) -> str:
    # Model names are user input; quote them so '/' or '?' cannot change the URL.
    return f"/v2/models/{urllib.parse.quote(model, safe='')}/{suffix}"


def one_line(text: str, limit: int = _DETAIL_CHARS) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe_error(method: str, path: str, exc: BaseException) -> str:
    """One line for a transport failure; refused connections get a short, greppable reason."""
    if isinstance(exc, aiohttp.ClientConnectorError) and isinstance(exc.os_error, ConnectionRefusedError):
        return f"{method} {path}: connect refused"
    return f"{method} {path}: {type(exc).__name__}: {one_line(str(exc)) or 'no detail'}"


def status_reason(method: str, path: str, status: int, body: bytes) -> str:
    detail = one_line(body.decode("utf-8", "replace"))
    return f"{method} {path} -> {status}" + (f": {detail}" if detail else "")


async def probe_instance(session: aiohttp.ClientSession, base_url: str, model: str,
                         timeout_s: float) -> ProbeResult:
    """live, then server ready, then model ready, each 200, all within one deadline.

    Live first so that the reason names the deepest thing that works: a live but
    not-ready server is loading; a dead one is not even live. One deadline for all
    three, so a slow instance cannot stretch a probe to 3 x timeout_s.
    """
    base = base_url.rstrip("/")
    paths = ("/v2/health/live", "/v2/health/ready", model_path(model, "ready"))
    start = time.monotonic()
    path = paths[0]

    async def walk() -> ProbeResult | None:
        nonlocal path
        for path in paths:
            async with session.get(base + path, allow_redirects=False) as resp:
                # Read the body so the connection goes back to the pool for the next probe.
                body = await resp.read()
                if resp.status != 200:
                    return ProbeResult(False, status_reason("GET", path, resp.status, body),
                                       time.monotonic() - start)
        return None

    try:
        failed = await asyncio.wait_for(walk(), timeout_s)  # not asyncio.timeout: Python 3.10
    except asyncio.TimeoutError:  # before OSError: on 3.11+ it is the builtin TimeoutError
        return ProbeResult(False, f"GET {path}: timeout after {timeout_s:g}s", time.monotonic() - start)
    except (aiohttp.ClientError, OSError) as exc:
        return ProbeResult(False, describe_error("GET", path, exc), time.monotonic() - start)
    return failed or ProbeResult(True, "", time.monotonic() - start)


async def wait_until_ready(session: aiohttp.ClientSession, base_url: str, model: str, deadline_s: float,
                           poll_s: float = 0.1, is_alive: Callable[[], bool] | None = None,
                           *, probe_timeout_s: float = 1.0) -> ProbeResult:
    """Poll until the instance is ready, deadline_s (seconds from now) passes, or is_alive() is False.

    The short poll keeps restart overhead low: the instance is routed to within
    about poll_s of becoming ready. is_alive is checked every poll_s even while a
    probe is in flight, so a process that dies during startup is reported at once
    instead of after the (possibly 15-minute) startup deadline.
    Returns ok=True with latency_s = time waited, or ok=False with why.
    """
    if poll_s <= 0:
        raise ValueError(f"poll_s={poll_s!r}: must be positive (0 would spin the loop)")
    alive = is_alive if is_alive is not None else (lambda: True)
    start = time.monotonic()
    end = start + deadline_s
    last = ProbeResult(False, "no probe ran", 0.0)
    while True:
        if not alive():
            return ProbeResult(False, f"process exited while starting (last probe: {last.reason})",
                               time.monotonic() - start)
        remaining = end - time.monotonic()
        if remaining <= 0:
            return ProbeResult(False, f"not ready after {deadline_s:g}s (last probe: {last.reason})",
                               time.monotonic() - start)
        task = asyncio.ensure_future(probe_instance(session, base_url, model, min(probe_timeout_s, remaining)))
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=poll_s)
                if not task.done() and not alive():
                    task.cancel()
                    break
        finally:
            # Our own cancellation must not leave the probe running unowned.
            await cancel_and_wait(task)
        if task.cancelled():
            continue  # the loop top reports the death
        last = task.result()
        if last.ok:
            return ProbeResult(True, "", time.monotonic() - start)
        await asyncio.sleep(max(0.0, min(poll_s, end - time.monotonic())))
