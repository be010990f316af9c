"""The OpenAI-compatible API of a proxy: /v1/models, /v1/completions, /v1/chat/completions.

A request is read with the proxy's own body limit and deadline, validated and
translated (openai_api.py), then handed to the proxy's forward path as a native
`generate` call on the served model (`generate_stream` for "stream": true): the same
hold while nothing is ready, routing policy, retries before the first byte, passive
health and metrics as any other request. Only the relay differs: the native answer
is translated back as it arrives.

A stream commits (sends its 200) at the model's first event, not at Triton's
headers: an error in that first event is still answered with a real status, and a
full queue (TRT-LLM's "Maximum queue size ... reached") is retried on another
instance, as for the native API's plain answers. After that an error becomes one
SSE event in OpenAI's error shape, then `data: [DONE]`.

The embedded proxy owns one frontend (start, apply_settings, stop in its own
order); `--proxy nginx` runs an OpenAI-only embedded proxy on loopback that NGINX
forwards /v1/ to (nginx.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any
from urllib.parse import quote, unquote

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client import Counter

from orchestrator.config import Settings
from orchestrator.routing.backends import Backend
from orchestrator.dataplane.metrics import ProxyMetrics
from orchestrator.dataplane.openai_api import (CHAT, COMPLETIONS, QUEUE_FULL_TEXT, GenRequest, OpenAIError, SSEReader,
                                              Translation, decode_json, error_body, model_body, models_body,
                                              native_body, native_error, parse_request, stream_error)
from orchestrator.dataplane.openai_model import ModelFacts, load_model_facts
from orchestrator.routing.surface import (METHOD_NOT_ALLOWED, OPENAI, OPENAI_CHAT, OPENAI_COMPLETIONS, OPENAI_MODEL,
                                          OPENAI_MODELS, Route)
from orchestrator.tasks import cancel_and_wait

_JSON = "application/json"
_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no"}  # tell NGINX in front not to buffer the stream
_ENDPOINTS = {OPENAI_COMPLETIONS: COMPLETIONS, OPENAI_CHAT: CHAT}
BIG_BODY = 64 * 1024  # request bodies above this are translated in a worker thread
# The client's own request headers that must not reach Triton with our translated body:
# its encoding (we parse what comes back), its API key (meant for us), its body's type.
_DROP_UPSTREAM = ("Accept-Encoding", "Authorization", "Content-Encoding", "Content-Type")

Relay = Callable[..., Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class ProxyPath:
    """What the frontend uses of its proxy, so both share one forward path."""

    read_body: Callable[[web.BaseRequest], Awaitable["bytes | web.Response"]]
    # forward(request, path, query, stream, call) -> the response (a NativeCall's relay's, or an error)
    forward: Callable[..., Awaitable[web.StreamResponse]]
    settle: Callable[[Backend, int], None]  # passive health and routing feedback for an answer
    fail: Callable[[Backend, str], None]  # an upstream failure that counts against the instance
    retry: Callable[..., Exception]  # retry(reason, blame=False): raise it before the first byte
    metrics: ProxyMetrics
    # whether the proxy stops: a stream committed now says Connection: close (the connection
    # closes after it; a head that said keep-alive would send the client's next request to it)
    stopping: Callable[[], bool]


@dataclass
class NativeCall:
    """A translated request for the proxy's forward path."""

    body: bytes
    api: str
    prompt: str  # what the model reads (chat: rendered), for routing on its prefix
    timer: Any  # the proxy metrics' TokenTimer for this request, or None
    relay: Relay  # relay(request, upstream response, backend, peeked, timer)

    @staticmethod
    def headers(headers: CIMultiDict[str]) -> None:
        for name in _DROP_UPSTREAM:
            headers.popall(name, None)
        headers["Content-Type"] = _JSON


def _facts_args(s: Settings) -> dict[str, str]:
    triton_model = s.openai_model or s.served_model
    return {"model_repo": s.model_repo, "triton_model": triton_model,
            "served_name": s.openai_model_name or triton_model, "chat_template": s.chat_template,
            "tokenizer_dir": s.tokenizer_dir}


class _Answer(web.Response):
    """A response already in OpenAI's shape (anything else from the forward path is translated)."""


def _openai_response(status: int, body: bytes, headers: dict[str, str] | None = None) -> web.Response:
    return _Answer(status=status, body=body, content_type=_JSON, headers=headers)


def _error(exc: OpenAIError, headers: dict[str, str] | None = None) -> web.Response:
    return _openai_response(exc.status, exc.body(), headers)


