"""The OpenAI API through the embedded proxy, with the `openai` SDK as the client.

The instances are small fake Tritons (aiohttp) that answer `generate` and
`generate_stream` as the TRT-LLM ensemble does (text_output, num_input_tokens,
num_output_tokens; SSE for streams; errors as {"error": ...}) and can misbehave on
request: a full queue, an error event, silence. The real thing runs in
test_openai_e2e.py.
"""

from __future__ import annotations

import asyncio
import json
import platform
import shutil
from pathlib import Path

import aiohttp
import openai
import pytest
from aiohttp import web

from orchestrator.config import Settings
from orchestrator.routing.backends import Backend
from orchestrator.dataplane.embedded import EmbeddedProxy
from orchestrator.controlplane.side_workers import side_settings
from orchestrator.dataplane.worker import serves_openai_only
from tests.fakes import RecordingBackends

pytestmark = pytest.mark.unit

# The SDK reads platform.processor() for its headers, which runs `uname -p` once per
# process: run it now, before the unit layer's no-process guard is in place.
platform.processor()

REPO = Path(__file__).resolve().parent.parent
DEMO_REPO = REPO / "demo" / "model_repo"
# Words of the twin's vocabulary (one token each for demo/tokenizer), and a stop word.
WORDS = [" the", " of", " and", " STOP", " to", " in"]
QUEUE_FULL = "[TensorRT-LLM][ERROR] Assertion failed: Maximum queue size of 4 has been reached, please try again later"


class FakeTriton:
    def __init__(self, counts: bool = True) -> None:
        self.counts = counts
        self.mode = "ok"  # ok | queue_full | error_first | error_mid | silent | dies_mid_answer
        self.requests: list[tuple[str, dict]] = []
        self.cancelled = 0
        self.runner: web.ServerRunner | None = None
        self.port = 0

    def _doc(self, text: str, n_in: int, n_out: int) -> dict:
        doc = {"model_name": "ensemble", "model_version": "1", "text_output": text}
        if self.counts:
            doc.update(num_input_tokens=n_in, num_output_tokens=n_out)
        return doc

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        body = await request.json()
        self.requests.append((request.path, body))
        n, prompt = body["max_tokens"], body["text_input"]
        words = WORDS[:n]
        if self.mode == "queue_full" and request.path.endswith("/generate"):
            return web.json_response({"error": QUEUE_FULL}, status=500)  # the model's INTERNAL error
        if self.mode == "dies_mid_answer" and request.path.endswith("/generate"):
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})  # chunked, as Triton's
            await resp.prepare(request)
            await resp.write(b'{"model_name": "ens')
            request.transport.close()  # a rank died: the connection ends inside the answer
            return resp
        if request.path.endswith("/generate"):
            return web.json_response(self._doc("".join(words), len(prompt.encode()), len(words)))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        try:
            if self.mode in ("queue_full", "error_first"):
                msg = QUEUE_FULL if self.mode == "queue_full" else "in ensemble 'ensemble': model exploded"
                await resp.write(b"data: " + json.dumps({"error": msg}).encode() + b"\n\n")
                return resp
            if self.mode == "silent":
                await asyncio.sleep(30)
            for i, w in enumerate(words):
                if self.mode == "error_mid" and i == 2:
                    await resp.write(b'data: {"error":"rank lost"}\n\n')
                    return resp
                await resp.write(b"data: " + json.dumps(self._doc(w, len(prompt.encode()), 1)).encode() + b"\n\n")
                await asyncio.sleep(0.02)
        except (ConnectionError, asyncio.CancelledError):
            self.cancelled += 1
            raise
        await resp.write_eof()
        return resp

    async def start(self) -> "FakeTriton":
        self.runner = web.ServerRunner(web.Server(self._handle, handler_cancellation=True, access_log=None))
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.port = self.runner.addresses[0][1]
        return self

    async def close(self) -> None:
        if self.runner:
            await self.runner.cleanup()


