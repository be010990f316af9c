"""The OpenAI API end to end, with the `openai` SDK, in both proxy modes, against the twin.

One real daemon per mode (`--gpus 0 --tp 1 --assume-gpus 1`: one instance of the demo
repository; `--hold-s 0`, `--max-failures 1` and no canary, so the last case can leave
nothing ready), shared by the module. Embedded mode translates in the proxy; NGINX mode
forwards /v1/ to the side workers' loopback listener. Expected texts come from the
twin's own token function (`vocab.generate_text`), usage from the model's counts: a
prompt is its UTF-8 bytes, each generated word one token.
"""

from __future__ import annotations

import json
import re
import signal
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.harness import DEMO_REPO, Run, triton_env
from tests.test_e2e_proxy import NGINX, rank0, request, wait_endpoint

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.e2e

sys.path.insert(0, str(DEMO_REPO / "tensorrt_llm" / "1"))
import vocab  # noqa: E402

MAX_BODY = 65536
EXTRA = ("--max-body-bytes", str(MAX_BODY), "--hold-s", "0", "--max-failures", "1", "--canary-interval-s", "0",
         "--stop-grace-s", "3")


def chat_prompt(*turns: tuple[str, str]) -> str:
    """demo/tokenizer's chat template, by hand."""
    return "".join(f"<|{role}|>\n{content}</s>\n" for role, content in turns) + "<|assistant|>\n"


@pytest.fixture(scope="module", params=["embedded", "nginx"])
def orch(request, tmp_path_factory):
    if triton_env() is None:
        pytest.skip("no .triton/env: run scripts/setup-triton (the README's test command does)")
    mode = request.param
    if mode == "nginx" and not Path(NGINX).exists():
        pytest.skip(f"{NGINX} missing")
    extra = EXTRA + (("--nginx", NGINX) if mode == "nginx" else ())
    run = Run(tmp_path_factory.mktemp(f"openai-{mode}"), gpus="0", tp=1, assume_gpus=1, proxy=mode, extra=extra,
              env_extra={"DEMO_TOKEN_DELAY_MS": "5"})
    try:
        run.start(timeout=120)
        wait_endpoint(run, mode, 1)
        yield mode, run
    finally:
        leaked = run.close()
    assert not leaked, f"processes left running after the {mode} daemon: {leaked}"


def client(run: Run):
    # max_retries=0: the SDK would retry 429/5xx itself and hide what the endpoint answered.
    return openai.OpenAI(base_url=run.url("/v1"), api_key="unused", max_retries=0, timeout=30)


def test_models(orch):
    _, run = orch
    assert [m.id for m in client(run).models.list().data] == ["ensemble"]


def test_completion(orch):
    _, run = orch
    r = client(run).completions.create(model="ensemble", prompt="hello", max_tokens=5)
    assert r.choices[0].text == vocab.generate_text("hello", 5)
    assert r.choices[0].finish_reason == "length" and r.object == "text_completion"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 5, 10)


def test_metrics_count_v1(orch):
    """The endpoint's /metrics counts /v1/ requests: the workers' own (embedded), or in NGINX mode
    the daemon's, which reads its side workers' files (controlplane/side_workers.py)."""
    mode, run = orch

    def completions_200() -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{run.metrics_port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        line = r'^trtllm_orch_proxy_openai_requests_total\{api="openai.completions",code="200"\} (\S+)$'
        found = re.search(line, text, re.M)
        return float(found.group(1)) if found else 0.0

    before = completions_200()
    for _ in range(3):
        client(run).completions.create(model="ensemble", prompt="counted", max_tokens=2)
    assert completions_200() == before + 3, mode


def test_chat(orch):
    _, run = orch
    r = client(run).chat.completions.create(
        model="ensemble", messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        max_tokens=4)
    prompt = chat_prompt(("system", "be brief"), ("user", "hi"))
    assert r.choices[0].message.content == vocab.generate_text(prompt, 4)
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt.encode()), 4)


def test_streams(orch):
    _, run = orch
    c = client(run)
    chunks = list(c.chat.completions.create(model="ensemble", messages=[{"role": "user", "content": "stream"}],
                                            max_tokens=6, stream=True, stream_options={"include_usage": True}))
    prompt = chat_prompt(("user", "stream"))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == vocab.generate_text(prompt, 6)
    assert len([ch for ch in chunks if ch.choices and ch.choices[0].delta.content]) == 6  # token by token
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].usage.prompt_tokens == len(prompt.encode())
    text = "".join(ch.choices[0].text for ch in c.completions.create(model="ensemble", prompt="abc", max_tokens=3,
                                                                     stream=True))
    assert text == vocab.generate_text("abc", 3)


