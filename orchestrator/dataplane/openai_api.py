"""OpenAI's API <-> TRT-LLM's `generate` / `generate_stream`: the translation, as pure functions.

No I/O and no event loop here: validation of an OpenAI request (a 400 that names the
field), the native request body for the served model (the `ensemble` and
`tensorrt_llm_bls` take the same tensors: `text_input`, `max_tokens`, `stop_words`,
sampling knobs, `return_num_input_tokens`/`return_num_output_tokens`), and the OpenAI
bodies and SSE chunks built from the native answers. openai_frontend.py owns the
sockets and reuses the proxy's forward path (hold, routing, retries).

Semantics worth knowing:
- `stop` strings go to the model as `stop_words` (it stops early, saving work) AND are
  matched on the text here: TRT-LLM matches token sequences, which miss a stop string
  that the tokenizer splits differently, and it keeps the stop word in its output,
  which OpenAI does not. Streamed text that could be the start of a stop string is
  held back until it is known not to be one.
- `finish_reason`: "stop" when a stop string matched or the model ended before
  `max_tokens` (end id or stop word), "length" when it produced `max_tokens` tokens.
- `usage`: the model's own counts when it returns them (`num_input_tokens`,
  `num_output_tokens`; per response in a stream, so they are summed), else whatever
  the caller counts with the tokenizer (`Translation.set_counts`).
"""

from __future__ import annotations

import csv
import io
import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

COMPLETIONS = "completions"
CHAT = "chat.completions"
MODELS = "models"

# OpenAI's default for /v1/completions; chat has none (up to the context), see Settings.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# Native input names, identical for the ensemble and tensorrt_llm_bls.
PROMPT_INPUT = "text_input"
DONE = b"data: [DONE]\n\n"
_SEP = (",", ":")
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
# TRT-LLM's executor rejects beyond max_queue_size with this text (see trtllm-facts.md).
QUEUE_FULL_TEXT = "Maximum queue size of"