class OpenAIFrontend:
    def __init__(self, settings: Settings, path: ProxyPath, logger: logging.Logger | None = None) -> None:
        self._path = path
        self._metrics = path.metrics
        self._log = logger or logging.getLogger("trtllm-orch.proxy.openai")
        self._settings = settings
        self._facts: ModelFacts | None = None
        self._created = int(time.time())
        self._reload_task: asyncio.Task[None] | None = None
        self._reload_wanted = False
        # Requests by OpenAI endpoint and status, beside the proxy's per-instance counts.
        self._requests = Counter("trtllm_orch_proxy_openai_requests", "OpenAI API requests answered, by "
                                 "endpoint (api) and HTTP status", ("api", "code"), registry=self._metrics.registry)
        self._req_children: dict[tuple[str, int], Any] = {}

    # --- lifecycle (owned by the proxy) --------------------------------------------------
    async def start(self) -> None:
        """Read the model's facts (a thread: file reads, template compile); OrchError if unusable."""
        self._facts = await asyncio.to_thread(partial(load_model_facts, **_facts_args(self._settings)))
        self._log_facts(self._facts)

    def apply_settings(self, settings: Settings) -> None:
        old, self._settings = self._settings, settings
        if _facts_args(old) == _facts_args(settings):
            return
        # Reloads run one at a time; one asked for during a reload runs after it with the latest settings.
        self._reload_wanted = True
        if self._reload_task is None or self._reload_task.done():
            self._reload_task = asyncio.get_running_loop().create_task(self._reload_loop(), name="openai-facts")

    async def stop(self) -> None:
        task, self._reload_task = self._reload_task, None
        await cancel_and_wait(task)

    async def _reload_loop(self) -> None:
        while self._reload_wanted:
            self._reload_wanted = False
            try:
                facts = await asyncio.to_thread(partial(load_model_facts, **_facts_args(self._settings)))
            except Exception as exc:  # a bad new template keeps the old facts; never kills the daemon
                self._log.error("openai: reload keeps the previous model settings: %s", exc)
                continue
            self._facts = facts
            self._log_facts(facts)

    def _log_facts(self, f: ModelFacts) -> None:
        usage = "from the model" if f.counts else "from the tokenizer" if f.count_tokens else "not available"
        chat = f"template {f.template.origin}" if f.template else "off (no chat template)"
        self._log.info("openai: /v1 serves %r (Triton model %r); usage %s; chat %s", f.served_name,
                       f.triton_model, usage, chat)

    # --- requests -------------------------------------------------------------------------
    def _count(self, api: str, code: int) -> None:
        key = (api, code)
        c = self._req_children.get(key)
        if c is None:
            c = self._req_children[key] = self._requests.labels(api, str(code))
        c.inc()

    async def handle(self, request: web.BaseRequest, route: Route) -> web.StreamResponse:
        """Answer one /v1 request, whatever its route (unknown paths too: 404 in OpenAI's shape)."""
        api = route.api
        try:
            if route.kind is OPENAI:
                resp = await self._handle(request, api, route.path)
            elif route.kind is METHOD_NOT_ALLOWED:
                resp = _error(OpenAIError(405, f"method {request.method} not allowed here (use {route.allow})",
                                          code="method_not_allowed"), {"Allow": route.allow})
            else:
                resp = _error(OpenAIError(404, f"unknown endpoint {route.path}", code="unknown_url"))
        except OpenAIError as exc:
            resp = _error(exc)
        if not resp.prepared and isinstance(resp, web.Response) and not isinstance(resp, _Answer):
            resp = self._translate_error(resp)
        self._count(api, resp.status)
        return resp

    async def _handle(self, request: web.BaseRequest, api: str, path: str) -> web.StreamResponse:
        facts = self._facts
        if facts is None:
            raise OpenAIError(503, "the OpenAI API is starting", code="starting")
        if api == OPENAI_MODELS:
            return _openai_response(200, models_body([facts.served_name], self._created))
        if api == OPENAI_MODEL:
            name = "/".join(unquote(s) for s in path.split("/")[3:])
            if name != facts.served_name:
                raise OpenAIError(404, f"The model {name!r} does not exist", param="model", code="model_not_found")
            return _openai_response(200, model_body(name, self._created))
        endpoint = _ENDPOINTS[api]
        # The clock starts with the request in hand, as the native API's (translation included).
        timer = self._metrics.timer(api)
        body = await self._path.read_body(request)
        if not isinstance(body, bytes):
            return body  # 413, 408, 400 in the proxy's shape: translated by handle()
        translate = partial(_translate, endpoint, body, facts, self._settings.openai_max_tokens)
        # Tens of microseconds for a usual request; a long conversation takes milliseconds to
        # parse and render: those go to a thread so the loop keeps relaying other streams.
        req, prompt, native_req = await asyncio.to_thread(translate) if len(body) > BIG_BODY else translate()
        tr = Translation(req, facts.served_name, prompt, keep_text=not facts.counts and facts.count_tokens is not None)
        relay = self._relay_stream if req.stream else self._relay_whole
        call = NativeCall(body=native_req, api=api, prompt=prompt, timer=timer, relay=partial(relay, tr, facts, prompt))
        native = f"/v2/models/{quote(facts.triton_model, safe='')}/{'generate_stream' if req.stream else 'generate'}"
        return await self._path.forward(request, native, "", req.stream, call)

    def _translate_error(self, resp: web.Response) -> web.Response:
        """An answer of the proxy itself ({"error": "..."}: 413, 503 nothing ready...) in OpenAI's shape."""
        status = resp.status
        raw = resp.body if isinstance(resp.body, (bytes, bytearray)) else b""
        message = native_error(bytes(raw)) if raw else (resp.reason or "error")
        code = {413: "request_too_large", 408: "request_timeout", 503: "no_instance_ready",
                502: "upstream_failed", 504: "upstream_timeout"}.get(status)
        if status == 502 and "queue_full" in message:
            # Every instance tried had a full queue: the client should come back later.
            status, code, message = 429, "queue_full", "every instance's queue is full; retry later"
        headers = {k: v for k, v in resp.headers.items() if k.lower() == "retry-after"}
        if status == 429 and not headers:
            headers["Retry-After"] = "1"
        out = _openai_response(status, error_body(status, message, code=code), headers)
        if not resp.keep_alive and resp.keep_alive is not None:
            out.force_close()
        return out

    async def _count_with_tokenizer(self, tr: Translation, facts: ModelFacts, prompt: str) -> None:
        if tr.counted or facts.count_tokens is None:
            return
        count = facts.count_tokens
        # A long prompt costs milliseconds to tokenize: never on the event loop.
        n_in, n_out = await asyncio.to_thread(lambda: (count(prompt), count(tr.text())))
        tr.set_counts(n_in, n_out)

    # --- relays (called by the proxy's forward path with the instance's response) ---------------
    async def _relay_whole(self, tr: Translation, facts: ModelFacts, prompt: str, request: web.BaseRequest,
                           up: aiohttp.ClientResponse, b: Backend, peeked: Any, timer: Any) -> web.StreamResponse:
        """A plain `generate` answer (or any error answer): read whole, translate."""
        iid = b.instance_id
        status = up.status
        clean = False
        try:
            try:
                data = _whole(peeked)
                if data is None:
                    data = await up.read()
            except aiohttp.ClientError as exc:
                # Nothing reached the client yet: another instance gets the request (as a
                # connection dropped before the head).
                up.close()
                raise self._path.retry("disconnected") from exc
            except asyncio.TimeoutError as exc:
                self._path.fail(b, "idle_timeout")
                self._metrics.count(iid, 502)
                self._log.debug("instance %s: body failed: %r", iid, exc)
                return _error(OpenAIError(502, "instance dropped the connection mid-response"))
            clean = True
            self._path.settle(b, status)
            self._metrics.count(iid, status)
            if status != 200:
                # Triton's error ({"error": "..."}): the model refused the request (4xx) or failed (5xx).
                return _error(OpenAIError(status, native_error(data), code="model_error"))
            try:
                doc = json.loads(data)
            except (ValueError, UnicodeDecodeError):
                doc = None
            if not isinstance(doc, dict) or tr.req.stream:  # (a stream answered without SSE: not Triton)
                return _error(OpenAIError(502, "instance sent an invalid generate response"))
            tr.whole(doc)
            await self._count_with_tokenizer(tr, facts, prompt)
            if timer is not None:
                timer.events(iid)
            return _openai_response(200, tr.body())
        finally:
            if clean:
                up.release()
            else:
                up.close()

    async def _relay_stream(self, tr: Translation, facts: ModelFacts, prompt: str, request: web.BaseRequest,
                            up: aiohttp.ClientResponse, b: Backend, peeked: Any, timer: Any) -> web.StreamResponse:
        """`generate_stream` events -> OpenAI chunks, committed at the first event.

        Long on purpose: the per-event loop (decode, translate, write, time the token) runs
        for every token of every OpenAI stream; its state stays in locals, not in a helper
        object each event would go through."""
        if up.status != 200 or not up.headers.get("Content-Type", "").startswith("text/event-stream"):
            return await self._relay_whole(tr, facts, prompt, request, up, b, peeked, timer)
        iid = b.instance_id
        self._path.settle(b, 200)
        reader = SSEReader()
        resp: web.StreamResponse | None = None
        clean = False
        content = up.content
        try:
            while not tr.done:
                try:
                    chunk = await content.readany()
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    reason = "idle_timeout" if isinstance(exc, asyncio.TimeoutError) else "body_error"
                    self._path.fail(b, reason)
                    self._log.warning("instance %s: stream cut (%s)", iid, reason)
                    if resp is None:
                        status = 504 if reason == "idle_timeout" else 502
                        self._metrics.count(iid, status)
                        return _error(OpenAIError(status, f"instance stream failed ({reason})"))
                    await _write(resp, stream_error(f"instance stream failed ({reason})"))
                    return resp
                payloads = reader.feed(chunk) if chunk else reader.rest()
                out: list[bytes] = []
                events = 0
                for payload in payloads:
                    try:
                        doc = json.loads(payload)
                    except (ValueError, UnicodeDecodeError):
                        continue
                    if not isinstance(doc, dict):
                        continue
                    err = doc.get("error")
                    if err is not None:
                        message = str(err)
                        if resp is None and not out:
                            if QUEUE_FULL_TEXT in message:
                                up.close()
                                raise self._path.retry("queue_full", blame=False)
                            self._metrics.count(iid, 500)
                            return _error(OpenAIError(500, message, code="model_error"))
                        out.append(stream_error(message))
                        return await self._send(request, resp, out, iid) or _gone()
                    ev = tr.event(doc)
                    if ev:
                        out.append(ev)
                        events += 1
                    if tr.done:
                        break  # a stop string matched: returning closes `up`, which cancels the generation
                if out:
                    resp = await self._send(request, resp, out, iid)
                    if resp is None:
                        return _gone()
                    if timer is not None:
                        timer.events(iid, events)
                if not chunk:
                    clean = True
                    break
            await self._count_with_tokenizer(tr, facts, prompt)
            first = resp is None
            resp = await self._send(request, resp, [tr.end()], iid)
            if resp is None:
                return _gone()
            if first and timer is not None:
                timer.events(iid)  # nothing was generated: the end is the first event
            try:
                await resp.write_eof()
            except ConnectionError:
                pass
            return resp
        except _ClientGone as gone:
            return gone.resp
        finally:
            if clean:
                up.release()
            else:
                up.close()  # the instance sees the disconnect and cancels the generation

    async def _send(self, request: web.BaseRequest, resp: web.StreamResponse | None, out: list[bytes],
                    iid: str) -> web.StreamResponse | None:
        """Write chunks, committing the stream first if needed; None if the client left before it."""
        if resp is None:
            resp = web.StreamResponse(status=200, headers=_SSE_HEADERS)
            if self._path.stopping():
                resp.force_close()
            self._metrics.count(iid, 200)
            try:
                await resp.prepare(request)
            except ConnectionError:
                return None
        if not await _write(resp, b"".join(out)):
            self._log.debug("client %s left mid-stream (instance %s)", request.remote, iid)
            raise _ClientGone(resp)
        return resp


