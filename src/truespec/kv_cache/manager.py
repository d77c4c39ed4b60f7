"""Who holds which KV blocks and which recurrent-state group, and what the prefix cache keeps (plain Python, no torch).

Attention layers keep K/V in paged blocks of ``block_size`` tokens; a request holds the blocks for its
positions ``0 .. n-1`` in order (its block table). GDN layers keep recurrent state in slots; a request holds
one *group* of ``slots_per_group = 1 + k`` consecutive slots while it runs: a verify of ``1 + d`` tokens
writes the state after each position into the group, and the engine records which slot holds the state
after the last accepted token (docs/ARCHITECTURE.md, invariant 2). Only the scheduler allocates and frees;
the runner and the drafters read the tables it hands them in its ``SchedulerOutput``.

With prefix caching (``PrefixSettings``) a request's full blocks are cached once computed (``cache_blocks``) and a
new request starts with the longest cached chain of its prompt (``find_prefix`` / ``take_prefix``); with recurrent
state only up to the longest such prefix that has a state checkpoint at its end (kv_cache/state_checkpoints.py,
slots after the groups'). Cached blocks no request uses count as free (``num_free_blocks``).
"""

from dataclasses import dataclass

from truespec.kv_cache.block_pool import BlockPool
from truespec.kv_cache.prefix_cache import ROOT_KEY, BlockKey, PrefixCache, block_keys
from truespec.kv_cache.state_checkpoints import StateCheckpoints


@dataclass(frozen=True)
class PrefixSettings:
    extra_tokens: int = 0  # token ids past a block its key covers (an MTP / EAGLE drafter's cache needs 1)
    num_checkpoints: int = 0  # recurrent-state checkpoint slots (hybrid models)
    needs_checkpoints: bool = False  # the model has recurrent state: a prefix is usable only up to a checkpoint
    checkpoint_interval: int = 0  # tokens between interval checkpoints (a block multiple)
    # a model drafter writes its KV of a step's positions after the step: a request that finishes in a step leaves
    # those positions without it, so they are not cached
    has_drafter_cache: bool = False


@dataclass(frozen=True)
class PrefixHit:
    num_tokens: int  # tokens the request need not compute
    block_ids: list[int]
    checkpoint_slot: int | None  # where its state after ``num_tokens`` is (recurrent state), else None


