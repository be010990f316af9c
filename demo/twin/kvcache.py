"""Paged KV cache with prefix reuse, as TRT-LLM's block manager behaves from outside.

- The pool holds max_tokens // tokens_per_block blocks.
- With reuse on, every full prompt block is named by the hash of its tokens chained
  to the previous block's hash, so a block is found again only behind the same prefix.
- A new sequence takes matching leading blocks from the cache (they skip prefill),
  at most (prompt_len - 1) // tokens_per_block of them: the last prompt token is
  always computed, because it produces the first output token.
- Released blocks that carry a hash stay cached while free; they are evicted least
  recently used when a new block is needed and no plain free block is left.
"""
import hashlib
from collections import OrderedDict


def block_hashes(tokens, tokens_per_block):
    """Prefix-chain hashes of the full blocks of `tokens`."""
    out, prev = [], b""
    for i in range(len(tokens) // tokens_per_block):
        chunk = tokens[i * tokens_per_block:(i + 1) * tokens_per_block]
        prev = hashlib.sha256(prev + b"|" + ",".join(str(int(t)) for t in chunk).encode()).digest()
        out.append(prev)
    return out


class _Block:
    __slots__ = ("id", "hash", "refs")

    def __init__(self, block_id):
        self.id = block_id
        self.hash = None
        self.refs = 0


class Allocation:
    """One sequence's blocks; reused = leading blocks that came from the cache."""

    def __init__(self, blocks, reused, new):
        self.blocks = blocks
        self.reused = reused
        self.new = new


class KvCache:
    def __init__(self, max_tokens, tokens_per_block, enable_reuse):
        if tokens_per_block <= 0:
            raise ValueError("tokens_per_block must be > 0")
        self.tokens_per_block = tokens_per_block
        self.max_blocks = max(0, int(max_tokens) // tokens_per_block)
        self.enable_reuse = enable_reuse
        self._blocks = [_Block(i) for i in range(self.max_blocks)]
        self._plain_free = list(range(self.max_blocks - 1, -1, -1))  # pop() takes the lowest id
        self._cached_free = OrderedDict()   # block id -> None, oldest first (LRU order)
        self._by_hash = {}                  # hash -> block id (free or in use)
        self.reused_blocks_total = 0        # cumulative, for the `reused` gauge
        self.evicted_blocks_total = 0

    # --- accounting -----------------------------------------------------------------
    @property
    def free_blocks(self):
        return len(self._plain_free) + len(self._cached_free)

    @property
    def used_blocks(self):
        return self.max_blocks - self.free_blocks

    @property
    def cached_blocks(self):
        return len(self._by_hash)

    def blocks_for(self, tokens):
        return -(-int(tokens) // self.tokens_per_block)

    # --- allocation -----------------------------------------------------------------
    def match(self, prompt):
        """How many leading prompt blocks a sequence would take from the cache."""
        if not self.enable_reuse:
            return 0
        limit = (len(prompt) - 1) // self.tokens_per_block
        n = 0
        for h in block_hashes(prompt, self.tokens_per_block)[:limit]:
            if h not in self._by_hash:
                break
            n += 1
        return n

    def allocate(self, prompt, reserve_tokens, must_fit_tokens=None, held_blocks=0):
        """Blocks for a new sequence covering `reserve_tokens` tokens (>= len(prompt)),
        reusing cached leading prompt blocks; None (and no change) if they cannot be had.
        With must_fit_tokens, the free blocks less `held_blocks` (spoken for by others)
        must also cover the sequence's growth to that many tokens."""
        hashes = block_hashes(prompt, self.tokens_per_block) if self.enable_reuse else []
        reuse_n = self.match(prompt)
        reused = [self._by_hash[h] for h in hashes[:reuse_n]]
        need_new = max(0, self.blocks_for(reserve_tokens) - reuse_n)
        # Cached-free blocks we are about to reuse cannot also be evicted for new ones.
        reusable_free = sum(1 for b in reused if self._blocks[b].refs == 0)
        if need_new > self.free_blocks - reusable_free:
            return None
        if must_fit_tokens is not None and \
                max(0, self.blocks_for(must_fit_tokens) - reuse_n) > self.free_blocks - reusable_free - held_blocks:
            return None
        for b in reused:
            blk = self._blocks[b]
            if blk.refs == 0:
                del self._cached_free[b]
            blk.refs += 1
        new = [self._take() for _ in range(need_new)]
        # Full prompt blocks computed now become findable by later requests.
        for i, b in enumerate(new):
            idx = reuse_n + i
            if idx < len(hashes) and hashes[idx] not in self._by_hash:
                self._blocks[b].hash = hashes[idx]
                self._by_hash[hashes[idx]] = b
        self.reused_blocks_total += reuse_n
        return Allocation(reused + new, reuse_n, need_new)

    def grow(self, alloc, total_tokens):
        """Add blocks so `alloc` covers total_tokens; False if none free (nothing changes)."""
        need = self.blocks_for(total_tokens) - len(alloc.blocks)
        if need <= 0:
            return True
        if need > self.free_blocks:
            return False
        for _ in range(need):
            alloc.blocks.append(self._take())
            alloc.new += 1
        return True

    def release(self, alloc):
        # Tail blocks first, so a prefix chain is evicted from its end and its
        # leading blocks (shared by more prompts) stay findable longest.
        for b in reversed(alloc.blocks):
            blk = self._blocks[b]
            blk.refs -= 1
            if blk.refs > 0:
                continue
            if blk.hash is not None:
                self._cached_free[b] = None
                self._cached_free.move_to_end(b)   # most recently used last
            else:
                self._plain_free.append(b)
        alloc.blocks = []

    def _take(self):
        if self._plain_free:
            b = self._plain_free.pop()
        else:
            b, _ = self._cached_free.popitem(last=False)   # evict the least recently used
            blk = self._blocks[b]
            del self._by_hash[blk.hash]
            blk.hash = None
            self.evicted_blocks_total += 1
        self._blocks[b].refs = 1
        return b