def _translate(endpoint: str, body: bytes, facts: ModelFacts, chat_max_tokens: int) -> tuple[GenRequest, str, bytes]:
    """An OpenAI request body -> (the request, the prompt, the native body); OpenAIError if refused."""
    req = parse_request(endpoint, decode_json(body), chat_max_tokens)
    if req.model is not None and req.model != facts.served_name:
        raise OpenAIError(404, f"The model {req.model!r} does not exist (this server serves "
                          f"{facts.served_name!r}; see /v1/models)", param="model", code="model_not_found")
    if endpoint == CHAT:
        if facts.template is None:
            raise OpenAIError(400, facts.no_template_why, param="messages", code="no_chat_template")
        assert req.messages is not None
        prompt = facts.template.render(req.messages)
    else:
        assert req.prompt is not None
        prompt = req.prompt
    return req, prompt, native_body(req, prompt, facts.counts)


def _whole(peeked: Any) -> bytes | None:
    """The error body the forward path already read, if it read all of it: (bytes, whole),
    or bytes (the proxy's older peek, which read only whole bodies)."""
    if isinstance(peeked, (bytes, bytearray)):
        return bytes(peeked)
    if peeked is not None and peeked[1]:
        return peeked[0]
    return None


def _gone() -> web.Response:
    # For a client that left before its stream began (nginx's 499): nothing reaches it;
    # the status only shows in the metrics.
    return web.Response(status=499)


class _ClientGone(Exception):
    def __init__(self, resp: web.StreamResponse) -> None:
        super().__init__("client disconnected")
        self.resp = resp


async def _write(resp: web.StreamResponse, data: bytes) -> bool:
    try:
        await resp.write(data)
    except ConnectionError:
        return False
    return True