NO_HIT = PrefixHit(0, [], None)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, num_state_groups: int, slots_per_group: int,
                 prefix: PrefixSettings | None = None) -> None:
        self.block_size = block_size
        self.slots_per_group = slots_per_group
        self.blocks = BlockPool(num_blocks, "KV block")
        self.state_groups = BlockPool(num_state_groups, "state group")
        self._block_tables: dict[str, list[int]] = {}
        self._groups: dict[str, int] = {}
        self.prefix = prefix
        self.cache = self.checkpoints = None
        if prefix is not None:
            self.checkpoints = StateCheckpoints(prefix.num_checkpoints, num_state_groups * slots_per_group)
            self.cache = PrefixCache(self.blocks, on_evict=self.checkpoints.discard)
        self._keys: dict[str, list[BlockKey]] = {}  # per request: the keys of its blocks computed so far
        self._num_cached: dict[str, int] = {}  # per request: how many of its blocks are cached (or were looked at)
        self.num_queried_tokens = self.num_hit_tokens = 0  # vLLM's prefix_cache_queries / prefix_cache_hits

    # ---- KV blocks -----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks a request can get: never-cached free ones, and cached ones no request uses."""
        return self.blocks.num_free + (self.cache.num_evictable if self.cache is not None else 0)

    def block_ids(self, request_id: str) -> list[int]:
        return self._block_tables.get(request_id, [])

    def num_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Blocks to add so that the request's table covers positions ``0 .. num_tokens - 1``."""
        return max(0, -(-num_tokens // self.block_size) - len(self._block_tables.get(request_id, ())))

    def can_allocate(self, request_id: str, num_tokens: int, hit: PrefixHit = NO_HIT) -> bool:
        """Whether the table can cover ``num_tokens`` positions (after taking ``hit``'s blocks, for a new request)."""
        needed = self.num_blocks_needed(request_id, num_tokens) - len(hit.block_ids)
        if needed <= 0:  # the common decode: its table covers the step (free blocks never drop below ``taken``)
            return True
        taken = self.cache.num_evictable_in(hit.block_ids) if self.cache is not None else 0
        return needed <= self.num_free_blocks - taken

    def allocate(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow the request's block table to cover ``num_tokens`` positions; the table."""
        needed = self.num_blocks_needed(request_id, num_tokens)
        table = self._block_tables.setdefault(request_id, [])
        if needed:
            if self.cache is not None and needed > self.blocks.num_free:
                self.cache.evict(needed - self.blocks.num_free)
            table.extend(self.blocks.allocate(needed))
        return table

    # ---- prefix caching --------------------------------------------------------------------------
    def find_prefix(self, request_id: str, token_ids: list[int], root: BlockKey = ROOT_KEY) -> PrefixHit:
        """The longest cached prefix a new request with ``token_ids`` can start from (always leaving it at least one
        token to compute, so no shared block is ever written; with recurrent state, ending at a checkpoint). ``root``:
        its block keys' root (requests under different roots share nothing)."""
        if self.cache is None:
            return NO_HIT
        keys = self._keys_of(request_id, token_ids, (len(token_ids) - 1) // self.block_size, root)
        blocks = self.cache.match(keys)
        slot = None
        if self.prefix.needs_checkpoints:
            while blocks and (slot := self.checkpoints.get(keys[len(blocks) - 1])) is None:
                blocks.pop()
        return PrefixHit(len(blocks) * self.block_size, blocks, slot)

    def take_prefix(self, request_id: str, hit: PrefixHit, num_queried_tokens: int | None = None) -> None:
        """A new request starts from ``hit``: its table begins with those blocks (shared). ``num_queried_tokens``:
        count the lookup (its tokens and the hit's) in ``num_queried_tokens`` / ``num_hit_tokens``."""
        if num_queried_tokens is not None and self.cache is not None:
            self.num_queried_tokens += num_queried_tokens
            self.num_hit_tokens += hit.num_tokens
        if hit.block_ids:
            self.cache.take(hit.block_ids)
        if hit.checkpoint_slot is not None:
            self.checkpoints.use(self._keys[request_id][len(hit.block_ids) - 1])
        self._block_tables[request_id] = list(hit.block_ids)
        self._num_cached[request_id] = len(hit.block_ids)

    def cache_blocks(self, request_id: str, token_ids: list[int], num_computed: int, root: BlockKey = ROOT_KEY) -> None:
        """Cache the request's blocks whose positions are all computed (and whose key's tokens are known: the
        caller leaves out unknown ones)."""
        if self.cache is None:
            return
        num_full = min(num_computed, len(token_ids) - self.prefix.extra_tokens) // self.block_size
        done = self._num_cached.get(request_id, 0)
        if num_full <= done:
            return
        keys = self._keys_of(request_id, token_ids, num_full, root)
        table = self._block_tables[request_id]
        for b in range(done, num_full):
            self.cache.insert(keys[b], table[b])
        self._num_cached[request_id] = num_full

    def num_cached_blocks_of(self, request_id: str) -> int:
        return self._num_cached.get(request_id, 0)

    def add_checkpoint(self, request_id: str, position: int) -> int | None:
        """A slot to save the request's state after ``position`` tokens into, if that is worth keeping: its blocks
        are cached and no checkpoint of that prefix is. None: nothing to save."""
        b = position // self.block_size - 1
        if self.checkpoints is None or b >= self._num_cached.get(request_id, 0):
            return None
        key = self._keys[request_id][b]
        return self.checkpoints.add(key) if self.cache.contains(key) else None

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block and checkpoint (vLLM's ``reset_prefix_cache``); False while a request uses one
        (True without prefix caching: nothing is cached)."""
        if self.cache is None:
            return True
        if not self.cache.clear():
            return False
        self.checkpoints.clear()
        return True

    def _keys_of(self, request_id: str, token_ids: list[int], num_blocks: int, root: BlockKey) -> list[BlockKey]:
        num_blocks = min(num_blocks, (len(token_ids) - self.prefix.extra_tokens) // self.block_size)
        keys = self._keys.get(request_id, [])
        if len(keys) < num_blocks:
            keys = self._keys[request_id] = block_keys(token_ids, self.block_size, num_blocks,
                                                       self.prefix.extra_tokens, keys, root)
        return keys[:num_blocks]

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
        """Return everything the request holds (a no-op for one that holds nothing); its cached blocks stay cached."""
        table = self._block_tables.pop(request_id, [])
        if self.cache is None:
            self.blocks.free(table)
        else:
            self.cache.release(table)
        self._num_cached.pop(request_id, None)
        group = self._groups.pop(request_id, None)
        if group is not None:
            self.state_groups.free([group])

    def forget(self, request_id: str) -> None:
        """The request finished: drop its block keys too."""
        self.free(request_id)
        self._keys.pop(request_id, None)

    @property
    def num_state_slots(self) -> int:
        """State slots the device tensors hold: the groups', then the checkpoints'."""
        checkpoints = self.checkpoints.num_slots if self.checkpoints is not None else 0
        return self.state_groups.num_ids * self.slots_per_group + checkpoints

    def cache_info(self) -> dict[str, int]:
        return {
            "block_size": self.block_size,
            "num_blocks": self.blocks.num_ids,
            "num_free_blocks": self.num_free_blocks,
            "num_state_slots": self.state_groups.num_ids,
            "num_free_state_slots": self.state_groups.num_free,
            "num_cached_blocks": self.cache.num_cached_blocks if self.cache is not None else 0,
            "num_prefix_state_checkpoints": self.checkpoints.num_checkpoints if self.checkpoints is not None else 0,
            "num_prefix_state_slots": self.checkpoints.num_slots if self.checkpoints is not None else 0,
        }
