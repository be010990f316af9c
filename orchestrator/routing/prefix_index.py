"""An approximate index of which instance holds which prompt prefix in its KV cache.

We cannot see an engine's cache, but we routed every prompt it got: a prompt's
leading chunks, hashed as a chain (each chunk's key covers everything before
it, as TRT-LLM's block hashes do), are recorded against the instance that
served it. A new prompt whose leading chunks are recorded is likely to find
them cached there.

Approximate on purpose: characters stand in for tokens (the proxy has no
tokenizer), an engine may have evicted what we recorded, and an instance that
restarts loses everything (`forget_instance`). Memory is bounded (LRU over chunk
keys) and entries age out after `ttl_s`. Only some chunk positions are recorded and
read (`recorded`): a prefix is found at the deepest of them it shares.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from functools import lru_cache

from xxhash import xxh3_128

DEFAULT_CHUNK_CHARS = 256  # ~64 tokens: a few KV blocks of 16-32 tokens
DEFAULT_MAX_CHUNKS = 65536
DEFAULT_TTL_S = 600.0
# The indexes record and look up a prompt's chain at some chunk positions only (`recorded`):
# its first 1, 2, 4 and 8 chunks, then every RECORD_STRIDE chunks, and the whole prompt. A
# record is a shared-memory write per key on the request path: a 64-chunk prompt (16k
# characters) wrote 64 keys, about two thirds of its routing decision (bench/decision_cost.py),
# and writes 11 now. The price: a prefix shared in part is found at the deepest recorded position
# it covers, never deeper: up to 3 chunks short within the first 8, up to RECORD_STRIDE - 1 (1792
# characters, ~450 tokens) beyond. bench/README.md (decision_cost) has what it bought and cost.
RECORD_STRIDE = 8


@lru_cache(maxsize=4096)  # prompts have at most 64 chunks (chunk_keys): a few dozen lengths
def recorded(n: int) -> tuple[int, ...]:
    """The 0-based chunk positions of an n-chunk prompt that the indexes record and match, in
    order. Every prompt records the same positions below its own length, so a holder of one of
    them was routed every one before it (the matchers rely on it), and the last position is the
    whole prompt: a prompt seen before matches whole."""
    marks = {p - 1 for p in range(RECORD_STRIDE, n + 1, RECORD_STRIDE)}
    k = 1
    while k <= min(n, RECORD_STRIDE):
        marks.add(k - 1)
        k *= 2
    if n:
        marks.add(n - 1)
    return tuple(sorted(marks))


def chunk_keys(prompt: str, chunk_chars: int = DEFAULT_CHUNK_CHARS, max_chunks: int = 64) -> list[bytes | None]:
    """Chained keys of the prompt's full leading chunks (a partial last chunk is not cached
    as a full block by the engine either): one per chunk, the key of chunk i covering chunks
    0..i. Only the positions the indexes read (`recorded`) are digested, the others are None:
    the proxy hashes every prompt once per request, and a 64-chunk prompt's 64 digests cost
    about as much as hashing its text (BLAKE2b then: 64 -> 37 us for 16k characters on the
    2-core box).

    The hash is XXH3's 128 bits (xxhash), not a cryptographic one: a 16k-character prompt's
    keys cost 7.5 us where BLAKE2b's cost 30 (bench/README.md, decision_cost's `hints_us`). A key
    only routes: a client who makes its prompt's key equal another prompt's must know that
    prompt, and could send it."""
    n = min(len(prompt) // chunk_chars, max_chunks)
    keys: list[bytes | None] = [None] * n
    h = xxh3_128()
    done = 0
    for p in recorded(n):
        end = (p + 1) * chunk_chars
        # UTF-8 encodes code point by code point: the slices' bytes chain as the whole text's
        h.update(prompt[done:end].encode("utf-8", "surrogatepass"))
        done = end
        keys[p] = h.digest()  # the digest so far; the state goes on
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

    def match(self, keys: Sequence[bytes | None]) -> tuple[int, dict[str, int]]:
        """For each instance, how many leading chunks of `keys` it holds (0 entries omitted)."""
        n, found = self.match_recency(keys)
        return n, {iid: depth for iid, (depth, _) in found.items()}

    def match_recency(self, keys: Sequence[bytes | None]) -> tuple[int, dict[str, tuple[int, float]]]:
        """As `match`, with the time each instance was last routed its deepest matched chunk:
        how long its engine has had to evict it since (routing/cost_policy.py)."""
        oldest = self._clock() - self.ttl_s
        found: dict[str, tuple[int, float]] = {}
        alive: dict[str, float] = {}
        get = self._holders.get
        n = 0  # chunks matched: one past the last recorded position every alive holder has
        for p in recorded(len(keys)):
            holders = get(keys[p])  # type: ignore[arg-type]  # a recorded position holds its key (chunk_keys)
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
            n = p + 1
        for iid, t in alive.items():
            found[iid] = (n, t)
        return len(keys), found

    def record(self, keys: Sequence[bytes | None], instance_id: str) -> None:
        now = self._clock()
        holders_of = self._holders
        for p in recorded(len(keys)):
            key: bytes = keys[p]  # type: ignore[assignment]  # a recorded position holds its key (chunk_keys)
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
