"""Which HTTP paths and methods the public endpoint exposes.

Pure logic. The proxy classifies every request here before it touches an
upstream: only the KServe v2 inference surface is public; Triton's admin API
(model load/unload accepts file uploads, logging can move the log file, shared
memory registration maps memory) is refused unless the operator allows it.

Classification runs on a *normalised* path: percent-decoded per segment, empty
segments (`//`, trailing `/`) and `.` dropped, `..` resolved. The proxy then
forwards that normalised path (re-encoded), so what we checked is exactly what
the upstream receives. Anything whose decoding is ambiguous (an encoded `/` or
`\\`, NUL or control characters, invalid UTF-8, `..` above the root) is a 400
rather than a guess.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote, unquote_to_bytes

# Route kinds. Plain strings so log lines and tests read naturally.
PUBLIC = "public"  # forward to an instance
ADMIN = "admin"  # forward only if allow_admin, else 403
LIVE = "live"  # answered by the proxy itself
READY = "ready"  # answered by the proxy itself
NOT_FOUND = "not_found"
METHOD_NOT_ALLOWED = "method_not_allowed"
BAD_PATH = "bad_path"

_INFER_ACTIONS = frozenset({"infer", "generate", "generate_stream"})
_ADMIN_TOP = frozenset({"repository", "systemsharedmemory", "cudasharedmemory", "logging"})
_ADMIN_MODEL_ACTIONS = frozenset({("config",), ("stats",), ("trace", "setting")})
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


def classify(method: str, raw_path: str) -> Route:
    """Route for one request; `raw_path` is the undecoded path without query string."""
    segs = normalise(raw_path)
    if segs is None:
        return _BAD
    path = encode(segs)
    n = len(segs)
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
    if top in _ADMIN_TOP or segs[1:3] == ("trace", "setting"):
        return Route(ADMIN, path)
    if top != "models" or n < 3:
        return Route(NOT_FOUND, path)
    if n == 3 and segs[2] == "stats":  # Triton matches /v2/models/stats before model metadata
        return Route(ADMIN, path)
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
