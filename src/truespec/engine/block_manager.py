"""Paged KV blocks for the attention layers: a free list and per-request block lists (no torch)."""

from collections import deque

from truespec.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_ids))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_blocks_needed(seq, num_new_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give ``seq`` enough blocks to hold its computed tokens plus ``num_new_tokens``."""
        needed = self.num_blocks_needed(seq, num_new_tokens)
        if needed > len(self._free):
            raise RuntimeError(f"BlockManager: {needed} blocks needed, {len(self._free)} free")
        seq.block_ids.extend(self._free.popleft() for _ in range(needed))

    def free(self, seq: Sequence) -> None:
        self._free.extend(seq.block_ids)
        seq.block_ids = []
