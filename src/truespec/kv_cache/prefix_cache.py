"""Prefix caching of full KV blocks: vLLM's chained block hash, and an LRU of the blocks no request uses (no torch).

Block ``b`` of a request (positions ``b * block_size .. (b + 1) * block_size - 1``) is keyed by the SHA-256 of its
parent's key and its token ids, so equal keys mean equal tokens from position 0 on (a collision would need a
SHA-256 collision). ``extra_tokens`` more token ids past the block go into its key when a block's cache contents
depend on them: an MTP / EAGLE drafter stores at position ``p`` what it computed from the target's hidden state at
``p`` and token ``p + 1`` (spec_decode/model_drafter.py), so its last position is valid only for that next token.

A cached block is held by one reference of the cache itself (``BlockPool`` counts it), so a request that shares it
takes a second one. A cached block whose only reference is the cache's is *evictable*: it counts as free, and is
handed out again (its key dropped) when the pool runs out of never-cached blocks, least recently used first.
"""

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable

from truespec.kv_cache.block_pool import BlockPool

BlockKey = bytes
ROOT_KEY: BlockKey = b"truespec-prefix-root"  # block 0's parent; a caller salts it to keep requests apart


def block_keys(token_ids: list[int], block_size: int, num_blocks: int, extra_tokens: int = 0,
               parent_keys: list[BlockKey] | None = None, root: BlockKey = ROOT_KEY) -> list[BlockKey]:
    """The chained keys of the first ``num_blocks`` blocks of ``token_ids`` (each needs ``extra_tokens`` ids past its
    end), block 0's chained to ``root``. ``parent_keys``: keys already computed for a prefix of them (extended, not
    recomputed)."""
    keys = list(parent_keys or [])
    for b in range(len(keys), num_blocks):
        tokens = token_ids[b * block_size:(b + 1) * block_size + extra_tokens]
        if len(tokens) != block_size + extra_tokens:
            raise ValueError(f"block {b} needs {block_size + extra_tokens} token ids, got {len(tokens)}")
        h = hashlib.sha256(keys[-1] if keys else root)
        h.update(array("q", tokens).tobytes())  # 8 bytes per id (keys are compared within one process)
        keys.append(h.digest())
    return keys


class PrefixCache:
    def __init__(self, pool: BlockPool, on_evict: Callable[[BlockKey], None] | None = None) -> None:
        self.pool = pool
        self.on_evict = on_evict  # told each key whose block is handed out again (its state checkpoint goes too)
        self._block_of: dict[BlockKey, int] = {}
        self._key_of: dict[int, BlockKey] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first

    @property
    def num_cached_blocks(self) -> int:
        return len(self._key_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def match(self, keys: list[BlockKey]) -> list[int]:
        """The blocks of the longest cached chain that ``keys`` starts with."""
        blocks = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def contains(self, key: BlockKey) -> bool:
        return key in self._block_of

    def num_evictable_in(self, blocks: list[int]) -> int:
        """How many of ``blocks`` count as free now (taking them makes them used)."""
        return sum(1 for b in blocks if b in self._evictable)

    def take(self, blocks: list[int]) -> None:
        """A request starts using cached ``blocks``: one reference each, none of them evictable any more."""
        for b in blocks:
            self._evictable.pop(b, None)
        self.pool.incref(blocks)

    def insert(self, key: BlockKey, block: int) -> bool:
        """Cache a request's full ``block`` under ``key`` (the cache takes a reference); False if the key is cached
        already (in another block: this one stays the request's own) or the block is."""
        if key in self._block_of or block in self._key_of:
            return False
        self._block_of[key], self._key_of[block] = block, key
        self.pool.incref([block])
        return True

    def release(self, blocks: list[int]) -> None:
        """A request drops ``blocks`` (its block table): one reference each. Cached blocks left with only the cache's
        reference become evictable, the table's tail first (a shared prefix is evicted last)."""
        self.pool.free(blocks)
        for b in reversed(blocks):
            if b in self._key_of and self.pool.ref_count(b) == 1:
                self._evictable[b] = None

    def evict(self, n: int) -> None:
        """Return ``n`` evictable blocks to the pool's free list, least recently used first."""
        for _ in range(n):
            block, _ = self._evictable.popitem(last=False)
            self._drop(block)

    def clear(self) -> bool:
        """Drop every cached block (vLLM's reset_prefix_cache); False, and nothing dropped, while a request uses
        one."""
        if len(self._evictable) != len(self._key_of):
            return False
        self.evict(len(self._evictable))
        return True

    def _drop(self, block: int) -> None:
        key = self._key_of.pop(block)
        del self._block_of[key]
        self.pool.free([block])
        if self.on_evict is not None:
            self.on_evict(key)
