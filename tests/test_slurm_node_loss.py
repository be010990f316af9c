"""Issue 26: a node vanishes (every process on it stopped, or its cable cut), and comes back.

Nothing refuses and nothing closes when a machine goes: requests to it just wait. The
engine monitor's scrapes are every instance's heartbeat; --silent-after-s of silence
takes the instance out of rotation and fails what waits on it, which the data plane
retries on the other nodes (health/engine_monitor.py, Instance.silent, the `abort`
feed message, UpstreamPool.abort).

Unit layer first (the silence verdict, the instance's reaction, the proxy's abort);
then end to end on the real test cluster (scripts/setup-slurm: slurmctld and two slurmd
"nodes" in network namespaces), where a node is frozen and killed, or cut off.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from orchestrator.config import Settings
from orchestrator.controlplane.states import State
from orchestrator.dataplane.embedded import EmbeddedProxy
from orchestrator.health.engine_monitor import EngineMonitor
from orchestrator.health.engine_state import EngineView
from orchestrator.routing.backends import Backend, ReadyBackends
from tests.fakes import OK, FakeChecks, bad
from tests.test_instance_machine import Rig
from tests.test_proxy_embedded import AppUpstream

GEN = "/v2/models/ensemble/generate"


# --- the silence verdict ---------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def monitor(silent_after_s: float = 0.6) -> tuple[EngineMonitor, list[str], Clock]:
    heard: list[str] = []
    clock = Clock()
    m = EngineMonitor(None, "", EngineView(), 0.1, 0, lambda r: None,  # type: ignore[arg-type]
                      silent_after_s, heard.append, clock=clock)
    m.last_answer = clock.now
    return m, heard, clock


@pytest.mark.unit
def test_silence_is_reported_once_after_silent_after_s_and_again_only_after_an_answer():
    m, heard, clock = monitor(0.5)
    clock.now += 0.25
    m.heard(clock.now, "timeout")
    assert heard == []  # 0.25 s of silence is not yet 0.5
    clock.now += 0.25
    m.heard(clock.now, "timeout")
    assert len(heard) == 1 and heard[0].startswith("silent: no answer from its metrics port for 0.50s")
    clock.now += 1.0
    m.heard(clock.now, "ClientConnectorError")
    assert len(heard) == 1  # one report per silence
    m.heard(clock.now, None)  # it answers again
    clock.now += 0.7
    m.heard(clock.now, "timeout")
    assert len(heard) == 2 and "(last scrape: timeout)" in heard[1]


@pytest.mark.unit
def test_a_late_timeout_is_our_loop_being_late_and_does_not_count():
    m, heard, clock = monitor(0.6)
    clock.now += 1.5
    m.heard(clock.now, "timeout", late=True)
    assert heard == []
    m.heard(clock.now, None)  # the next scrape, on time, got its answer: it never was silent
    clock.now += 0.3
    m.heard(clock.now, "timeout")
    assert heard == []


@pytest.mark.unit
def test_no_silence_verdict_without_a_listener_or_with_zero():
    for m in (EngineMonitor(None, "", EngineView(), 0.1, 0, lambda r: None, 0.6, None),  # type: ignore[arg-type]
              EngineMonitor(None, "", EngineView(), 0.1, 0, lambda r: None, 0.0, lambda r: None)):  # type: ignore[arg-type]
        m.last_answer = 0.0
        m.heard(1000.0, "timeout")
        assert not m.silent


class MetricsPort:
    """A metrics endpoint that answers until `hang` is set, then takes requests and never answers."""

    def __init__(self) -> None:
        self.hang = asyncio.Event()
        self.answered = 0
        self.runner: web.ServerRunner | None = None
        self.port = 0

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        if self.hang.is_set():
            await asyncio.Event().wait()
        self.answered += 1
        return web.Response(text="# no engine here\n")

    async def __aenter__(self) -> "MetricsPort":
        self.runner = web.ServerRunner(web.Server(self._handle, access_log=None))
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


@pytest.mark.unit
async def test_a_metrics_port_that_stops_answering_is_reported_after_silent_after_s():
    loop = asyncio.get_running_loop()
    reports: list[tuple[float, str]] = []
    async with MetricsPort() as port, aiohttp.ClientSession() as session:
        m = EngineMonitor(session, f"http://127.0.0.1:{port.port}/metrics", EngineView(), 0.05, 0,
                          lambda r: None, 0.4, lambda r: reports.append((loop.time(), r)))
        task = asyncio.create_task(m.run())
        try:
            await asyncio.sleep(0.5)
            assert reports == [] and port.answered >= 3  # answering: no verdict
            t0 = loop.time()
            port.hang.set()
            while not reports and loop.time() - t0 < 5:
                await asyncio.sleep(0.01)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    assert len(reports) == 1, reports
    took = reports[0][0] - t0
    # The last answer came at most one period (0.05 s) before the hang: the verdict is
    # 0.4 s after it, give or take a loaded machine's scheduling.
    assert 0.3 <= took <= 1.2, took
    assert "(last scrape: timeout)" in reports[0][1]


# --- the instance's reaction --------------------------------------------------------------
class Aborts:
    """Records what the instance asks the data plane to abort (Shared.abort_upstream)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool, str]] = []

    def __call__(self, backend: Backend, reason: str, answering: bool) -> None:
        self.calls.append((backend.instance_id, answering, reason))

    @classmethod
    def rig(cls, tmp_path, checks: FakeChecks | None = None) -> tuple[Rig, "Aborts"]:
        rig, aborts = Rig(tmp_path, checks), cls()
        rig.shared.abort_upstream = aborts
        return rig, aborts


