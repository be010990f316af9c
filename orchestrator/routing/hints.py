"""What a routing policy may know of a request beyond its route: its prompt's chunk keys,
length, head checksum and text. Built by the proxy (dataplane/embedded.py), only for a policy
that wants the prompt. Pure logic."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

from orchestrator.routing.prefix_index import DEFAULT_CHUNK_CHARS, chunk_keys


@dataclass(frozen=True)
class RouteHints:
    """What a policy may know about the request; built by the proxy, only when the policy wants it."""

    prompt_keys: tuple[bytes, ...] = ()
    prompt_chars: int = 0  # the prompt's length as read (prompt.MAX_PROMPT_CHARS at most)
    # A checksum of the prompt's head (its first chunk): where estimates tie, every worker
    # breaks the tie alike, and a prompt's tenants land together (cost_policy.py).
    route_key: int = 0
    # The prompt itself, for a policy that samples it with the model's tokenizer (cost-model).
    text: str = field(default="", repr=False, compare=False)

    @classmethod
    def from_prompt(cls, prompt: str | None) -> "RouteHints | None":
        if not prompt:
            return None
        keys = tuple(chunk_keys(prompt))
        head = keys[0] if keys else prompt[:DEFAULT_CHUNK_CHARS].encode("utf-8", "surrogatepass")
        return cls(keys, len(prompt), zlib.crc32(head), prompt)
