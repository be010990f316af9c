"""A worker's proxy with --front compiled: the C front serves the native generations with the
embedded path's rules (front/path.py), aiohttp everything else. In process, on real sockets:
the proxy on a listening socket handed to it as a worker's is, instances as aiohttp servers."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest
from aiohttp import web

from orchestrator.config import Settings
from orchestrator.dataplane.accept import bind_listener
from orchestrator.dataplane.embedded import EmbeddedProxy
from orchestrator.dataplane.front.compiled import NATIVE
from orchestrator.routing.backends import Backend, ReadyBackends
from tests.test_proxy_embedded import AppUpstream
from tests.test_proxy_error_retry import silent_for

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(NATIVE is None, reason="the compiled front is not built here")]

GEN = "/v2/models/ensemble/generate"
STREAM = "/v2/models/ensemble/generate_stream"
EVENTS = 5


async def sse(request: web.BaseRequest) -> web.StreamResponse:
    """generate_stream as Triton answers it: chunked SSE, one event per token."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(EVENTS):
        await resp.write(b'data: {"text_output": "t%d"}\n\n' % i)
    await resp.write_eof()
    return resp


class Front:
    """A proxy serving through the compiled front, on a socket it does not own (a worker's)."""

    def __init__(self, *upstreams: AppUpstream, **settings: object) -> None:
        self.backends = ReadyBackends()
        self.backends.publish(tuple(Backend(str(i), "127.0.0.1", u.port, 1, 2) for i, u in enumerate(upstreams)))
        base: dict[str, object] = dict(listen="127.0.0.1:0", metrics_listen="", lb_policy="round-robin",
                                       front="compiled", connect_timeout_s=1.0, idle_timeout_s=5.0)
        base.update(settings)
        self.sock = bind_listener("127.0.0.1:0", "--listen")
        self.proxy = EmbeddedProxy(Settings(**base), self.backends, sockets={"listen": self.sock})
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    async def __aenter__(self) -> "Front":
        await self.proxy.start()
        self.session = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.session.close()
        await self.proxy.stop(grace_s=2.0)
        self.sock.close()

    def metric(self, name: str, **labels: str) -> float:
        """As a scrape reads it (the counting queued after the answers done first)."""
        self.proxy.metrics.settle()
        return self.proxy.metrics.registry.get_sample_value(name, labels) or 0.0

    async def post(self, path: str = GEN, prompt: str = "x", **kw: object) -> tuple[int, bytes, dict[str, str]]:
        async with self.session.post(self.url + path, json={"text_input": prompt}, **kw) as r:
            return r.status, await r.read(), dict(r.headers)


@pytest.mark.parametrize("policy", ["round-robin", "cost-model"])
async def test_streams_are_served_by_the_front_and_counted_as_the_embedded_path_counts_them(policy):
    """cost-model's pick learns from the first token as it comes (decide asks for first());
    every policy's TTFT and upstream latency come from the front's clock at the release."""
    up = await AppUpstream(sse).start()
    try:
        async with Front(up, lb_policy=policy) as f:
            for _ in range(3):
                status, body, headers = await f.post(STREAM)
                assert status == 200 and body.count(b"data:") == EVENTS
                assert headers["Content-Type"] == "text/event-stream" and headers["X-Accel-Buffering"] == "no"
            assert NATIVE.stats()["served"] == 3  # the front's, not aiohttp's
            assert f.metric("trtllm_orch_proxy_requests_total", instance="0", code="200") == 3
            assert f.metric("trtllm_orch_proxy_output_events_total", instance="0", api="generate_stream") == 3 * EVENTS
            assert f.metric("trtllm_orch_proxy_time_to_first_token_seconds_count", instance="0",
                            api="generate_stream") == 3
            assert f.metric("trtllm_orch_proxy_upstream_latency_seconds_count", instance="0") == 3
            # the gaps between a stream's events, counted per bucket in C
            assert f.metric("trtllm_orch_proxy_inter_token_seconds_count", instance="0",
                            api="generate_stream") == 3 * (EVENTS - 1)
            ttft = f.metric("trtllm_orch_proxy_time_to_first_token_seconds_sum", instance="0", api="generate_stream")
            assert 0 < ttft < 3.0
            assert f.proxy.inflight() == {"0": 0}
            assert f.metric("trtllm_orch_proxy_inflight_requests", instance="0") == 0
            picks = [s.value for fam in f.proxy.metrics.registry.collect() for s in fam.samples
                     if s.name == "trtllm_orch_proxy_routing_decisions_total" and s.labels["policy"] == policy]
            assert sum(picks) == 3
            assert f.proxy.metrics.recent.summary()["0"]["generations"] == 3
    finally:
        await up.close()


