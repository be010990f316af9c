"""Probes and the canary against real aiohttp servers on loopback; the scheduler with a fake clock."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from orchestrator.health.canary import CanaryScheduler, default_canary_body, run_canary
from orchestrator.health.probes import probe_instance, wait_until_ready

pytestmark = pytest.mark.unit

MODEL = "ensemble"


class Fake:
    """A fake Triton whose per-path answers the test changes on the fly."""

    def __init__(self) -> None:
        self.status: dict[str, int] = {}
        self.hang: set[str] = set()
        self.bodies: dict[str, str] = {}
        self.hits: list[str] = []
        self.raw_paths: list[str] = []
        self.posted: list[dict] = []
        self.release = asyncio.Event()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        self.hits.append(path)
        self.raw_paths.append(request.raw_path)
        if request.method == "POST":
            self.posted.append(await request.json())
        if path in self.hang:
            await self.release.wait()  # like a hung rank: accepts, never answers
        status = self.status.get(path, 200)
        default = '{"text_output": "x"}' if path.endswith("/generate") else ""
        return web.Response(status=status, text=self.bodies.get(path, default))


@pytest.fixture
async def fake() -> AsyncIterator[tuple[Fake, str]]:
    f = Fake()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", f.handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield f, str(server.make_url(""))
    finally:
        f.release.set()
        await server.close()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def closed_port_url() -> str:
    # Bind then close: nothing listens there, so connect is refused at once.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


# --- probe_instance -----------------------------------------------------------


async def test_probe_ok_checks_all_three_in_order(fake, session) -> None:
    f, url = fake
    r = await probe_instance(session, url, MODEL, 1.0)
    assert r.ok and r.reason == "" and 0 <= r.latency_s < 1.0
    assert f.hits == ["/v2/health/live", "/v2/health/ready", f"/v2/models/{MODEL}/ready"]


async def test_probe_server_not_ready(fake, session) -> None:
    f, url = fake
    f.status["/v2/health/ready"] = 400
    r = await probe_instance(session, url, MODEL, 1.0)
    assert not r.ok
    assert r.reason == "GET /v2/health/ready -> 400"
    assert f.hits == ["/v2/health/live", "/v2/health/ready"]  # stops at the first failure


async def test_probe_model_not_ready_carries_short_error_body(fake, session) -> None:
    f, url = fake
    path = f"/v2/models/{MODEL}/ready"
    f.status[path] = 400
    f.bodies[path] = '{"error":"Request for unknown model:\n \'ensemble\' is not found"}'
    r = await probe_instance(session, url, MODEL, 1.0)
    assert r.reason.startswith(f"GET {path} -> 400: {{\"error\"")
    assert "\n" not in r.reason


async def test_probe_long_error_body_is_truncated(fake, session) -> None:
    f, url = fake
    f.status["/v2/health/live"] = 503
    f.bodies["/v2/health/live"] = "x" * 10_000
    r = await probe_instance(session, url, MODEL, 1.0)
    assert r.reason.startswith("GET /v2/health/live -> 503: xxx") and len(r.reason) < 250


async def test_probe_hang_times_out_with_one_overall_deadline(fake, session) -> None:
    f, url = fake
    f.hang.add(f"/v2/models/{MODEL}/ready")
    start = time.monotonic()
    r = await probe_instance(session, url, MODEL, 0.3)
    elapsed = time.monotonic() - start
    assert not r.ok
    assert r.reason == f"GET /v2/models/{MODEL}/ready: timeout after 0.3s"
    assert 0.25 <= elapsed < 1.0 and 0.25 <= r.latency_s < 1.0


async def test_probe_hang_on_live_names_live(fake, session) -> None:
    f, url = fake
    f.hang.add("/v2/health/live")
    r = await probe_instance(session, url, MODEL, 0.2)
    assert r.reason == "GET /v2/health/live: timeout after 0.2s"


async def test_probe_connection_refused_is_a_result_not_an_exception(session) -> None:
    r = await probe_instance(session, closed_port_url(), MODEL, 1.0)
    assert not r.ok
    assert r.reason == "GET /v2/health/live: connect refused"
    assert r.latency_s < 1.0


async def test_probe_server_drops_connection(session) -> None:
    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readline()
        writer.close()  # closes without answering, like a process killed mid-request

    server = await asyncio.start_server(drop, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        r = await probe_instance(session, f"http://127.0.0.1:{port}", MODEL, 1.0)
    finally:
        server.close()
        await server.wait_closed()
    assert not r.ok
    assert r.reason.startswith("GET /v2/health/live: ServerDisconnectedError")


async def test_probe_quotes_model_names(fake, session) -> None:
    f, url = fake
    await probe_instance(session, url + "/", "a/b?c", 1.0)  # trailing slash on base is fine too
    # '/' and '?' stay inside the model segment instead of adding a path level or a query.
    assert f.raw_paths[-1] == "/v2/models/a%2Fb%3Fc/ready"
    assert len(f.hits) == 3


async def test_probe_external_cancellation_propagates(fake, session) -> None:
    f, url = fake
    f.hang.add("/v2/health/live")
    task = asyncio.ensure_future(probe_instance(session, url, MODEL, 5.0))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


# --- wait_until_ready ---------------------------------------------------------


async def test_wait_until_ready_returns_soon_after_ready(fake, session) -> None:
    f, url = fake
    f.status["/v2/health/ready"] = 400

    async def become_ready() -> None:
        await asyncio.sleep(0.3)
        f.status["/v2/health/ready"] = 200

    flip = asyncio.ensure_future(become_ready())
    r = await wait_until_ready(session, url, MODEL, 5.0, poll_s=0.05)
    await flip
    assert r.ok
    assert 0.3 <= r.latency_s < 0.6  # within about one poll of becoming ready


async def test_wait_until_ready_deadline(fake, session) -> None:
    f, url = fake
    f.status["/v2/health/ready"] = 400
    start = time.monotonic()
    r = await wait_until_ready(session, url, MODEL, 0.4, poll_s=0.05)
    assert not r.ok
    assert r.reason == "not ready after 0.4s (last probe: GET /v2/health/ready -> 400)"
    assert 0.4 <= time.monotonic() - start < 0.8


async def test_wait_until_ready_deadline_bounds_a_hanging_probe(fake, session) -> None:
    f, url = fake
    f.hang.add("/v2/health/live")
    start = time.monotonic()
    r = await wait_until_ready(session, url, MODEL, 0.3, poll_s=0.05, probe_timeout_s=10.0)
    assert not r.ok and "not ready after 0.3s" in r.reason and "timeout" in r.reason
    assert time.monotonic() - start < 0.8


async def test_wait_until_ready_while_refused(session) -> None:
    r = await wait_until_ready(session, closed_port_url(), MODEL, 0.3, poll_s=0.05)
    assert not r.ok and r.reason.endswith("(last probe: GET /v2/health/live: connect refused)")


async def test_wait_until_ready_returns_at_once_when_process_died(fake, session) -> None:
    f, url = fake
    f.status["/v2/health/ready"] = 400
    dead_at = time.monotonic() + 0.2
    start = time.monotonic()
    r = await wait_until_ready(session, url, MODEL, 30.0, poll_s=0.05, is_alive=lambda: time.monotonic() < dead_at)
    assert not r.ok and r.reason.startswith("process exited while starting")
    assert time.monotonic() - start < 0.5


async def test_wait_until_ready_notices_death_during_a_hanging_probe(fake, session) -> None:
    f, url = fake
    f.hang.add("/v2/health/live")
    dead_at = time.monotonic() + 0.2
    start = time.monotonic()
    r = await wait_until_ready(session, url, MODEL, 30.0, poll_s=0.05, probe_timeout_s=20.0,
                               is_alive=lambda: time.monotonic() < dead_at)
    assert not r.ok and r.reason.startswith("process exited while starting")
    assert time.monotonic() - start < 0.5


async def test_wait_until_ready_dead_from_the_start_probes_nothing(fake, session) -> None:
    f, url = fake
    r = await wait_until_ready(session, url, MODEL, 30.0, is_alive=lambda: False)
    assert not r.ok and f.hits == []


async def test_wait_until_ready_cancel_leaves_no_task(fake, session) -> None:
    f, url = fake
    f.hang.add("/v2/health/live")
    task = asyncio.ensure_future(wait_until_ready(session, url, MODEL, 30.0, poll_s=0.05, probe_timeout_s=20.0))
    await asyncio.sleep(0.1)

    def probes() -> list[asyncio.Task]:
        return [t for t in asyncio.all_tasks() if t.get_coro().__name__ == "probe_instance" and not t.done()]

    assert len(probes()) == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # The in-flight probe went down with it (the fake server's own handler tasks do not count).
    assert probes() == []


async def test_wait_until_ready_rejects_zero_poll(session) -> None:
    with pytest.raises(ValueError, match="poll_s"):
        await wait_until_ready(session, "http://127.0.0.1:1", MODEL, 1.0, poll_s=0)


# --- run_canary ---------------------------------------------------------------


async def test_canary_ok_posts_the_body(fake, session) -> None:
    f, url = fake
    r = await run_canary(session, url, MODEL, default_canary_body(), 1.0)
    assert r.ok and r.reason == ""
    assert f.hits == [f"/v2/models/{MODEL}/generate"]
    assert f.posted == [{"text_input": "canary", "max_tokens": 1, "bad_words": "", "stop_words": ""}]


async def test_canary_hang_is_caught_by_the_deadline_even_if_ready_is_200(fake, session) -> None:
    f, url = fake
    f.hang.add(f"/v2/models/{MODEL}/generate")
    assert (await probe_instance(session, url, MODEL, 1.0)).ok  # health says fine ...
    r = await run_canary(session, url, MODEL, default_canary_body(), 0.3)
    assert not r.ok  # ... the canary knows better
    assert r.reason == f"POST /v2/models/{MODEL}/generate: timeout after 0.3s"


async def test_canary_error_status(fake, session) -> None:
    f, url = fake
    path = f"/v2/models/{MODEL}/generate"
    f.status[path] = 500
    f.bodies[path] = '{"error":"executor failed"}'
    r = await run_canary(session, url, MODEL, default_canary_body(), 1.0)
    assert r.reason == f'POST {path} -> 500: {{"error":"executor failed"}}'


async def test_canary_200_with_garbage_is_a_failure(fake, session) -> None:
    f, url = fake
    f.bodies[f"/v2/models/{MODEL}/generate"] = "<html>oops"
    r = await run_canary(session, url, MODEL, default_canary_body(), 1.0)
    assert not r.ok and "-> 200 but not JSON" in r.reason


async def test_canary_refused(session) -> None:
    r = await run_canary(session, closed_port_url(), MODEL, default_canary_body(), 1.0)
    assert not r.ok and r.reason == f"POST /v2/models/{MODEL}/generate: connect refused"


def test_default_canary_body_is_fresh_each_time() -> None:
    a = default_canary_body()
    a["max_tokens"] = 99
    assert default_canary_body()["max_tokens"] == 1


# --- CanaryScheduler ----------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 500.0

    def __call__(self) -> float:
        return self.now


def test_scheduler_disabled_when_interval_zero() -> None:
    c = FakeClock()
    s = CanaryScheduler(0, 5, clock=c)
    c.now += 1e6
    assert not s.due()


def test_scheduler_not_due_right_after_start() -> None:
    assert not CanaryScheduler(30, 5, clock=FakeClock()).due()


def test_scheduler_idle_instance_runs_early() -> None:
    c = FakeClock()
    s = CanaryScheduler(30, 5, clock=c)
    c.now += 4.9
    assert not s.due()
    c.now += 0.1
    assert s.due()
    s.ran()
    assert not s.due()
    c.now += 5
    assert s.due()  # still idle: the canary is the only thing proving it works


def test_scheduler_traffic_postpones_the_idle_run_but_not_the_interval() -> None:
    c = FakeClock()
    s = CanaryScheduler(30, 5, clock=c)
    for _ in range(29):
        c.now += 1
        s.note_traffic()
        assert not s.due()
    c.now += 1
    assert s.due()  # interval_s since the last canary, traffic or not
    s.ran()
    c.now += 4
    s.note_traffic()
    assert not s.due()


def test_scheduler_traffic_that_stops_finishing_triggers_the_canary() -> None:
    # A hang: requests keep arriving but none completes, so note_traffic stops.
    c = FakeClock()
    s = CanaryScheduler(30, 5, clock=c)
    c.now += 10
    s.note_traffic()
    s.ran()  # pretend a canary also just ran
    c.now += 4.99
    assert not s.due()
    c.now += 0.01
    assert s.due()


def test_scheduler_idle_zero_means_interval_only() -> None:
    c = FakeClock()
    s = CanaryScheduler(30, 0, clock=c)
    c.now += 29.9
    assert not s.due()
    c.now += 0.1
    assert s.due()


def test_scheduler_rejects_negative() -> None:
    with pytest.raises(ValueError):
        CanaryScheduler(-1, 5)
