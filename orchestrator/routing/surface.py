"""Which HTTP paths and methods, and which gRPC methods, the public endpoint exposes.

Pure logic. The proxy classifies every request here before it touches an
upstream: only the KServe v2 inference surface and the OpenAI-compatible API
(`/v1/...`, translated by openai_frontend.py onto generate/generate_stream) are
public; Triton's admin API
(model load/unload accepts file uploads, logging can move the log file, shared
memory registration maps memory) is refused unless the operator allows it.
`ADMIN_API` is the one table of that admin API, for HTTP and gRPC alike; the gRPC
proxy and the NGINX config (`admin_regexes`) are built from it.

Classification runs on a *normalised* path: percent-decoded per segment, empty
segments (`//`, trailing `/`) and `.` dropped, `..` resolved. The proxy then
forwards that normalised path (re-encoded), so what we checked is exactly what
the upstream receives. Anything whose decoding is ambiguous (an encoded `/` or
`\\`, NUL or control characters, invalid UTF-8, `..` above the root) is a 400
rather than a guess.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple
from urllib.parse import quote, unquote_to_bytes

# Route kinds. Plain strings so log lines and tests read naturally.
PUBLIC = "public"  # forward to an instance
ADMIN = "admin"  # forward only if allow_admin, else 403
LIVE = "live"  # answered by the proxy itself
READY = "ready"  # answered by the proxy itself
NOT_FOUND = "not_found"
METHOD_NOT_ALLOWED = "method_not_allowed"
BAD_PATH = "bad_path"
OPENAI = "openai"  # public, answered by the OpenAI frontend (which forwards translated requests)

# Route.api of OpenAI routes (also the proxy metrics' `api` label); native routes have "v2".
OPENAI_MODELS = "openai.models"
OPENAI_MODEL = "openai.model"
OPENAI_COMPLETIONS = "openai.completions"
OPENAI_CHAT = "openai.chat.completions"

_INFER_ACTIONS = frozenset({"infer", "generate", "generate_stream"})


@dataclass(frozen=True)
class AdminApi:
    """One part of Triton's admin API, as HTTP and gRPC spell it.

    HTTP paths are relative to /v2, '/'-separated: `subtree` covers the path and
    everything below it, `exact` only the path itself, `model_action` the path after
    /v2/models/{model}[/versions/{n}]/.
    """

    what: str  # why it is admin: shown to readers, not used
    subtree: tuple[str, ...] = ()
    exact: tuple[str, ...] = ()
    model_action: tuple[str, ...] = ()
    grpc: tuple[str, ...] = ()  # methods of GRPC_SERVICE


# The one definition of the admin surface. The embedded HTTP proxy classifies with it,
# the gRPC proxy builds its method table from it, and the NGINX admin locations are
# rendered from it (admin_regexes): change it here and all three follow.
ADMIN_API = (
    AdminApi("model repository: index, load (accepts file uploads: code execution), unload",
             subtree=("repository",),
             grpc=("RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload")),
    AdminApi("system shared memory registration (maps host memory into the server)",
             subtree=("systemsharedmemory",),
             grpc=("SystemSharedMemoryStatus", "SystemSharedMemoryRegister",
                   "SystemSharedMemoryUnregister")),
    AdminApi("CUDA shared memory registration",
             subtree=("cudasharedmemory",),
             grpc=("CudaSharedMemoryStatus", "CudaSharedMemoryRegister", "CudaSharedMemoryUnregister")),
    AdminApi("trace settings (trace files are written where the caller says)",
             subtree=("trace/setting",), model_action=("trace/setting",), grpc=("TraceSetting",)),
    AdminApi("log settings (can move the log file)", subtree=("logging",), grpc=("LogSettings",)),
    AdminApi("model configuration", model_action=("config",), grpc=("ModelConfig",)),
    # /v2/models/stats is every model's statistics: Triton matches it before model metadata.
    AdminApi("statistics", exact=("models/stats",), model_action=("stats",), grpc=("ModelStatistics",)),
)

# gRPC: Triton's service and the methods it may forward. Everything is unary-unary
# except ModelStreamInfer (bidi); a method in neither table is UNIMPLEMENTED.
GRPC_SERVICE = "inference.GRPCInferenceService"
PUBLIC_GRPC_METHODS = ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata",
                       "ModelInfer", "ModelStreamInfer")
STREAMING_GRPC_METHODS = frozenset({"ModelStreamInfer"})
ADMIN_GRPC_METHODS = tuple(m for api in ADMIN_API for m in api.grpc)


def _segments(paths: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(p.split("/")) for p in paths)


_ADMIN_SUBTREES = tuple(s for api in ADMIN_API for s in _segments(api.subtree))
_ADMIN_EXACT = frozenset(s for api in ADMIN_API for s in _segments(api.exact))
_ADMIN_MODEL_ACTIONS = frozenset(s for api in ADMIN_API for s in _segments(api.model_action))
# RFC 3986 pchar minus '%' (which must be re-encoded): keeps ordinary model names readable.
_PCHAR_SAFE = "!$&'()*+,;=:@-._~"
_FORBIDDEN_CHARS = frozenset(chr(c) for c in range(0x20)) | {"\x7f", "/", "\\"}
_CACHE_MAX = 4096


@dataclass(frozen=True, slots=True)
class Route:
    kind: str
    path: str = ""  # normalised, percent-encoded path to forward ('' for BAD_PATH)
    allow: str = ""  # Allow header for METHOD_NOT_ALLOWED
    stream: bool = False  # generate_stream: the client expects SSE
    api: str = "v2"  # which API: "v2" (KServe v2 + Triton's extensions) or one of the OPENAI_* names


_BAD = Route(BAD_PATH)


def normalise(raw_path: str) -> tuple[str, ...] | None:
    """Decoded path segments, or None when the path is malformed or ambiguous."""
    if not raw_path.startswith("/"):
        return None
    out: list[str] = []
    for seg in raw_path.split("/"):
        if "%" in seg:
            try:
                seg = unquote_to_bytes(seg).decode("utf-8")
            except UnicodeDecodeError:
                return None
            if not _FORBIDDEN_CHARS.isdisjoint(seg):
                return None
        elif not _FORBIDDEN_CHARS.isdisjoint(seg):
            return None
        if seg == "" or seg == ".":
            continue
        if seg == "..":
            if not out:
                return None
            out.pop()
            continue
        out.append(seg)
    return tuple(out)


def encode(segments: tuple[str, ...]) -> str:
    return "/" + "/".join(quote(s, safe=_PCHAR_SAFE) for s in segments)


def _only(method: str, allowed: str, kind: str, path: str, stream: bool = False) -> Route:
    if method == allowed:
        return Route(kind, path, stream=stream)
    return Route(METHOD_NOT_ALLOWED, path, allow=allowed)


def _is_admin_path(under_v2: tuple[str, ...]) -> bool:
    """An admin path other than a model action (those are checked after the model name)."""
    if under_v2 in _ADMIN_EXACT:
        return True
    return any(under_v2[:len(s)] == s for s in _ADMIN_SUBTREES)


def classify(method: str, raw_path: str) -> Route:
    """Route for one request; `raw_path` is the undecoded path without query string."""
    segs = normalise(raw_path)
    if segs is None:
        return _BAD
    path = encode(segs)
    n = len(segs)
    if n and segs[0] == "v1":
        return _classify_openai(method, segs, path)
    if n == 0 or segs[0] != "v2":
        return Route(NOT_FOUND, path)
    if n == 1:
        return _only(method, "GET", PUBLIC, path)  # server metadata
    top = segs[1]
    if top == "health":
        if n == 3 and segs[2] == "live":
            return _only(method, "GET", LIVE, path)
        if n == 3 and segs[2] == "ready":
            return _only(method, "GET", READY, path)
        return Route(NOT_FOUND, path)
    if _is_admin_path(segs[1:]):
        return Route(ADMIN, path)
    if top != "models" or n < 3:
        return Route(NOT_FOUND, path)
    # /v2/models/{m}[/versions/{v}][/action...]
    rest = segs[3:]
    if len(rest) >= 2 and rest[0] == "versions":
        if not rest[1].isdigit() or not rest[1].isascii():
            return Route(NOT_FOUND, path)
        rest = rest[2:]
    if not rest:
        return _only(method, "GET", PUBLIC, path)  # model metadata
    if len(rest) == 1:
        action = rest[0]
        if action in _INFER_ACTIONS:
            return _only(method, "POST", PUBLIC, path, stream=action == "generate_stream")
        if action == "ready":
            return _only(method, "GET", PUBLIC, path)
    if rest in _ADMIN_MODEL_ACTIONS:
        return Route(ADMIN, path)
    return Route(NOT_FOUND, path)


def _classify_openai(method: str, segs: tuple[str, ...], path: str) -> Route:
    rest = segs[1:]
    if rest == ("models",):
        api, allowed = OPENAI_MODELS, "GET"
    elif len(rest) >= 2 and rest[0] == "models":  # model ids may hold a '/' (org/name)
        api, allowed = OPENAI_MODEL, "GET"
    elif rest == ("completions",):
        api, allowed = OPENAI_COMPLETIONS, "POST"
    elif rest == ("chat", "completions"):
        api, allowed = OPENAI_CHAT, "POST"
    else:
        return Route(NOT_FOUND, path, api=OPENAI)
    if method != allowed:
        return Route(METHOD_NOT_ALLOWED, path, allow=allowed, api=api)
    return Route(OPENAI, path, stream=False, api=api)


class AdminRegexes(NamedTuple):
    """ADMIN_API as regexes for NGINX `location ~` blocks (PCRE; Python's re reads them too)."""

    paths: str  # subtrees under /v2
    models: str  # exact paths and model actions; must precede model metadata's location
    grpc: str  # full gRPC method paths


def admin_regexes() -> AdminRegexes:
    """The NGINX rendering of ADMIN_API.

    They match NGINX's normalised $uri, so the config must refuse what normalisation
    could disguise (dot segments, encoded slashes) before any location is chosen.
    """
    def alternatives(items) -> str:
        return "|".join(re.escape(i) for i in items)

    subtrees = [p for api in ADMIN_API for p in api.subtree]
    actions = [a for api in ADMIN_API for a in api.model_action]
    exact = [re.escape(p) for api in ADMIN_API for p in api.exact]
    models = "|".join(exact + [f"models/[^/]+(/versions/[0-9]+)?/({alternatives(actions)})"])
    return AdminRegexes(
        paths=f"^/v2/({alternatives(subtrees)})(/|$)",
        models=f"^/v2/({models})$",
        grpc=f"^/{re.escape(GRPC_SERVICE)}/({alternatives(ADMIN_GRPC_METHODS)})$",
    )


class Surface:
    """classify() with a bounded memo: clients hit the same few paths over and over."""

    __slots__ = ("_cache",)

    def __init__(self) -> None:
        self._cache: dict[tuple[str, str], Route] = {}

    def route(self, method: str, raw_path: str) -> Route:
        key = (method, raw_path)
        r = self._cache.get(key)
        if r is None:
            r = classify(method, raw_path)
            if len(self._cache) >= _CACHE_MAX:
                self._cache.clear()  # crude but bounded; a path scan cannot grow memory
            self._cache[key] = r
        return r