async def test_the_default_policy_routes_a_long_prompt_by_its_prefix_and_a_short_one_by_load():
    """A prompt of a chunk or more goes where it went before; one shorter than a chunk is not
    parsed (Balancer.wants_prompt_of) and is routed as no prompt: in turn, as both are idle."""
    ups = [await AppUpstream(sse).start() for _ in range(2)]
    try:
        async with Front(*ups, lb_policy="prefix-affinity") as f:
            tenant = "You are the assistant of one tenant; answer briefly. " * 12  # 2 full chunks
            for i in range(4):
                status, body, _ = await f.post(STREAM, prompt=tenant + f"Question {i}?")
                assert status == 200 and body.count(b"data:") == EVENTS
            assert sorted(len(u.requests) for u in ups) == [0, 4]
            for _ in range(4):
                assert (await f.post(STREAM, prompt="hi"))[0] == 200
            assert sorted(len(u.requests) for u in ups) == [2, 6]
            assert NATIVE.stats()["served"] == 8
            f.proxy.metrics.settle()  # as a scrape reads them
            reasons = {}
            for fam in f.proxy.metrics.registry.collect():
                for sample in fam.samples:
                    if sample.name == "trtllm_orch_proxy_routing_decisions_total" and sample.value:
                        reasons[sample.labels["reason"]] = reasons.get(sample.labels["reason"], 0) + sample.value
            assert reasons == {"prefix-miss": 1, "prefix": 3, "no-prompt": 4}
    finally:
        for u in ups:
            await u.close()


async def test_refusals_go_to_another_instance_and_client_errors_to_the_client():
    async def busy(request: web.BaseRequest) -> web.StreamResponse:
        return web.json_response({"error": "peer rank lost"}, status=503)

    async def queue_full(request: web.BaseRequest) -> web.StreamResponse:
        return web.json_response({"error": "Maximum queue size of 4 reached"}, status=500)

    async def invalid(request: web.BaseRequest) -> web.StreamResponse:
        return web.json_response({"error": "unexpected inference input 'foo'"}, status=400)

    ups = [await AppUpstream(h).start() for h in (busy, queue_full)]
    good = await AppUpstream().start()
    try:
        async with Front(*ups, good) as f:
            for _ in range(4):
                status, body, _ = await f.post()
                assert status == 200 and str(good.port).encode() in body
            assert all(u.requests for u in ups)  # tried, and no byte of theirs reached the client
            assert f.metric("trtllm_orch_proxy_retries_total", instance="0", reason="http_503") >= 1
            assert f.metric("trtllm_orch_proxy_retries_total", instance="1", reason="queue_full") >= 1
        bad = await AppUpstream(invalid).start()
        try:
            async with Front(bad) as f:
                status, body, _ = await f.post()
                assert status == 400 and b"unexpected inference input" in body
                assert len(bad.requests) == 1  # a client's error is not retried
        finally:
            await bad.close()
    finally:
        for u in (*ups, good):
            await u.close()


async def test_an_instance_that_refuses_connections_is_passed_over_and_a_silent_one_gets_504():
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))  # bound, never listening: connections refused
    good = await AppUpstream().start()

    class Refusing:
        port = dead.getsockname()[1]

    try:
        async with Front(Refusing, good) as f:  # type: ignore[arg-type]
            for _ in range(3):
                status, body, _ = await f.post()
                assert status == 200 and str(good.port).encode() in body
            assert f.metric("trtllm_orch_proxy_upstream_failures_total", instance="0", reason="connect_refused") >= 1

        async def silent(request: web.BaseRequest) -> web.StreamResponse:
            await asyncio.sleep(30)
            raise AssertionError("never answers")

        hung = await AppUpstream(silent).start()
        try:
            async with Front(hung, idle_timeout_s=0.5) as f:
                status, body, _ = await f.post()
                assert status == 504 and b"did not answer within the idle timeout" in body
        finally:
            await hung.close()
    finally:
        dead.close()
        await good.close()