class H:
    def __init__(self) -> None:
        self.backends = RecordingBackends()
        self.proxy: EmbeddedProxy | None = None
        self.ups: list[FakeTriton] = []
        self.session: aiohttp.ClientSession | None = None
        self.clients: list[openai.AsyncOpenAI] = []

    async def start(self, *ups: FakeTriton, publish: bool = True, **settings) -> EmbeddedProxy:
        base = dict(listen="127.0.0.1:0", metrics_listen="127.0.0.1:0", model_repo=str(DEMO_REPO),
                    connect_timeout_s=1.0, idle_timeout_s=5.0, hold_s=0.0)
        base.update(settings)
        self.ups = list(ups)
        self.proxy = EmbeddedProxy(Settings(**base), self.backends)
        await self.proxy.start()
        if publish:
            self.publish()
        self.session = aiohttp.ClientSession()
        return self.proxy

    def publish(self) -> None:
        self.backends.publish(tuple(Backend(str(i), "127.0.0.1", u.port, 1, 2) for i, u in enumerate(self.ups)))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.proxy.bound_port}"

    def client(self) -> openai.AsyncOpenAI:
        # max_retries=0: the SDK would retry 429/5xx itself and hide what the server answered.
        client = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)
        # Closed by the fixture on this loop: left to the garbage collector, its close runs
        # on a closed loop and logs an error inside whichever test happens to run then.
        self.clients.append(client)
        return client

    async def metrics(self) -> str:
        async with self.session.get(f"http://127.0.0.1:{self.proxy.metrics_port}/metrics") as r:
            return await r.text()


@pytest.fixture
async def h():
    harness = H()
    yield harness
    for client in harness.clients:
        await client.close()
    if harness.session:
        await harness.session.close()
    if harness.proxy:
        await harness.proxy.stop(grace_s=0.5)
    for u in harness.ups:
        await u.close()


async def fake(counts: bool = True) -> FakeTriton:
    return await FakeTriton(counts).start()


# --- the happy paths -----------------------------------------------------------------------------
async def test_models(h):
    await h.start(await fake(), openai_model_name="llama-demo")
    models = await h.client().models.list()
    assert [m.id for m in models.data] == ["llama-demo"]
    assert (await h.client().models.retrieve("llama-demo")).id == "llama-demo"
    with pytest.raises(openai.NotFoundError):
        await h.client().models.retrieve("other")


async def test_completion(h):
    await h.start(up := await fake())
    r = await h.client().completions.create(model="ensemble", prompt="hello", max_tokens=3, temperature=0.3)
    assert r.choices[0].text == " the of and" and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 3, 8)
    path, body = up.requests[-1]
    assert path == "/v2/models/ensemble/generate"
    assert body["text_input"] == "hello" and body["temperature"] == 0.3 and body["exclude_input_in_output"]


