"""What the OpenAI frontend learns about the served model from the model repository.

Blocking file reads and template compilation: `load_model_facts` runs in a worker
thread (openai_frontend.py), at start and after a reload; requests only read the
resulting frozen `ModelFacts`.

- counts: whether the model takes `return_num_input_tokens`/`return_num_output_tokens`
  (TRT-LLM's ensemble and BLS have them since 0.17-ish; older repositories do not,
  and Triton rejects an input a model does not declare). Without them usage is
  counted with the tokenizer.
- tokenizer directory: `--tokenizer-dir`, else the `tokenizer_dir` parameter of the
  repository's `preprocessing` config (any model's, if there is no preprocessing).
- chat template: `--chat-template FILE`, else `chat_template` in the tokenizer's
  tokenizer_config.json (a string, or Hugging Face's list of named templates: the
  "default" one), else its chat_template.jinja. Rendered in jinja2's immutable
  sandbox, as Hugging Face's apply_chat_template does, so a template from a
  downloaded model cannot reach Python objects or files.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from orchestrator.errors import OrchError
from orchestrator.dataplane.openai_api import OpenAIError

_TOKENIZER_DIR = re.compile(r'key:\s*"tokenizer_dir"\s*value:\s*\{\s*string_value:\s*"([^"]*)"')
_COUNT_INPUT = re.compile(r'name:\s*"return_num_output_tokens"')
_SPECIAL = ("bos_token", "eos_token", "pad_token", "unk_token")

_log = logging.getLogger("trtllm-orch.proxy.openai")


class ChatTemplate:
    """A compiled chat template and the special tokens it may use."""

    def __init__(self, source: str, origin: str, special: dict[str, str]) -> None:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
                   separators: Any = None, sort_keys: bool = False) -> str:
            # Hugging Face's tojson: no HTML escaping (jinja's own would turn < into \u003c).
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.origin = origin
        self._special = special
        self._error = TemplateError
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise ValueError(f"{origin}: not a valid jinja2 template: {exc}") from None

    def render(self, messages: list[dict[str, Any]]) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=True, tools=None,
                                         **self._special)
        except self._error as exc:
            # Templates reject what they cannot express ("roles must alternate"): the
            # request's fault.
            raise OpenAIError(400, f"messages: the chat template refused them: {exc}", param="messages",
                              code="invalid_value") from None


@dataclass(frozen=True)
class ModelFacts:
    triton_model: str  # what generate/generate_stream is called on
    served_name: str  # the id /v1/models shows and requests name
    counts: bool
    tokenizer_dir: str  # '' when unknown
    template: ChatTemplate | None
    no_template_why: str  # for the 400 of a chat request when template is None
    # (text) -> token count, loaded only when the model does not count itself; None: no tokenizer.
    count_tokens: Callable[[str], int] | None


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def find_tokenizer_dir(model_repo: Path, cwd: Path) -> str:
    """The tokenizer_dir the repository's preprocessing names, resolved; '' if none."""
    configs = [model_repo / "preprocessing" / "config.pbtxt"]
    try:
        configs += sorted(p for p in model_repo.glob("*/config.pbtxt") if p not in configs)
    except OSError:
        pass
    for cfg in configs:
        text = _read(cfg)
        m = _TOKENIZER_DIR.search(text) if text else None
        if not m or not m.group(1) or m.group(1).startswith("${"):
            continue
        p = Path(m.group(1))
        if p.is_absolute():
            return str(p)
        # Relative: to the servers' working directory (the daemon's), else to the repository.
        for base in (cwd, model_repo.parent, model_repo):
            if (base / p).is_dir():
                return str((base / p).resolve())
        return str(cwd / p)
    return ""


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    out = {}
    for name in _SPECIAL:
        v = config.get(name)
        if isinstance(v, dict):  # serialized AddedToken
            v = v.get("content")
        out[name] = v if isinstance(v, str) else ""
    return out


def _template_source(tokenizer_dir: str, config: dict[str, Any]) -> tuple[str | None, str]:
    t = config.get("chat_template")
    origin = f"{tokenizer_dir}/tokenizer_config.json chat_template"
    if isinstance(t, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}
        t = named.get("default")
    if isinstance(t, str) and t:
        return t, origin
    jinja = _read(Path(tokenizer_dir) / "chat_template.jinja") if tokenizer_dir else None
    return (jinja, f"{tokenizer_dir}/chat_template.jinja") if jinja else (None, "")


def _load_counter(tokenizer_dir: str) -> Callable[[str], int] | None:
    path = Path(tokenizer_dir) / "tokenizer.json" if tokenizer_dir else None
    if path is None or not path.is_file():
        return None
    try:
        from tokenizers import Tokenizer  # optional: pip install tokenizers
    except ImportError:
        _log.warning("openai: the model returns no token counts and the `tokenizers` package is not "
                     "installed: usage will be missing (pip install tokenizers)")
        return None
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # a tokenizer file we cannot read must not stop the daemon
        _log.warning("openai: cannot load %s: %s; usage will be missing", path, exc)
        return None
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)


def load_model_facts(*, model_repo: str, triton_model: str, served_name: str, chat_template: str,
                     tokenizer_dir: str, cwd: str | None = None) -> ModelFacts:
    """Blocking: run in a thread. OrchError (one line) for a --chat-template that cannot be used."""
    repo = Path(model_repo) if model_repo else None
    here = Path(cwd or os.getcwd())
    config_text = _read(repo / triton_model / "config.pbtxt") if repo else None
    counts = bool(config_text and _COUNT_INPUT.search(config_text))
    tdir = tokenizer_dir or (find_tokenizer_dir(repo, here) if repo else "")
    tok_config: dict[str, Any] = {}
    if tdir:
        raw = _read(Path(tdir) / "tokenizer_config.json")
        try:
            loaded = json.loads(raw) if raw else {}
        except ValueError:
            loaded = {}
        tok_config = loaded if isinstance(loaded, dict) else {}
    special = _special_tokens(tok_config)
    template = None
    why = ""
    if chat_template:
        source = _read(Path(chat_template))
        if source is None:
            raise OrchError(f"--chat-template={chat_template!r}: cannot read it")
        try:
            template = ChatTemplate(source, chat_template, special)
        except ValueError as exc:
            raise OrchError(f"--chat-template={chat_template!r}: {exc}") from None
    else:
        source, origin = _template_source(tdir, tok_config)
        if source is None:
            why = (f"model {served_name!r} has no chat template (no chat_template in "
                   f"{tdir or 'its tokenizer directory'}); start the server with --chat-template FILE, "
                   "or use /v1/completions")
        else:
            try:
                template = ChatTemplate(source, origin, special)
            except ValueError as exc:
                why = f"model {served_name!r}: {exc}"
                _log.warning("openai: %s; chat requests get 400", why)
    count_tokens = None if counts else _load_counter(tdir)
    return ModelFacts(triton_model=triton_model, served_name=served_name, counts=counts, tokenizer_dir=tdir,
                      template=template, no_template_why=why, count_tokens=count_tokens)