class OpenAIError(Exception):
    """An answer in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 err_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.err_type = err_type or error_type(status)

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.param, self.code, self.err_type)


def error_type(status: int) -> str:
    # The `type` values OpenAI's own API uses for these statuses.
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_body(status: int, message: str, param: str | None = None, code: str | None = None,
               err_type: str | None = None) -> bytes:
    return _dumps({"error": {"message": message, "type": err_type or error_type(status), "param": param,
                             "code": code}})


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=_SEP, ensure_ascii=False).encode()


# --- requests ----------------------------------------------------------------------------
@dataclass
class GenRequest:
    """A validated /v1/completions or /v1/chat/completions request."""

    endpoint: str  # COMPLETIONS or CHAT
    model: str | None
    prompt: str | None  # completions; chat: rendered from messages by the caller
    messages: list[dict[str, Any]] | None
    stream: bool
    include_usage: bool
    max_tokens: int
    stop: tuple[str, ...]
    echo: bool
    sampling: dict[str, Any] = field(default_factory=dict)  # native input name -> value


def _bad(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, param=param, code="invalid_value")


def _get(doc: dict[str, Any], name: str) -> Any:
    # Clients send null for "not set" (the openai SDK omits it, others do not).
    return doc.get(name)


def _int(doc: dict[str, Any], name: str, lo: int, hi: int | None = None) -> int | None:
    v = _get(doc, name)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        rng = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
        raise _bad(name, f"'{name}' must be an integer {rng}, got {v!r}")
    return v


def _num(doc: dict[str, Any], name: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    v = _get(doc, name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v > hi or v < lo or (lo_open and v == lo):
        low = f"greater than {lo}" if lo_open else f"at least {lo}"
        raise _bad(name, f"'{name}' must be a number {low} and at most {hi}, got {v!r}")
    return float(v)


def _bool(doc: dict[str, Any], name: str) -> bool:
    v = _get(doc, name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad(name, f"'{name}' must be true or false, got {v!r}")
    return v


def _unsupported(doc: dict[str, Any], name: str, allowed: Iterable[Any] = (), what: str = "") -> None:
    v = _get(doc, name)
    if v is None or v in allowed or v == {} or v == []:
        return
    raise OpenAIError(400, f"'{name}' is not supported by this server{what}", param=name,
                      code="unsupported_parameter")


def decode_json(body: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError) as exc:
        raise OpenAIError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(doc, dict):
        raise OpenAIError(400, "request body must be a JSON object", code="invalid_json")
    return doc


def _stop(doc: dict[str, Any]) -> tuple[str, ...]:
    v = _get(doc, "stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise _bad("stop", "'stop' must be a string or a list of strings")
    return tuple(dict.fromkeys(s for s in items if s))  # "" would stop at once: OpenAI ignores it


def _sampling(doc: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    checks = (
        ("temperature", _num(doc, "temperature", 0.0, 2.0)),
        ("top_p", _num(doc, "top_p", 0.0, 1.0, lo_open=True)),
        ("top_k", _int(doc, "top_k", 0)),  # an extension (vLLM, TRT-LLM): 0 = off
        ("presence_penalty", _num(doc, "presence_penalty", -2.0, 2.0)),
        ("frequency_penalty", _num(doc, "frequency_penalty", -2.0, 2.0)),
        ("repetition_penalty", _num(doc, "repetition_penalty", 0.0, 10.0, lo_open=True)),  # extension
        ("min_tokens", _int(doc, "min_tokens", 0)),  # extension
        ("seed", _int(doc, "seed", 0, (1 << 64) - 1)),  # the model's seed is a uint64
    )
    for name, value in checks:
        if value is not None:
            out[name] = value
    if _bool(doc, "ignore_eos"):  # extension, used by benchmark clients: never stop at the end id
        out["end_id"] = -1
    return out


def parse_request(endpoint: str, doc: dict[str, Any], chat_default_max_tokens: int) -> GenRequest:
    """Validate an OpenAI request body (already a JSON object); OpenAIError(400) names the field."""
    model = _get(doc, "model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", "'model' must be a string")
    n = _int(doc, "n", 1)
    if n is not None and n != 1:
        raise OpenAIError(400, "'n' must be 1: this server returns one choice per request "
                          "(send n requests instead)", param="n", code="unsupported_value")
    stream = _bool(doc, "stream")
    opts = _get(doc, "stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise _bad("stream_options", "'stream_options' must be an object")
        if not stream:
            raise _bad("stream_options", "'stream_options' is only allowed when 'stream' is true")
        include_usage = _bool(opts, "include_usage")
    _unsupported(doc, "logit_bias")
    _unsupported(doc, "logprobs", allowed=(False, 0))
    _unsupported(doc, "top_logprobs", allowed=(0,))
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    echo = False
    if endpoint == COMPLETIONS:
        prompt = _prompt(doc)
        _unsupported(doc, "suffix", allowed=("",))
        _unsupported(doc, "best_of", allowed=(1,))
        echo = _bool(doc, "echo")
        max_tokens = _int(doc, "max_tokens", 1)
        if max_tokens is None:
            max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    else:
        messages = _messages(doc)
        _unsupported(doc, "tools", what=" (no tool calling)")
        _unsupported(doc, "functions", what=" (no tool calling)")
        _unsupported(doc, "tool_choice", allowed=("none",), what=" (no tool calling)")
        fmt = _get(doc, "response_format")
        if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
            raise OpenAIError(400, "'response_format' other than {\"type\": \"text\"} is not supported "
                              "by this server", param="response_format", code="unsupported_parameter")
        # max_completion_tokens replaced max_tokens in OpenAI's chat API; either is accepted.
        max_tokens = _int(doc, "max_completion_tokens", 1)
        if max_tokens is None:
            max_tokens = _int(doc, "max_tokens", 1)
        if max_tokens is None:
            max_tokens = chat_default_max_tokens
    # The native max_tokens is an int32.
    if max_tokens > (1 << 31) - 1:
        raise _bad("max_tokens", "'max_tokens' is too large")
    return GenRequest(endpoint=endpoint, model=model, prompt=prompt, messages=messages, stream=stream,
                      include_usage=include_usage, max_tokens=max_tokens, stop=_stop(doc), echo=echo,
                      sampling=_sampling(doc))


def _prompt(doc: dict[str, Any]) -> str:
    v = _get(doc, "prompt")
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str):
        v = v[0]  # a batch of one
    if isinstance(v, str):
        return v
    if v is None:
        raise OpenAIError(400, "'prompt' is required", param="prompt", code="missing_required_parameter")
    if isinstance(v, list) and v and all(isinstance(p, str) for p in v):
        raise OpenAIError(400, "'prompt' must be one string: batched prompts are not supported "
                          "(send one request per prompt)", param="prompt", code="unsupported_value")
    raise _bad("prompt", "'prompt' must be a string (token-id prompts are not supported: "
                         "the model takes text)")


def _content_text(content: Any, i: int) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise OpenAIError(400, f"messages[{i}].content: only text parts are supported, got {kind!r}",
                                  param=f"messages[{i}].content", code="unsupported_value")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"messages[{i}].content", f"messages[{i}].content must be a string or a list of text parts")


def _messages(doc: dict[str, Any]) -> list[dict[str, Any]]:
    v = _get(doc, "messages")
    if v is None:
        raise OpenAIError(400, "'messages' is required", param="messages", code="missing_required_parameter")
    if not isinstance(v, list) or not v:
        raise _bad("messages", "'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", f"messages[{i}] must be an object")
        role = m.get("role")
        if role not in _ROLES:
            raise _bad(f"messages[{i}].role", f"messages[{i}].role must be one of "
                       f"{', '.join(sorted(_ROLES))}, got {role!r}")
        msg = dict(m)  # the template may read other keys (name, tool_call_id)
        msg["content"] = _content_text(m.get("content"), i)
        if msg["content"] is None and role != "assistant":
            raise OpenAIError(400, f"messages[{i}].content is required", param=f"messages[{i}].content",
                              code="missing_required_parameter")
        out.append(msg)
    return out


def _csv_field(word: str) -> str:
    # TRT-LLM's preprocessing reads each stop_words entry as a CSV line of words, so a
    # stop string holding a comma or a quote must be quoted to stay one word.
    buf = io.StringIO()
    # The default line terminator, cut off after: with it the writer also quotes newlines.
    csv.writer(buf).writerow([word])
    return buf.getvalue()[:-2]


def native_body(req: GenRequest, prompt: str, counts: bool) -> bytes:
    """The `generate` / `generate_stream` body for the served model.

    counts: the model takes `return_num_input_tokens`/`return_num_output_tokens`
    (a model without those inputs would reject them).
    """
    body: dict[str, Any] = {
        PROMPT_INPUT: prompt,
        "max_tokens": req.max_tokens,
        "stream": req.stream,
        # TRT-LLM's default is to echo the prompt; OpenAI answers only the new text.
        "exclude_input_in_output": True,
    }
    if req.stop:
        body["stop_words"] = [_csv_field(s) for s in req.stop]
    if counts:
        body["return_num_input_tokens"] = True
        body["return_num_output_tokens"] = True
    body.update(req.sampling)
    return _dumps(body)


# --- native answers ------------------------------------------------------------------------
class SSEReader:
    """The `data:` payloads of a server-sent-event byte stream, however it is chunked."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        buf = self._buf + chunk if self._buf else chunk
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        events = buf.split(b"\n\n")
        self._buf = events.pop()
        out = []
        for ev in events:
            data = [line[5:].lstrip(b" ") for line in ev.split(b"\n") if line.startswith(b"data:")]
            if data:
                out.append(b"\n".join(data))
        return out

    def rest(self) -> list[bytes]:
        """An event the stream ended without terminating."""
        buf, self._buf = self._buf, b""
        return self.feed(buf + b"\n\n") if buf.strip() else []


