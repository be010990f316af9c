"""The OpenAI translation as pure functions: requests in, native bodies out, answers back.

Also the /v1 routes of the surface table and what the frontend reads from a model
repository (no server, no process).
"""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

from orchestrator.errors import OrchError
from orchestrator.dataplane.openai_api import (CHAT, COMPLETIONS, DONE, OpenAIError, SSEReader, StopText, Translation,
                                           _csv_field, decode_json, error_body, finish_reason, native_body,
                                           native_error, parse_request, stream_error)
from orchestrator.dataplane.openai_model import ChatTemplate, find_tokenizer_dir, load_model_facts
from orchestrator.routing.surface import (METHOD_NOT_ALLOWED, NOT_FOUND, OPENAI, OPENAI_CHAT, OPENAI_COMPLETIONS,
                                        OPENAI_MODEL, OPENAI_MODELS, classify)

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parent.parent
DEMO_REPO = REPO / "demo" / "model_repo"
DEMO_TOKENIZER = REPO / "demo" / "tokenizer"


def chat(**kw):
    doc = {"model": "ensemble", "messages": [{"role": "user", "content": "hi"}], **kw}
    return parse_request(CHAT, doc, 4096)


def comp(**kw):
    return parse_request(COMPLETIONS, {"model": "ensemble", "prompt": "hi", **kw}, 4096)


def bad(fn, param, **kw) -> OpenAIError:
    with pytest.raises(OpenAIError) as exc:
        fn(**kw)
    assert exc.value.status == 400 and exc.value.param == param, (exc.value.param, exc.value.message)
    body = json.loads(exc.value.body())["error"]
    assert body["param"] == param and body["type"] == "invalid_request_error" and param.split("[")[0] in body["message"]
    return exc.value


# --- requests ----------------------------------------------------------------------------------
def test_defaults():
    c = comp()
    assert (c.max_tokens, c.stream, c.include_usage, c.stop, c.echo, c.sampling) == (16, False, False, (), False, {})
    assert chat().max_tokens == 4096  # the server's --openai-max-tokens
    assert chat(max_tokens=7).max_tokens == 7
    assert chat(max_tokens=7, max_completion_tokens=9).max_tokens == 9  # the newer name wins
    assert chat(max_tokens=None).max_tokens == 4096  # null means unset


def test_sampling_maps_to_ensemble_inputs():
    r = comp(temperature=0.5, top_p=0.9, top_k=40, seed=7, presence_penalty=-1, frequency_penalty=1.5,
             repetition_penalty=1.1, min_tokens=2, ignore_eos=True, user="u1")
    assert r.sampling == {"temperature": 0.5, "top_p": 0.9, "top_k": 40, "seed": 7, "presence_penalty": -1.0,
                          "frequency_penalty": 1.5, "repetition_penalty": 1.1, "min_tokens": 2, "end_id": -1}


@pytest.mark.parametrize("kw,param", [
    ({"temperature": 2.5}, "temperature"), ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -1}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": True}, "max_tokens"), ({"max_tokens": 2.5}, "max_tokens"),
    ({"max_tokens": 1 << 40}, "max_tokens"),
    ({"seed": -1}, "seed"), ({"presence_penalty": 3}, "presence_penalty"), ({"n": 2}, "n"), ({"n": 0}, "n"),
    ({"stream": "yes"}, "stream"), ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stop": 5}, "stop"), ({"stop": ["a", 1]}, "stop"), ({"logit_bias": {"1": 2}}, "logit_bias"),
    ({"logprobs": 2}, "logprobs"), ({"model": 3}, "model"),
])
def test_bad_fields_are_400_naming_the_field(kw, param):
    bad(comp, param, **kw)