async def test_no_answer_head_within_the_first_byte_timeout_is_cancelled_and_retried_elsewhere():
    """--first-byte-timeout-s, kept by the front (at its sweeps), as the embedded path keeps it."""
    cancelled: list[bool] = []
    slow, good = await AppUpstream(silent_for(30, cancelled)).start(), await AppUpstream().start()
    try:
        async with Front(slow, good, first_byte_timeout_s=0.3) as f:
            for _ in range(4):
                status, body, _ = await f.post()
                assert status == 200 and str(good.port).encode() in body
            assert NATIVE.stats()["served"] == 4  # the front's, not handed to aiohttp
            assert len(slow.requests) >= 1
            for _ in range(50):  # the cancel reaches the slow instance's handler through its socket
                if len(cancelled) == len(slow.requests):
                    break
                await asyncio.sleep(0.05)
            assert len(cancelled) == len(slow.requests)
            assert f.metric("trtllm_orch_proxy_retries_total", instance="0", reason="first_byte_timeout") >= 1
        # a slower first byte than --idle-timeout-s allows is still the idle timeout's: 504, not retried
        async with Front(slow, good, first_byte_timeout_s=5.0, idle_timeout_s=0.3, lb_policy="least-outstanding") as f:
            f.backends.publish(f.backends.current()[:1])
            status, body, _ = await f.post()
            assert status == 504 and b"did not answer within the idle timeout" in body
    finally:
        await slow.close()
        await good.close()


async def test_a_request_with_bare_line_feeds_is_answered_by_aiohttp():
    """A head whose lines end in a bare LF: the front hands it to aiohttp, which answers it as
    without the front (its 400), at once, instead of the front waiting for a CRLF CRLF that never
    comes (a 408 after the head deadline, before)."""
    up = await AppUpstream().start()
    try:
        async with Front(up) as f:
            reader, writer = await asyncio.open_connection("127.0.0.1", f.sock.getsockname()[1])
            body = b'{"text_input": "x"}'
            writer.write(b"POST %s HTTP/1.1\nHost: x\nContent-Length: %d\n\n%s" % (GEN.encode(), len(body), body))
            answer = await asyncio.wait_for(reader.read(4096), 5)
            assert answer.startswith(b"HTTP/1.0 400 Bad Request"), answer[:200]
            assert NATIVE.stats()["served"] == 0 and up.requests == []
            writer.close()
    finally:
        await up.close()


async def test_what_is_not_a_public_generation_is_answered_by_aiohttp():
    up = await AppUpstream().start()
    try:
        async with Front(up) as f:
            async with f.session.get(f.url + "/v2/health/ready") as r:
                assert r.status == 200
            for _ in range(2):  # the second time as the front remembers the first
                status, body, _ = await f.post("/v2/repository/models/ensemble/load")
                assert status == 403 and b"admin API is disabled" in body
            assert up.requests == [] and NATIVE.stats()["served"] == 0
            # a generation with a query, or on a path aiohttp normalises, is sent as aiohttp sends it
            for path in (GEN + "?trace=1", GEN + "?trace=1", "/v2//models/ensemble/generate"):
                assert (await f.post(path))[0] == 200
            assert [r["path"] for r in up.requests] == [GEN + "?trace=1", GEN + "?trace=1", GEN]
            assert NATIVE.stats()["served"] == 0
    finally:
        await up.close()


async def test_with_no_instance_ready_the_request_is_held_by_aiohttp_then_served():
    up = await AppUpstream().start()
    try:
        async with Front(up, hold_s=5.0) as f:
            ready = f.backends.current()
            f.backends.publish(())
            pending = asyncio.ensure_future(f.post())
            await asyncio.sleep(0.3)
            assert not pending.done()  # held
            f.backends.publish(ready)
            status, _, _ = await asyncio.wait_for(pending, 5)
            assert status == 200
    finally:
        await up.close()