def native_text(doc: dict[str, Any]) -> str:
    v = doc.get("text_output")
    if isinstance(v, list):  # a [1] string tensor may come as a list
        return "".join(x for x in v if isinstance(x, str))
    return v if isinstance(v, str) else ""


def native_count(doc: dict[str, Any], name: str) -> int | None:
    v = doc.get(name)
    if isinstance(v, list) and v:
        v = v[0]
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def native_error(data: bytes) -> str:
    """The message of a Triton error answer ({"error": "..."}), or the raw text."""
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return data.decode(errors="replace")[:2000]
    if isinstance(doc, dict) and isinstance(doc.get("error"), str):
        return doc["error"]
    return data.decode(errors="replace")[:2000]


class StopText:
    """Finds the first stop string in a text that arrives in pieces.

    feed() returns the text that is safe to send: everything before a matched stop
    string, or everything except a tail that could still become one.
    """

    __slots__ = ("stops", "_held", "matched")

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self._held = ""
        self.matched = False

    def feed(self, text: str) -> str:
        buf = self._held + text
        first = -1
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (first < 0 or i < first):
                first = i
        if first >= 0:
            self.matched = True
            self._held = ""
            return buf[:first]
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep] if keep else buf

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finish_reason(stopped_by_text: bool, completion_tokens: int | None, max_tokens: int) -> str:
    if stopped_by_text:
        return "stop"
    if completion_tokens is None:
        return "stop"  # nothing says it was cut; a model that ends on its own is the common case
    return "length" if completion_tokens >= max_tokens else "stop"