def test_stop(orch):
    _, run = orch
    words = vocab.generate_text("stop here", 12).split(" ")[1:]
    k = next(i for i in range(2, len(words)) if words[i] not in words[:i])
    stop = " " + words[k]
    want = "".join(" " + w for w in words[:k])
    c = client(run)
    r = c.completions.create(model="ensemble", prompt="stop here", max_tokens=12, stop=[stop])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == k + 1  # the model stopped at the stop word (kept out of the text)
    chunks = list(c.completions.create(model="ensemble", prompt="stop here", max_tokens=12, stop=stop, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == want and chunks[-1].choices[0].finish_reason == "stop"


def test_errors(orch):
    mode, run = orch
    c = client(run)
    with pytest.raises(openai.BadRequestError) as exc:
        c.chat.completions.create(model="ensemble", messages=[{"role": "user", "content": "x"}], top_p=0)
    assert exc.value.param == "top_p"
    with pytest.raises(openai.NotFoundError) as exc:
        c.completions.create(model="no-such-model", prompt="x")
    assert exc.value.code == "model_not_found"
    with pytest.raises(openai.APIStatusError) as exc:
        c.completions.create(model="ensemble", prompt="x" * (MAX_BODY + 10))
    assert exc.value.status_code == 413 and exc.value.body["code"] == "request_too_large", mode  # nginx: its own
    code, _, data = request(run.url("/v1/chat/completions"), b'{"model": "ensemble"}')
    assert code == 400 and json.loads(data)["error"]["param"] == "messages"
    code, _, _ = request(run.url("/v2/repository/index"), b"{}")
    assert code == 403  # the admin API stays closed


def test_proxy_metrics_label_the_api(orch):
    _, run = orch
    with urllib.request.urlopen(f"http://127.0.0.1:{run.metrics_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    assert 'trtllm_orch_proxy_openai_requests_total{api="openai.chat.completions",code="200"}' in text
    assert 'trtllm_orch_proxy_time_to_first_token_seconds_count{api="openai.completions"' in text


def test_nothing_ready_is_503(orch):
    """Last: kills the only instance (--max-failures 1 leaves it FAILED)."""
    _, run = orch
    rank0(run, "0").send_signal(signal.SIGKILL)
    run.wait_for(lambda s: s["instances"][0]["state"] == "FAILED", 60, "instance FAILED")
    deadline = time.monotonic() + 10
    err = None
    while time.monotonic() < deadline:
        try:
            client(run).completions.create(model="ensemble", prompt="x", max_tokens=1)
        except openai.APIStatusError as exc:
            err = exc
            if exc.status_code == 503:
                break
        time.sleep(0.1)
    assert err is not None and err.status_code == 503 and err.response.headers.get("Retry-After"), err
    assert err.body["type"] == "server_error" and err.body["code"] == "no_instance_ready"


@pytest.fixture(scope="module")
def bls_orch(tmp_path_factory):
    """The OpenAI API in front of tensorrt_llm_bls (--openai-model) rather than the ensemble."""
    if triton_env() is None:
        pytest.skip("no .triton/env: run scripts/setup-triton (the README's test command does)")
    run = Run(tmp_path_factory.mktemp("openai-bls"), gpus="0", tp=1, assume_gpus=1, proxy="embedded",
              extra=EXTRA + ("--openai-model", "tensorrt_llm_bls"), env_extra={"DEMO_TOKEN_DELAY_MS": "5"})
    try:
        run.start(timeout=120)
        wait_endpoint(run, "embedded", 1)
        yield run
    finally:
        leaked = run.close()
    assert not leaked, f"processes left running after the daemon: {leaked}"


def test_bls_as_the_openai_model(bls_orch):
    c = client(bls_orch)
    assert [m.id for m in c.models.list().data] == ["tensorrt_llm_bls"]
    r = c.completions.create(model="tensorrt_llm_bls", prompt="hello", max_tokens=5)
    assert r.choices[0].text == vocab.generate_text("hello", 5) and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (5, 5)
    chunks = list(c.chat.completions.create(model="tensorrt_llm_bls", messages=[{"role": "user", "content": "stream"}],
                                            max_tokens=6, stream=True, stream_options={"include_usage": True}))
    prompt = chat_prompt(("user", "stream"))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == vocab.generate_text(prompt, 6)
    assert len([ch for ch in chunks if ch.choices and ch.choices[0].delta.content]) == 6  # token by token
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].usage.prompt_tokens == len(prompt.encode())
