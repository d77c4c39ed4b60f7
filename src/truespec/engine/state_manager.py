"""Recurrent-state slots for the GDN layers (no torch).

A request holds one *group* of ``slots_per_group = 1 + k_max`` consecutive flat slots for as long
as it runs: a verify of ``1 + d`` tokens writes the state after each position into the group, and
``seq.state_index`` says which slot holds the state after the last accepted token (invariant 2).
"""

from collections import deque

from truespec.engine.sequence import Sequence


class StateManager:
    def __init__(self, num_groups: int, slots_per_group: int) -> None:
        self.num_groups = num_groups
        self.slots_per_group = slots_per_group
        self._free: deque[int] = deque(range(num_groups))

    @property
    def num_slots(self) -> int:
        return self.num_groups * self.slots_per_group

    @property
    def num_free_groups(self) -> int:
        return len(self._free)

    def can_allocate(self) -> bool:
        return len(self._free) > 0

    def allocate(self, seq: Sequence) -> None:
        if seq.state_group is not None:
            raise RuntimeError(f"{seq.request_id} already holds state group {seq.state_group}")
        seq.state_group = self._free.popleft()
        seq.state_index = 0

    def free(self, seq: Sequence) -> None:
        if seq.state_group is not None:
            self._free.append(seq.state_group)
        seq.state_group = None
        seq.state_index = 0

    def first_slot(self, seq: Sequence) -> int:
        assert seq.state_group is not None
        return seq.state_group * self.slots_per_group

    def current_slot(self, seq: Sequence) -> int:
        """Flat slot with the state after the last computed token, or -1 before any token."""
        if seq.num_computed_tokens == 0:
            return -1
        return self.first_slot(seq) + seq.state_index