def new_id(endpoint: str) -> str:
    return ("chatcmpl-" if endpoint == CHAT else "cmpl-") + os.urandom(12).hex()


class Translation:
    """One request's answer: native responses in, OpenAI body or SSE chunks out."""

    def __init__(self, req: GenRequest, model_name: str, prompt: str, *, created: int | None = None,
                 rid: str | None = None, keep_text: bool = False) -> None:
        self.req = req
        self.model = model_name
        self.id = rid or new_id(req.endpoint)
        self.created = created if created is not None else int(time.time())
        self.chat = req.endpoint == CHAT
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self._stop = StopText(req.stop) if req.stop else None
        self._first = True
        self._echo = prompt if req.echo else ""
        self._keep = keep_text  # the caller counts tokens itself: it needs the whole text
        self.parts: list[str] = []
        self.done = False  # a stop string matched: nothing more to send
        # A streamed token's chunk is these bytes around its text: built once, since a dict
        # and a json.dumps per token cost a third of the per-token work.
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        head = ('data: {"id":' + json.dumps(self.id) + ',"object":"' + obj + '","created":' + str(self.created)
                + ',"model":' + json.dumps(self.model, ensure_ascii=False) + ',"choices":[{"index":0,')
        tail = ',"logprobs":null,"finish_reason":null}]' + (',"usage":null' if req.include_usage else "") + "}\n\n"
        if self.chat:
            self._heads = (head + '"delta":{"role":"assistant","content":').encode(), \
                (head + '"delta":{"content":').encode()
            self._tail = ("}" + tail).encode()
        else:
            self._heads = ((head + '"text":').encode(),) * 2
            self._tail = tail.encode()

    # --- counting ---
    def _count(self, doc: dict[str, Any]) -> None:
        n_in = native_count(doc, "num_input_tokens")
        if n_in is not None:
            self.prompt_tokens = n_in
        n_out = native_count(doc, "num_output_tokens")
        if n_out is not None:
            # Streamed responses count their own new tokens; a whole answer counts all.
            self.completion_tokens = (self.completion_tokens or 0) + n_out if self.req.stream else n_out

    def set_counts(self, prompt_tokens: int | None, completion_tokens: int | None) -> None:
        """Counts the caller made (tokenizer) where the model gave none."""
        if self.prompt_tokens is None:
            self.prompt_tokens = prompt_tokens
        if self.completion_tokens is None:
            self.completion_tokens = completion_tokens

    @property
    def counted(self) -> bool:
        return self.prompt_tokens is not None and self.completion_tokens is not None

    def _usage(self) -> dict[str, int] | None:
        if not self.counted:
            return None
        return usage(self.prompt_tokens or 0, self.completion_tokens or 0)

    def _finish(self) -> str:
        return finish_reason(self._stop is not None and self._stop.matched, self.completion_tokens,
                             self.req.max_tokens)

    # --- non-streaming ---
    def whole(self, doc: dict[str, Any]) -> None:
        self._count(doc)
        text = native_text(doc)
        if self._stop is not None:
            text = self._stop.feed(text)
            if not self._stop.matched:
                text += self._stop.flush()
        self.parts.append(text)

    def body(self) -> bytes:
        text = self._echo + "".join(self.parts)
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": self._finish()}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": self._finish()}
            obj = "text_completion"
        return _dumps({"id": self.id, "object": obj, "created": self.created, "model": self.model,
                       "choices": [choice], "usage": self._usage()})

    # --- streaming ---
    def _chunk(self, text: str | None, finish: str | None) -> bytes:
        if self.chat:
            delta: dict[str, Any] = {}
            if self._first:
                # The role rides on the first content chunk instead of a chunk of its own:
                # an empty first chunk would be counted as the first token by latency tools.
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        self._first = False
        chunk: dict[str, Any] = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                                 "choices": [choice]}
        if self.req.include_usage:
            chunk["usage"] = None  # as OpenAI: every chunk has it, only the last one fills it
        return b"data: " + _dumps(chunk) + b"\n\n"

    def event(self, doc: dict[str, Any]) -> bytes:
        """SSE bytes for one native streamed response (b"" when there is nothing to send yet)."""
        self._count(doc)
        text = native_text(doc)
        if self._keep:
            self.parts.append(text)
        if self._stop is not None:
            text = self._stop.feed(text)
            if self._stop.matched:
                self.done = True
        if self._echo:
            text, self._echo = self._echo + text, ""
        if not text:
            return b""
        head = self._heads[0] if self._first else self._heads[1]
        self._first = False
        return head + json.dumps(text, ensure_ascii=False).encode() + self._tail

    def end(self) -> bytes:
        """The last chunks: held-back text, finish_reason, usage (if asked), [DONE]."""
        out = []
        held = self._stop.flush() if self._stop is not None and not self._stop.matched else ""
        held, self._echo = self._echo + held, ""
        if held:
            out.append(self._chunk(held, None))
        out.append(self._chunk(None if self.chat else "", self._finish()))
        if self.req.include_usage:
            out.append(b"data: " + _dumps({"id": self.id, "object": "chat.completion.chunk" if self.chat
                                           else "text_completion", "created": self.created,
                                           "model": self.model, "choices": [], "usage": self._usage()})
                       + b"\n\n")
        out.append(DONE)
        return b"".join(out)

    def text(self) -> str:
        """Generated text so far (for counting with a tokenizer; only with keep_text)."""
        return "".join(self.parts)


def stream_error(message: str, status: int = 500) -> bytes:
    """An error after the stream started: one SSE event in the error shape, then [DONE]."""
    return b"data: " + error_body(status, message) + b"\n\n" + DONE


def models_body(names: Iterable[str], created: int) -> bytes:
    return _dumps({"object": "list", "data": [model_obj(n, created) for n in names]})


def model_obj(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "trtllm-orch"}


def model_body(name: str, created: int) -> bytes:
    return _dumps(model_obj(name, created))