@pytest.mark.unit
async def test_a_silent_instance_leaves_rotation_at_once_then_its_streams_are_cut_when_the_canary_fails(tmp_path):
    gate = asyncio.Event()
    rig, aborts = Aborts.rig(tmp_path, FakeChecks(canaries=[bad("POST generate: timeout after 10s"), OK],
                                                  canary_gate=gate))
    async with rig:
        await asyncio.sleep(0)
        rig.checks.on_silent("silent: no answer from its metrics port for 0.60s (last scrape: timeout)")
        # Out of rotation and the waiting requests moved, before any await.
        assert rig.inst.state == State.UNHEALTHY
        assert aborts.calls == [("0", False, "silent: no answer from its metrics port for 0.60s "
                                             "(last scrape: timeout)")]
        gate.set()  # the canary times out: torn down still silent, its streams are cut too
        await rig.relaunched(2)
        assert [a[:2] for a in aborts.calls] == [("0", False), ("0", True)]
        assert "silent" in rig.inst.last_failure and "canary" in rig.inst.last_failure


@pytest.mark.unit
async def test_a_silence_the_canary_disproves_readmits_and_cuts_nothing(tmp_path):
    rig, aborts = Aborts.rig(tmp_path, FakeChecks(canaries=[OK]))
    async with rig:
        await asyncio.sleep(0)
        rig.checks.on_silent("silent: no answer from its metrics port for 0.61s (last scrape: timeout)")
        assert rig.inst.state == State.UNHEALTHY
        await rig.until(State.READY)
        assert [a[:2] for a in aborts.calls] == [("0", False)]  # no stream was cut
        assert rig.inst.restarts == 0 and rig.inst.launches == 1
        assert rig.inst._silent is None


@pytest.mark.unit
async def test_a_failure_of_a_reachable_instance_cuts_nothing_at_teardown(tmp_path):
    rig, aborts = Aborts.rig(tmp_path)
    async with rig:
        rig.group.die("tritonserver (pid 5) exited")
        await rig.relaunched(2)
    assert aborts.calls == []  # its processes are gone: their connections closed by themselves


# --- the data plane's abort ----------------------------------------------------------------
async def hang(request: web.BaseRequest) -> web.StreamResponse:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def stream_then_hang(request: web.BaseRequest) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(b"data: {\"text_output\": \"a\"}\n\n")
    await asyncio.Event().wait()
    return resp


@pytest.mark.unit
async def test_abort_moves_the_waiting_requests_to_another_instance_and_cuts_only_streams_of_the_silent_one():
    silent = await AppUpstream(hang).start()
    good = await AppUpstream().start()
    backends = ReadyBackends()
    b0, b1 = Backend("0", "127.0.0.1", silent.port, 1, 2), Backend("1", "127.0.0.1", good.port, 1, 2)
    backends.publish((b0,))  # every request lands on the instance that is about to go silent
    proxy = EmbeddedProxy(Settings(listen="127.0.0.1:0", metrics_listen="", lb_policy="round-robin",
                                   openai="off"), backends)
    await proxy.start()
    url = f"http://127.0.0.1:{proxy.bound_port}"
    try:
        async with aiohttp.ClientSession() as s:
            async def post():
                async with s.post(url + GEN, json={"text_input": "x"}) as r:
                    return r.status, await r.json()
            waiting = [asyncio.create_task(post()) for _ in range(3)]
            while len(silent.requests) < 3:
                await asyncio.sleep(0.01)
            # What the daemon does when the instance is silent: publish the set without it,
            # then abort what waits on it (answers not arriving yet).
            backends.publish((b1,))
            proxy.abort_instance("127.0.0.1", silent.port, "silent for 0.6s", answering=False)
            results = await asyncio.wait_for(asyncio.gather(*waiting), 5)
            assert results == [(200, {"port": good.port, "path": GEN})] * 3

            # A stream that has begun is committed: aborting the waiting ones leaves it; the
            # teardown's abort (answering) cuts it, and only it.
            silent.handler = stream_then_hang
            good.handler = stream_then_hang
            backends.publish((b0, b1))
            chunks: dict[int, list[bytes]] = {}
            errors: dict[int, str] = {}

            async def read_stream(i: int):
                chunks[i] = []
                try:
                    async with s.post(url + "/v2/models/ensemble/generate_stream", json={"text_input": "x"}) as r:
                        async for chunk in r.content.iter_any():
                            chunks[i].append(chunk)
                except aiohttp.ClientError as exc:
                    errors[i] = type(exc).__name__
            streams = [asyncio.create_task(read_stream(i)) for i in range(2)]  # round robin: one each
            while not (len(chunks) == 2 and all(chunks.values())):
                await asyncio.sleep(0.01)
            proxy.abort_instance("127.0.0.1", silent.port, "silent for 0.6s", answering=False)
            await asyncio.sleep(0.2)
            assert not any(t.done() for t in streams)
            proxy.abort_instance("127.0.0.1", silent.port, "still silent; canary failed", answering=True)
            done, pending = await asyncio.wait(streams, timeout=5, return_when=asyncio.FIRST_COMPLETED)
            assert len(done) == 1 and len(pending) == 1 and len(errors) == 1  # the cut one ends, truncated
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    finally:
        await proxy.stop(0.5)
        await silent.close()
        await good.close()
