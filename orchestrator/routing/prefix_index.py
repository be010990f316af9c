"""An approximate index of which instance holds which prompt prefix in its KV cache.

We cannot see an engine's cache, but we routed every prompt it got: a prompt's
leading chunks, hashed as a chain (each chunk's key covers everything before
it, as TRT-LLM's block hashes do), are recorded against the instance that
served it. A new prompt whose leading chunks are recorded is likely to find
them cached there.

Approximate on purpose: characters stand in for tokens (the proxy has no
tokenizer), an engine may have evicted what we recorded, and an instance that
restarts loses everything (`forget_instance`). Memory is bounded (LRU over chunk
keys) and entries age out after `ttl_s`.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable

DEFAULT_CHUNK_CHARS = 256  # ~64 tokens: a few KV blocks of 16-32 tokens
DEFAULT_MAX_CHUNKS = 65536
DEFAULT_TTL_S = 600.0


def chunk_keys(prompt: str, chunk_chars: int = DEFAULT_CHUNK_CHARS, max_chunks: int = 64) -> list[bytes]:
    """Chained keys of the prompt's full leading chunks (a partial last chunk is not cached
    as a full block by the engine either)."""
    keys: list[bytes] = []
    h = hashlib.blake2b(digest_size=16)
    for i in range(min(len(prompt) // chunk_chars, max_chunks)):
        h.update(prompt[i * chunk_chars:(i + 1) * chunk_chars].encode("utf-8", "surrogatepass"))
        keys.append(h.copy().digest())
    return keys


class PrefixIndex:
    def __init__(self, max_chunks: int = DEFAULT_MAX_CHUNKS, ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_chunks = max_chunks
        self.ttl_s = ttl_s
        self._clock = clock
        # chunk key -> {instance_id: last time it was routed there}, oldest use first
        self._holders: OrderedDict[bytes, dict[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def match(self, keys: list[bytes]) -> tuple[int, dict[str, int]]:
        """For each instance, how many leading chunks of `keys` it holds (0 entries omitted)."""
        n, found = self.match_recency(keys)
        return n, {iid: depth for iid, (depth, _) in found.items()}

    def match_recency(self, keys: list[bytes]) -> tuple[int, dict[str, tuple[int, float]]]:
        """As `match`, with the time each instance was last routed its deepest matched chunk:
        how long its engine has had to evict it since (routing/cost_policy.py)."""
        oldest = self._clock() - self.ttl_s
        found: dict[str, tuple[int, float]] = {}
        alive: dict[str, float] = {}
        get = self._holders.get
        n = 0
        for key in keys:
            holders = get(key)
            if not holders:
                break
            if n == 0:
                now_alive = {iid: t for iid, t in holders.items() if t >= oldest}
            else:  # the chain must be unbroken: only who held every chunk before
                now_alive = {iid: t for iid, t in holders.items() if iid in alive and t >= oldest}
                if len(now_alive) < len(alive):
                    for iid, t in alive.items():
                        if iid not in now_alive:
                            found[iid] = (n, t)
            if not now_alive:
                alive = now_alive
                break
            alive = now_alive
            n += 1
        for iid, t in alive.items():
            found[iid] = (n, t)
        return len(keys), found

    def record(self, keys: list[bytes], instance_id: str) -> None:
        now = self._clock()
        holders_of = self._holders
        for key in keys:
            holders = holders_of.get(key)
            if holders is None:
                holders_of[key] = {instance_id: now}
            else:
                holders[instance_id] = now
                holders_of.move_to_end(key)
        while len(holders_of) > self.max_chunks:
            holders_of.popitem(last=False)

    def forget_instance(self, instance_id: str) -> None:
        """The instance restarted or left: its cache is gone."""
        empty = []
        for key, holders in self._holders.items():
            if holders.pop(instance_id, None) is not None and not holders:
                empty.append(key)
        for key in empty:
            del self._holders[key]
