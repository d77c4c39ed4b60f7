"""Recurrent-state checkpoints for prefix caching on hybrid models (plain Python, no torch).

A GDN layer's state after ``P`` tokens (conv window + SSM state) summarises the whole prefix, so a request can
resume at ``P`` only from a copy of that state taken when some request stood exactly at ``P``. Checkpoints are such
copies, taken at block-aligned positions (so the KV blocks before ``P`` are full and shared), into slots of their
own: flat state slots ``first_slot .. first_slot + num_slots - 1`` of the same conv / SSM tensors as the requests'
groups (kv_cache/layout.py), so a save or a restore is one copy between two slots of each tensor.

Which positions get one (``is_checkpoint_position``): every multiple of ``interval`` (a block multiple), and the end
of the prompt, aligned down to a block: ``block_size * ((prompt_len - 1) // block_size)`` (the longest prefix the
same prompt can reuse: a request always computes its last prompt token) and ``block_size * (prompt_len //
block_size)`` (the longest a next turn that extends the prompt can reuse). The scheduler ends prefill chunks there.

A checkpoint is keyed by the key of the KV block that ends at its position (kv_cache/prefix_cache.py); when that
block is evicted the checkpoint goes too (``discard``), and checkpoints are evicted least recently used first when
the pool is full. Saves run on the device in the order they were handed out (the last save into a slot wins), all
before any restore of the same step, so a slot may be handed out again before its earlier save ran.
"""

from collections import OrderedDict

from truespec.kv_cache.prefix_cache import BlockKey


def is_checkpoint_position(position: int, prompt_len: int, interval: int, block_size: int) -> bool:
    if position <= 0 or position % block_size:
        return False
    return position % interval == 0 or position in prompt_end_positions(prompt_len, block_size)


def prompt_end_positions(prompt_len: int, block_size: int) -> tuple[int, int]:
    return block_size * ((prompt_len - 1) // block_size), block_size * (prompt_len // block_size)


def next_checkpoint_position(num_computed: int, prompt_len: int, interval: int, block_size: int) -> int:
    """The first checkpoint position after ``num_computed``."""
    candidates = [p for p in prompt_end_positions(prompt_len, block_size) if p > num_computed]
    return min([(num_computed // interval + 1) * interval, *candidates])


class StateCheckpoints:
    def __init__(self, num_slots: int, first_slot: int) -> None:
        self.num_slots, self.first_slot = num_slots, first_slot
        self._free = list(range(first_slot + num_slots - 1, first_slot - 1, -1))
        self._slot_of: OrderedDict[BlockKey, int] = OrderedDict()  # least recently used first
        self._key_at: dict[int, BlockKey] = {}

    @property
    def num_checkpoints(self) -> int:
        return len(self._slot_of)

    def get(self, key: BlockKey) -> int | None:
        return self._slot_of.get(key)

    def use(self, key: BlockKey) -> int:
        """The slot of ``key``'s checkpoint, now the most recently used."""
        self._slot_of.move_to_end(key)
        return self._slot_of[key]

    def add(self, key: BlockKey) -> int | None:
        """A slot to save ``key``'s checkpoint into (the least recently used one's if none is free); None if it is
        saved already or the pool has no slots."""
        if key in self._slot_of or self.num_slots == 0:
            return None
        if not self._free:
            self.discard(next(iter(self._slot_of)))
        slot = self._free.pop()
        self._slot_of[key], self._key_at[slot] = slot, key
        return slot

    def discard(self, key: BlockKey) -> None:
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            del self._key_at[slot]
            self._free.append(slot)

    def discard_slot(self, slot: int) -> None:
        if slot in self._key_at:
            self.discard(self._key_at[slot])

    def clear(self) -> None:
        for key in list(self._slot_of):
            self.discard(key)
