"""Who holds which KV blocks and which recurrent-state group (plain Python, no torch).

Attention layers keep K/V in paged blocks of ``block_size`` tokens; a request holds the blocks for its
positions ``0 .. n-1`` in order (its block table). GDN layers keep recurrent state in slots; a request holds
one *group* of ``slots_per_group = 1 + k`` consecutive slots while it runs: a verify of ``1 + d`` tokens
writes the state after each position into the group, and the engine records which slot holds the state
after the last accepted token (docs/ARCHITECTURE.md, invariant 2). Only the scheduler allocates and frees;
the runner and the drafters read the tables it hands them in its ``SchedulerOutput``.
"""

from truespec.kv_cache.block_pool import BlockPool


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, num_state_groups: int, slots_per_group: int) -> None:
        self.block_size = block_size
        self.slots_per_group = slots_per_group
        self.blocks = BlockPool(num_blocks, "KV block")
        self.state_groups = BlockPool(num_state_groups, "state group")
        self._block_tables: dict[str, list[int]] = {}
        self._groups: dict[str, int] = {}

    # ---- KV blocks -----------------------------------------------------------------------------
    def block_ids(self, request_id: str) -> list[int]:
        return self._block_tables.get(request_id, [])

    def num_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Blocks to add so that the request's table covers positions ``0 .. num_tokens - 1``."""
        return max(0, -(-num_tokens // self.block_size) - len(self._block_tables.get(request_id, ())))

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.num_blocks_needed(request_id, num_tokens) <= self.blocks.num_free

    def allocate(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow the request's block table to cover ``num_tokens`` positions; the table."""
        needed = self.num_blocks_needed(request_id, num_tokens)
        table = self._block_tables.setdefault(request_id, [])
        if needed:
            table.extend(self.blocks.allocate(needed))
        return table

    # ---- recurrent-state groups -----------------------------------------------------------------
    def can_allocate_state(self) -> bool:
        return self.state_groups.num_free > 0

    def allocate_state(self, request_id: str) -> None:
        if request_id in self._groups:
            raise RuntimeError(f"{request_id} already holds state group {self._groups[request_id]}")
        self._groups[request_id] = self.state_groups.allocate(1)[0]

    def first_state_slot(self, request_id: str) -> int:
        """The flat slot where the request's group starts."""
        return self._groups[request_id] * self.slots_per_group

    # ---- release and accounting -----------------------------------------------------------------
    def free(self, request_id: str) -> None:
        """Return everything the request holds (a no-op for one that holds nothing)."""
        self.blocks.free(self._block_tables.pop(request_id, []))
        group = self._groups.pop(request_id, None)
        if group is not None:
            self.state_groups.free([group])

    @property
    def num_state_slots(self) -> int:
        return self.state_groups.num_ids * self.slots_per_group

    def cache_info(self) -> dict[str, int]:
        return {
            "block_size": self.block_size,
            "num_blocks": self.blocks.num_ids,
            "num_free_blocks": self.blocks.num_free,
            "num_state_slots": self.state_groups.num_ids,
            "num_free_state_slots": self.state_groups.num_free,
        }