@pytest.mark.parametrize("kw,param", [
    ({"prompt": None}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": [1, 2, 3]}, "prompt"),
    ({"suffix": "x"}, "suffix"), ({"best_of": 2}, "best_of"), ({"echo": 1}, "echo"),
])
def test_completions_only_fields(kw, param):
    bad(comp, param, **kw)


@pytest.mark.parametrize("messages,param", [
    (None, "messages"), ([], "messages"), ("hi", "messages"), (["hi"], "messages[0]"),
    ([{"role": "wizard", "content": "x"}], "messages[0].role"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
])
def test_bad_messages(messages, param):
    bad(chat, param, messages=messages)


@pytest.mark.parametrize("kw,param", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"), ({"response_format": {"type": "json_object"}}, "response_format"),
])
def test_chat_unsupported_features_are_refused_clearly(kw, param):
    e = bad(chat, param, **kw)
    assert e.code == "unsupported_parameter" and "not supported" in e.message


def test_chat_accepted_forms():
    r = chat(messages=[{"role": "system", "content": "be brief"},
                       {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                       {"role": "assistant", "content": None, "name": "bot"}],
             tool_choice="none", response_format={"type": "text"}, tools=[])
    assert [m["content"] for m in r.messages] == ["be brief", "ab", None]
    assert r.messages[2]["name"] == "bot"


def test_prompt_forms_and_stop():
    assert comp(prompt=["only"]).prompt == "only"
    assert comp(stop="x").stop == ("x",)
    assert comp(stop=["a", "", "b", "a"]).stop == ("a", "b")  # empty ignored, duplicates once
    r = chat(stream=True, stream_options={"include_usage": True})
    assert r.stream and r.include_usage


def test_decode_json():
    for raw in (b"", b"{", b"[1]", b"\xff"):
        with pytest.raises(OpenAIError) as exc:
            decode_json(raw)
        assert exc.value.status == 400 and exc.value.code == "invalid_json"


def test_error_shape():
    doc = json.loads(error_body(404, "no such model", param="model", code="model_not_found"))
    assert doc == {"error": {"message": "no such model", "type": "not_found_error", "param": "model",
                             "code": "model_not_found"}}
    assert json.loads(error_body(503, "x"))["error"]["type"] == "server_error"
    assert json.loads(error_body(429, "x"))["error"]["type"] == "rate_limit_error"
    s = stream_error("boom")
    assert s.startswith(b"data: {\"error\"") and s.endswith(DONE)


# --- the native request ---------------------------------------------------------------------------
def test_native_body():
    r = comp(max_tokens=5, stop=["\n", "a,b", 'say "x"'], temperature=0.2, stream=True)
    body = json.loads(native_body(r, "the prompt", counts=True))
    assert body["text_input"] == "the prompt" and body["max_tokens"] == 5 and body["stream"] is True
    assert body["exclude_input_in_output"] is True  # TRT-LLM echoes the prompt by default
    assert body["return_num_input_tokens"] is True and body["return_num_output_tokens"] is True
    assert body["temperature"] == 0.2
    # TRT-LLM's preprocessing reads each entry as one CSV line of words: each stop string stays one word.
    assert [next(csv.reader([w])) for w in body["stop_words"]] == [["\n"], ["a,b"], ['say "x"']]
    plain = json.loads(native_body(comp(), "p", counts=False))
    assert "stop_words" not in plain and "return_num_output_tokens" not in plain and plain["stream"] is False


@pytest.mark.parametrize("word", ["plain", "a,b", 'q"uote', " lead", "trail ", "x\ny", ",", '"'])
def test_csv_field_round_trip(word):
    assert next(csv.reader([_csv_field(word)])) == [word]


# --- native answers ------------------------------------------------------------------------------
def test_sse_reader_handles_any_split():
    stream = b'data: {"a":1}\n\ndata: {"a":2}\r\n\r\ndata: {"a":3}\n\n'
    for cut in range(1, len(stream)):
        r = SSEReader()
        got = r.feed(stream[:cut]) + r.feed(stream[cut:])
        assert [json.loads(x)["a"] for x in got] == [1, 2, 3], cut
    r = SSEReader()
    assert r.feed(b'data: {"a":4}') == [] and [json.loads(x) for x in r.rest()] == [{"a": 4}]


def test_native_error():
    assert native_error(b'{"error":"bad input"}') == "bad input"
    assert native_error(b"plain text") == "plain text"


@pytest.mark.parametrize("pieces,stops,sent,matched", [
    (["hello wor", "ld STOP more"], (" STOP",), "hello world", True),
    (["ab", "c", "d"], ("cd",), "ab", True),
    (["a", "b", "c"], ("bx",), "abc", False),  # "b" held back until "c" shows it is no stop
    (["STOP at once"], ("STOP",), "", True),
    (["one two", " three"], ("three", "two"), "one ", True),  # the earliest stop wins
])
def test_stop_text(pieces, stops, sent, matched):
    s = StopText(stops)
    out = ""
    for p in pieces:
        out += s.feed(p)
        if s.matched:
            break
    if not s.matched:
        out += s.flush()
    assert (out, s.matched) == (sent, matched)


def test_finish_reason():
    assert finish_reason(True, 10, 10) == "stop"
    assert finish_reason(False, 10, 10) == "length"
    assert finish_reason(False, 3, 10) == "stop"
    assert finish_reason(False, None, 10) == "stop"


def _chunks(data: bytes) -> list:
    assert data.endswith(DONE)
    return [json.loads(x) for x in SSEReader().feed(data) if x != b"[DONE]"]


def test_whole_completion():
    t = Translation(comp(max_tokens=3), "served", "hi", created=1, rid="cmpl-1")
    t.whole({"text_output": " a b c", "num_input_tokens": 2, "num_output_tokens": 3})
    assert json.loads(t.body()) == {
        "id": "cmpl-1", "object": "text_completion", "created": 1, "model": "served",
        "choices": [{"index": 0, "text": " a b c", "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}}


def test_whole_chat_with_stop_and_echo_ignored():
    t = Translation(chat(max_tokens=10, stop=["b"]), "served", "hi")
    t.whole({"text_output": ["a b"], "num_input_tokens": [4], "num_output_tokens": [2]})
    doc = json.loads(t.body())
    assert doc["object"] == "chat.completion" and doc["id"].startswith("chatcmpl-")
    assert doc["choices"][0]["message"] == {"role": "assistant", "content": "a "}
    assert doc["choices"][0]["finish_reason"] == "stop" and doc["usage"]["total_tokens"] == 6


def test_whole_completion_echo_and_no_counts():
    t = Translation(comp(echo=True), "m", "hi")
    t.whole({"text_output": " there"})
    doc = json.loads(t.body())
    assert doc["choices"][0]["text"] == "hi there" and doc["usage"] is None
    t.set_counts(1, 1)  # a tokenizer's counts fill in only what the model did not give
    assert json.loads(t.body())["usage"]["total_tokens"] == 2


def test_stream_chat_with_usage():
    t = Translation(chat(max_tokens=3, stream=True, stream_options={"include_usage": True}), "m", "p")
    events = b"".join(t.event({"text_output": w, "num_input_tokens": 4, "num_output_tokens": 1})
                      for w in (" a", " b", " c"))
    chunks = _chunks(events + t.end())
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0] == {"role": "assistant", "content": " a"}  # the role rides on the first token
    assert "".join(d.get("content", "") for d in deltas) == " a b c"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1


def test_stream_completion_stop_across_events():
    t = Translation(comp(max_tokens=9, stream=True, stop=["END"]), "m", "p")
    out = t.event({"text_output": " one E", "num_output_tokens": 2})
    assert not t.done
    out += t.event({"text_output": "ND two", "num_output_tokens": 2})
    assert t.done  # the caller stops reading: the generation is cancelled
    chunks = _chunks(out + t.end())
    assert "".join(c["choices"][0]["text"] for c in chunks) == " one "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and "usage" not in chunks[-1]


def test_stream_nothing_generated_and_held_tail():
    t = Translation(chat(stream=True, stop=["xyz"]), "m", "p")
    (first,) = [json.loads(x) for x in SSEReader().feed(t.event({"text_output": "ab x"}))]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "ab "}
    chunks = _chunks(t.end())
    # the held "x" is no stop after all: it is sent before the finish chunk
    assert chunks[0]["choices"][0]["delta"]["content"] == "x" and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    empty = Translation(chat(stream=True), "m", "p")
    (last,) = _chunks(empty.end())
    assert last["choices"][0]["delta"] == {"role": "assistant"} and last["choices"][0]["finish_reason"] == "stop"


# --- the surface table -----------------------------------------------------------------------------
@pytest.mark.parametrize("method,path,kind,api", [
    ("GET", "/v1/models", OPENAI, OPENAI_MODELS),
    ("GET", "/v1/models/org/name", OPENAI, OPENAI_MODEL),
    ("POST", "/v1/completions", OPENAI, OPENAI_COMPLETIONS),
    ("POST", "/v1/chat/completions", OPENAI, OPENAI_CHAT),
    ("POST", "//v1/./chat//completions/", OPENAI, OPENAI_CHAT),
    ("GET", "/v1/chat/completions", METHOD_NOT_ALLOWED, OPENAI_CHAT),
    ("POST", "/v1/models", METHOD_NOT_ALLOWED, OPENAI_MODELS),
    ("POST", "/v1/embeddings", NOT_FOUND, OPENAI),
    ("POST", "/v1", NOT_FOUND, OPENAI),
    ("POST", "/v2/models/ensemble/generate", "public", "v2"),
])
def test_surface_routes(method, path, kind, api):
    r = classify(method, path)
    assert (r.kind, r.api) == (kind, api)


# --- what the frontend reads from a repository ---------------------------------------------------------
def test_demo_repo_facts():
    f = load_model_facts(model_repo=str(DEMO_REPO), triton_model="ensemble", served_name="ensemble",
                         chat_template="", tokenizer_dir="", cwd=str(REPO))
    assert f.counts and f.count_tokens is None  # the twin returns its own counts
    assert Path(f.tokenizer_dir) == DEMO_TOKENIZER.resolve()
    assert f.template is not None and "tokenizer_config.json" in f.template.origin
    prompt = f.template.render([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert prompt == "<|system|>\nS</s>\n<|user|>\nU</s>\n<|assistant|>\n"


def test_relative_tokenizer_dir_resolves_against_the_repository(tmp_path):
    repo = tmp_path / "repo"
    (repo / "preprocessing").mkdir(parents=True)
    (tmp_path / "tok").mkdir()
    (repo / "preprocessing" / "config.pbtxt").write_text(
        'parameters { key: "tokenizer_dir" value: { string_value: "tok" } }\n')
    assert find_tokenizer_dir(repo, tmp_path / "elsewhere") == str((tmp_path / "tok").resolve())


def _repo_without_counts(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "ensemble").mkdir(parents=True)
    (repo / "ensemble" / "config.pbtxt").write_text('name: "ensemble"\ninput [ { name: "text_input" } ]\n')
    tok = tmp_path / "tok"
    shutil.copytree(DEMO_TOKENIZER, tok)
    cfg = json.loads((tok / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (tok / "tokenizer_config.json").write_text(json.dumps(cfg))
    return repo


def test_no_counts_no_template(tmp_path):
    pytest.importorskip("tokenizers")
    repo = _repo_without_counts(tmp_path)
    f = load_model_facts(model_repo=str(repo), triton_model="ensemble", served_name="llm", chat_template="",
                         tokenizer_dir=str(tmp_path / "tok"))
    assert not f.counts and f.template is None and "--chat-template" in f.no_template_why
    assert f.count_tokens is not None and f.count_tokens("héllo") == len("héllo".encode())  # byte tokens


def test_chat_template_file(tmp_path):
    t = tmp_path / "t.jinja"
    t.write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{{ bos_token }}")
    f = load_model_facts(model_repo=str(DEMO_REPO), triton_model="ensemble", served_name="ensemble",
                         chat_template=str(t), tokenizer_dir="", cwd=str(REPO))
    assert f.template.render([{"role": "user", "content": "x"}]) == "[user]x<s>"
    with pytest.raises(OrchError, match="--chat-template"):
        load_model_facts(model_repo=str(DEMO_REPO), triton_model="ensemble", served_name="e",
                         chat_template=str(tmp_path / "missing"), tokenizer_dir="")
    t.write_text("{% for %}")
    with pytest.raises(OrchError, match="not a valid jinja2 template"):
        load_model_facts(model_repo=str(DEMO_REPO), triton_model="ensemble", served_name="e",
                         chat_template=str(t), tokenizer_dir="")


def test_template_is_sandboxed_and_its_errors_are_400():
    evil = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}", "evil", {})
    with pytest.raises(OpenAIError) as exc:
        evil.render([{"role": "user", "content": "x"}])
    assert exc.value.status == 400 and exc.value.param == "messages"
    strict = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}ok",
                          "strict", {})
    assert strict.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(OpenAIError, match="user first"):
        strict.render([{"role": "assistant", "content": "x"}])
    # tojson as Hugging Face's: no HTML escaping
    assert ChatTemplate("{{ messages[0].content | tojson }}", "j", {}).render(
        [{"role": "user", "content": "<b>é"}]) == '"<b>é"'