async def test_chat_renders_the_template_and_streams_with_usage(h):
    await h.start(up := await fake())
    stream = await h.client().chat.completions.create(
        model="ensemble", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True,
        stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == " the of and"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    path, body = up.requests[-1]
    assert path == "/v2/models/ensemble/generate_stream" and body["stream"] is True
    assert body["text_input"] == "<|user|>\nhi</s>\n<|assistant|>\n"  # demo/tokenizer's chat_template


async def test_stop_non_stream_and_stream(h):
    await h.start(up := await fake())
    c = h.client()
    r = await c.completions.create(model="ensemble", prompt="p", max_tokens=6, stop=[" STOP"])
    assert r.choices[0].text == " the of and" and r.choices[0].finish_reason == "stop"
    assert up.requests[-1][1]["stop_words"] == [" STOP"]  # the model stops early too
    stream = await c.chat.completions.create(model="ensemble", messages=[{"role": "user", "content": "x"}],
                                             max_tokens=6, stop="STO", stream=True)
    chunks = [ch async for ch in stream]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == " the of and "
    assert chunks[-1].choices[0].finish_reason == "stop"
    for _ in range(50):  # the stop ended our read: the instance sees the disconnect (a cancel)
        if up.cancelled:
            break
        await asyncio.sleep(0.02)
    assert up.cancelled == 1


async def test_finish_reason_stop_when_the_model_ends_early(h):
    await h.start(await fake())
    r = await h.client().completions.create(model="ensemble", prompt="p", max_tokens=50)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == len(WORDS)


async def test_usage_from_the_tokenizer_when_the_model_gives_none(h, tmp_path):
    pytest.importorskip("tokenizers")
    repo = tmp_path / "repo"
    shutil.copytree(DEMO_REPO / "preprocessing", repo / "preprocessing", symlinks=True)
    (repo / "ensemble").mkdir()
    (repo / "ensemble" / "config.pbtxt").write_text('name: "ensemble"\n')  # no return_num_* inputs
    await h.start(up := await fake(counts=False), model_repo=str(repo), tokenizer_dir=str(REPO / "demo" / "tokenizer"))
    r = await h.client().completions.create(model="ensemble", prompt="héllo", max_tokens=3)
    assert "return_num_output_tokens" not in up.requests[-1][1]
    # The twin's tokenizer encodes any text as its bytes (it only decodes word tokens): a
    # count from the tokenizer is the text re-encoded, not the tokens the model made.
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (6, len(" the of and"))
    stream = await h.client().completions.create(model="ensemble", prompt="ab", max_tokens=2, stream=True,
                                                  stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (2, len(" the of"))


# --- errors ------------------------------------------------------------------------------------------
async def test_errors_in_openai_shape(h):
    await h.start(await fake(), max_body_bytes=4096)
    c = h.client()
    with pytest.raises(openai.BadRequestError) as exc:
        await c.completions.create(model="ensemble", prompt="p", temperature=7)
    assert exc.value.param == "temperature" and exc.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as exc:
        await c.chat.completions.create(model="ensemble", messages=[{"role": "user", "content": "x"}], n=3)
    assert exc.value.param == "n"
    with pytest.raises(openai.NotFoundError) as exc:
        await c.completions.create(model="gpt-4", prompt="p")
    assert exc.value.code == "model_not_found" and "ensemble" in exc.value.message
    with pytest.raises(openai.APIStatusError) as exc:
        await c.completions.create(model="ensemble", prompt="x" * 10000)
    assert exc.value.status_code == 413 and exc.value.body["code"] == "request_too_large"
    async with h.session.post(h.url + "/v1/completions", data=b"{nope") as r:
        assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_json"
    async with h.session.get(h.url + "/v1/completions") as r:
        assert r.status == 405 and r.headers["Allow"] == "POST" and "error" in await r.json()
    async with h.session.post(h.url + "/v1/embeddings", json={}) as r:
        assert r.status == 404 and (await r.json())["error"]["type"] == "not_found_error"
    text = await h.metrics()
    assert 'trtllm_orch_proxy_openai_requests_total{api="openai.completions",code="400"} 2.0' in text
    assert 'trtllm_orch_proxy_openai_requests_total{api="openai.completions",code="413"} 1.0' in text


async def test_nothing_ready_is_503_and_hold_waits(h):
    await h.start(up := await fake(), publish=False, hold_s=0.0)
    with pytest.raises(openai.InternalServerError) as exc:
        await h.client().completions.create(model="ensemble", prompt="p", max_tokens=1)
    assert exc.value.status_code == 503 and exc.value.response.headers.get("Retry-After")
    assert exc.value.body["code"] == "no_instance_ready"
    h.proxy.apply_settings(Settings(**{**h.proxy._settings.__dict__, "hold_s": 5.0}))
    task = asyncio.ensure_future(h.client().completions.create(model="ensemble", prompt="p", max_tokens=1))
    await asyncio.sleep(0.3)
    assert not task.done()  # held, not refused
    h.publish()
    r = await asyncio.wait_for(task, 5)
    assert r.choices[0].text == " the" and len(up.requests) == 1


async def test_queue_full_is_retried_elsewhere(h):
    full, ok = await fake(), await fake()
    full.mode = "queue_full"
    await h.start(full, ok, lb_policy="round-robin")
    c = h.client()
    for stream in (False, True, False, True):
        if stream:
            s = await c.completions.create(model="ensemble", prompt="p", max_tokens=2, stream=True)
            assert "".join([x.choices[0].text async for x in s]) == " the of"
        else:
            r = await c.completions.create(model="ensemble", prompt="p", max_tokens=2)
            assert r.choices[0].text == " the of"
    assert len(ok.requests) == 4 and len(full.requests) >= 1
    ok.mode = "queue_full"
    with pytest.raises(openai.RateLimitError) as exc:  # every queue full: 429, come back later
        await c.completions.create(model="ensemble", prompt="p", max_tokens=2)
    assert exc.value.code == "queue_full" and exc.value.response.headers.get("Retry-After")
    assert not h.backends.failures  # a full queue is no failure of the instance


async def test_instance_dying_mid_answer_is_retried_elsewhere(h):
    """A plain answer is read whole and translated before the client sees a byte: an
    instance that dies inside it sends the request to another instance."""
    dying, ok = await fake(), await fake()
    dying.mode = "dies_mid_answer"
    await h.start(dying, ok, lb_policy="round-robin")
    c = h.client()
    for _ in range(4):
        r = await c.completions.create(model="ensemble", prompt="p", max_tokens=2)
        assert r.choices[0].text == " the of"
    assert len(ok.requests) == 4 and len(dying.requests) >= 1


async def test_model_errors(h):
    await h.start(up := await fake())
    up.mode = "error_first"  # before any token: a real status
    with pytest.raises(openai.InternalServerError) as exc:
        s = await h.client().completions.create(model="ensemble", prompt="p", max_tokens=4, stream=True)
        [x async for x in s]
    assert "model exploded" in exc.value.message
    up.mode = "error_mid"  # after tokens: an error event, which the SDK raises
    s = await h.client().completions.create(model="ensemble", prompt="p", max_tokens=4, stream=True)
    got = []
    with pytest.raises(openai.APIError, match="rank lost"):
        async for x in s:
            got.append(x.choices[0].text)
    assert "".join(got) == " the of"


async def test_silent_instance_hits_the_idle_timeout(h):
    await h.start(up := await fake(), idle_timeout_s=0.3)
    up.mode = "silent"
    with pytest.raises(openai.APIStatusError) as exc:
        s = await h.client().completions.create(model="ensemble", prompt="p", max_tokens=2, stream=True)
        [x async for x in s]
    assert exc.value.status_code == 504


async def test_openai_off_and_admin_still_blocked(h):
    await h.start(await fake(), openai="off")
    async with h.session.get(h.url + "/v1/models") as r:
        assert r.status == 404
    async with h.session.post(h.url + "/v2/repository/index") as r:
        assert r.status == 403


async def test_ttft_metrics_by_api(h):
    await h.start(await fake())
    await h.client().chat.completions.create(model="ensemble", messages=[{"role": "user", "content": "x"}],
                                             max_tokens=2)
    s = await h.client().completions.create(model="ensemble", prompt="p", max_tokens=3, stream=True)
    [x async for x in s]
    text = await h.metrics()
    assert 'time_to_first_token_seconds_count{api="openai.chat.completions",instance="0"} 1.0' in text
    assert 'output_events_total{api="openai.completions",instance="0"} 3.0' in text
    assert 'trtllm_orch_proxy_requests_total{code="200",instance="0"} 2.0' in text


async def test_prefix_affinity_routes_on_the_rendered_prompt(h):
    a, b = await fake(), await fake()
    await h.start(a, b, lb_policy="prefix-affinity")
    system = "You are the assistant of tenant one. " * 40  # many prefix chunks, shared by every request
    for i in range(6):
        await h.client().chat.completions.create(model="ensemble", max_tokens=1, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": f"question {i}"}])
    assert sorted((len(a.requests), len(b.requests))) == [0, 6]  # one instance holds the prefix


async def test_long_conversation(h):
    await h.start(up := await fake())
    long = "word " * 20000  # over BIG_BODY: parsed and rendered in a worker thread
    r = await h.client().chat.completions.create(model="ensemble", max_tokens=1,
                                                 messages=[{"role": "user", "content": long}])
    assert r.choices[0].message.content == " the"
    assert up.requests[-1][1]["text_input"] == f"<|user|>\n{long}</s>\n<|assistant|>\n"


async def test_reload_rereads_the_model_facts(h, tmp_path):
    await h.start(up := await fake())
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}|{% endfor %}")
    settings = Settings(**{**h.proxy._settings.__dict__, "openai_model_name": "renamed",
                           "chat_template": str(template)})
    h.proxy.apply_settings(settings)
    for _ in range(100):  # re-read in a worker thread, off the event loop
        if [m.id for m in (await h.client().models.list()).data] == ["renamed"]:
            break
        await asyncio.sleep(0.02)
    await h.client().chat.completions.create(model="renamed", messages=[{"role": "user", "content": "q"}],
                                             max_tokens=1)
    assert up.requests[-1][1]["text_input"] == "q|"
    template.write_text("{% for %}")  # a broken template on reload keeps the previous facts
    h.proxy.apply_settings(Settings(**{**settings.__dict__, "openai_model_name": "again"}))
    await asyncio.sleep(0.3)
    assert [m.id for m in (await h.client().models.list()).data] == ["renamed"]


# --- the loopback listener NGINX forwards /v1/ to -----------------------------------------------------
async def test_a_stream_that_a_stop_finds_on_a_kept_connection_then_its_next_request(h):
    # A chat stream whose head went out (kept alive) before the stop ends, and the client's next
    # request on that connection is answered, its head saying Connection: close, and then the
    # connection closes. Closed right after the first stream (the head had said keep-alive), the
    # next request failed with a broken pipe; answered with a head that did not say close, the
    # one after it did (bench/chaos_soak.py's chat clients at a reload that stopped a worker).
    await h.start(await FakeTriton().start(), front="aiohttp")
    body = json.dumps({"model": "ensemble", "messages": [{"role": "user", "content": "x"}], "max_tokens": 6,
                       "stream": True}).encode()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n" % len(body)) + body
    reader, writer = await asyncio.open_connection("127.0.0.1", h.proxy.bound_port)
    try:
        writer.write(request)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200") and b"Connection: close" not in head, head
        stopping = asyncio.create_task(h.proxy.stop(grace_s=3.0))
        first = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 5)
        assert b"data: [DONE]" in first
        writer.write(request)  # at once, as a client in a loop does
        second = await asyncio.wait_for(reader.read(), 5)  # to EOF: answered, then closed
        head2, _, rest = second.partition(b"\r\n\r\n")
        assert head2.startswith(b"HTTP/1.1 200") and b"\r\nConnection: close" in head2, second[:300]
        assert b"data: [DONE]" in rest
        await stopping
    finally:
        h.proxy = None  # stopped above
        writer.close()


async def test_side_workers_of_proxy_none_serve_only_v1():
    """What a side worker runs (controlplane/side_workers.py): the loopback proxy in front trusted,
    no gRPC or /metrics of its own, aiohttp's front; --proxy none's serve /v1/ alone."""
    up = await fake()
    backends = RecordingBackends()
    s = side_settings(Settings(listen="127.0.0.1:0", openai_listen="127.0.0.1:0", model_repo=str(DEMO_REPO),
                                 grpc_listen="127.0.0.1:0", metrics_listen="127.0.0.1:0", proxy="none",
                                 trusted_proxy=("10.0.0.1",)))
    assert (s.grpc_listen, s.metrics_listen, s.front) == ("", "", "aiohttp")
    assert s.trusted_proxy == ("10.0.0.1", "127.0.0.1", "::1")
    assert serves_openai_only(s) and not serves_openai_only(side_settings(Settings(proxy="nginx")))
    proxy = EmbeddedProxy(s, backends, openai_only=serves_openai_only(s))  # as dataplane/worker.py decides
    await proxy.start()
    try:
        backends.publish((Backend("0", "127.0.0.1", up.port, 1, 2),))
        url = f"http://127.0.0.1:{proxy.bound_port}"
        async with aiohttp.ClientSession() as session:
            native = {"text_input": "x", "max_tokens": 1}
            async with session.post(url + "/v2/models/ensemble/generate", json=native) as r:
                assert r.status == 404  # the system nginx serves the native API itself
            async with session.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1},
                                    headers={"X-Forwarded-For": "203.0.113.9"}) as r:
                assert r.status == 200 and (await r.json())["choices"][0]["text"] == " the"
        assert up.requests and proxy.inflight() == {"0": 0}
    finally:
        await proxy.stop(0.5)
        await up.close()