async def test_stop_lets_a_stream_finish_and_abort_cuts_one():
    async def slow_sse(request: web.BaseRequest) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(EVENTS):
            await resp.write(b"data: %d\n\n" % i)
            await asyncio.sleep(0.1)
        await resp.write_eof()
        return resp

    up = await AppUpstream(slow_sse).start()
    try:
        f = Front(up)
        await f.__aenter__()
        try:
            pending = asyncio.ensure_future(f.post(STREAM))
            await asyncio.sleep(0.15)
            await f.proxy.stop(grace_s=2.0)  # the stream in flight finishes within the grace
            status, body, _ = await pending
            assert status == 200 and body.count(b"data:") == EVENTS
            assert NATIVE.stats()["served"] == 0  # the front is gone with the proxy
        finally:
            await f.session.close()
            f.sock.close()
        async with Front(up) as f:
            pending = asyncio.ensure_future(f.post(STREAM))
            await asyncio.sleep(0.15)
            f.proxy.abort_instance("127.0.0.1", up.port, "hung", answering=True)
            with pytest.raises(aiohttp.ClientPayloadError):
                await pending  # cut: the client can tell (no last chunk)
            assert f.metric("trtllm_orch_proxy_upstream_failures_total", instance="0", reason="body_error") == 1
            assert f.proxy.inflight() == {"0": 0}
    finally:
        await up.close()


async def test_a_connection_accepted_just_before_a_stop_gets_its_first_request_answered():
    """As GuardedServer.settle does for aiohttp's: a client that connected before the stop and
    sends its request a moment after is answered (Connection: close), not reset unread."""
    up = await AppUpstream().start()
    f = Front(up)
    await f.__aenter__()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", f.sock.getsockname()[1])
        for _ in range(100):
            if NATIVE.stats()["open"] == 1:  # the front has it
                break
            await asyncio.sleep(0.01)
        assert NATIVE.stats()["fresh"] == 1
        stopping = asyncio.ensure_future(f.proxy.stop(grace_s=2.0))
        await asyncio.sleep(0.1)
        body = b'{"text_input": "x"}'
        writer.write(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (GEN.encode(), len(body), body))
        answer = await asyncio.wait_for(reader.read(), 5)  # to the end: the connection closes after it
        head = answer.split(b"\r\n\r\n", 1)[0]
        assert head.startswith(b"HTTP/1.1 200") and b"Connection: close" in head, answer[:300]
        await stopping
        writer.close()
    finally:
        await f.session.close()
        f.sock.close()
        await up.close()


def test_status_says_how_many_requests_the_front_served():
    from orchestrator.cli import format_workers
    worker = {"slot": 0, "pid": 7, "version": "1", "connections": 2, "inflight": 0, "held": 0, "requests": 30,
              "restarts": 0, "front_served": 28}
    pool = {"state": "running", "workers_alive": 2, "workers_wanted": 2, "workers": [worker, {**worker, "slot": 1,
                                                                                            "front_served": None}]}
    lines = format_workers(pool)
    assert "requests 30 (28 by the front)  restarts 0" in lines[1]
    assert "requests 30  restarts 0" in lines[2]  # no front there (--front aiohttp): nothing said
    pool["workers"][1]["front_missing"] = True  # --front compiled, and the worker runs none
    assert "requests 30 (no compiled front: not built, aiohttp serves)  restarts 0" in format_workers(pool)[2]


async def test_a_request_whose_only_instance_dies_is_held_by_aiohttp_until_it_is_back():
    """The one instance refuses (it died, the daemon has not yet seen it): no other to try, so the
    front hands the request to aiohttp, which holds it while no instance is ready and sends it
    once the instance is back (the embedded path's hold through a restart; one instance, as the
    TP4 layout of a 4-GPU node)."""
    port = socket.socket()
    port.bind(("127.0.0.1", 0))  # bound, not listening: refused until the instance is back
    number = port.getsockname()[1]

    class Restarting:
        pass

    Restarting.port = number
    up = AppUpstream()
    try:
        async with Front(Restarting, hold_s=5.0) as f:  # type: ignore[arg-type]
            ready = f.backends.current()
            pending = asyncio.ensure_future(f.post())
            await asyncio.sleep(0.05)
            f.backends.publish(())  # the daemon saw it die
            await asyncio.sleep(0.3)
            assert not pending.done()  # held, not failed
            port.close()
            up.runner = web.ServerRunner(web.Server(up._entry, access_log=None))
            await up.runner.setup()
            await web.TCPSite(up.runner, "127.0.0.1", number).start()  # back, on its port
            up.port = number
            f.backends.publish(ready)
            status, body, _ = await asyncio.wait_for(pending, 5)
            assert status == 200 and str(number).encode() in body
            assert f.metric("trtllm_orch_proxy_upstream_failures_total", instance="0", reason="connect_refused") >= 1
    finally:
        port.close()
        await up.close()


def test_a_batchs_inter_token_counts_are_added_bucket_by_bucket_at_the_fold():
    """Ledger keeps each request's ITL counts and adds them up when it folds: the metrics see, per
    instance and api, the sum of the sums and each bucket's total."""
    from orchestrator.dataplane.front.ledger import Ledger

    class Seen:
        def __init__(self) -> None:
            self.itl: dict[tuple[str, str], tuple[float, list[int]]] = {}

        def inter_token_counts(self, instance: str, api: str, total: float, counts: list[int]) -> None:
            assert (instance, api) not in self.itl  # one call per key and fold
            self.itl[instance, api] = (total, list(counts))

        def __getattr__(self, name: str) -> object:  # every other count: not this test's
            return lambda *a, **k: None

    ledger = Ledger()
    ledger.tokens("0", "generate_stream", None, 3, (0.5, (1, 0, 2)))
    ledger.tokens("1", "generate_stream", None, 2, (0.25, (0, 1, 0)))
    ledger.tokens("0", "generate_stream", None, 4, (1.0, (0, 3, 1)))
    ledger.tokens("0", "generate", None, 1, None)  # one event: no gap to count
    ledger.tokens("0", "generate_stream", None, 5, (0.125, (4, 0, 0)))
    seen = Seen()
    ledger.fold(seen, None, 0.0)
    assert seen.itl == {("0", "generate_stream"): (1.625, [5, 3, 3]), ("1", "generate_stream"): (0.25, [0, 1, 0])}


@pytest.mark.parametrize("front, pure, warned", [("auto", "1", True), ("auto", "0", False),
                                                 ("compiled", "0", False), ("aiohttp", "1", False)])
def test_the_daemon_says_at_start_that_the_compiled_front_is_not_built(tmp_path, monkeypatch, caplog, front, pure,
                                                                       warned):
    """--front auto with the module not built (here: TRTLLM_ORCH_PURE_PYTHON=1 leaves it out, as
    a missing build does): the daemon's own log says so once as the data plane is made, not only
    each worker's log, which `up` does not print."""
    import logging

    from orchestrator.dataplane.front import NOT_BUILT
    from orchestrator.endpoint import make_proxies
    monkeypatch.setenv("TRTLLM_ORCH_PURE_PYTHON", pure)
    with caplog.at_level(logging.WARNING, logger="trtllm-orch.proxy"):
        proxies = make_proxies(Settings(front=front), ReadyBackends(), tmp_path)
    assert [type(p).__name__ for p in proxies] == ["WorkerPool"]
    said = [r.getMessage() for r in caplog.records if r.getMessage() == NOT_BUILT]
    assert len(said) == (1 if warned else 0)


@pytest.mark.parametrize("front, proxy, pure, refused", [("compiled", "embedded", "1", True),
                                                         ("compiled", "embedded", "0", False),
                                                         ("auto", "embedded", "1", False),
                                                         ("aiohttp", "embedded", "1", False),
                                                         ("compiled", "nginx", "1", False)])
def test_front_compiled_is_required_where_asked(monkeypatch, front, proxy, pure, refused):
    """--front compiled is a requirement: where the module is not built, `up` refuses before it
    looks anything up or starts anything (EnvironmentProblem: exit 2, one line naming the field
    and the value); auto falls back to aiohttp, and NGINX mode runs no front at all."""
    from orchestrator.endpoint import check_front
    from orchestrator.errors import EXIT_USAGE, EnvironmentProblem
    monkeypatch.setenv("TRTLLM_ORCH_PURE_PYTHON", pure)
    settings = Settings(front=front, proxy=proxy)
    if not refused:
        check_front(settings)
        return
    with pytest.raises(EnvironmentProblem) as caught:
        check_front(settings)
    assert caught.value.exit_code == EXIT_USAGE
    line = str(caught.value)
    assert line.startswith("--front='compiled': the compiled front is not built here") and "\n" not in line
