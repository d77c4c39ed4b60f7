"""A pool of ids with reference counts: KV blocks, and groups of recurrent-state slots (no torch).

An id is free when no one references it. ``allocate`` hands out free ids with one reference each; ``incref``
lets another holder share an id (prefix caching shares KV blocks this way); ``free`` drops one reference per
id and returns the ids whose count reached zero to the free list, in the order given.
"""

from collections import deque


class BlockPool:
    def __init__(self, num_ids: int, name: str = "block") -> None:
        self.num_ids = num_ids
        self.name = name
        self._free: deque[int] = deque(range(num_ids))
        self._ref_counts = [0] * num_ids

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"{self.name} pool: {n} needed, {len(self._free)} free")
        ids = [self._free.popleft() for _ in range(n)]
        for i in ids:
            self._ref_counts[i] = 1
        return ids

    def incref(self, ids: list[int]) -> None:
        for i in ids:
            if self._ref_counts[i] == 0:
                raise RuntimeError(f"{self.name} {i} is free: take it with allocate, not incref")
            self._ref_counts[i] += 1

    def free(self, ids: list[int]) -> None:
        for i in ids:
            if self._ref_counts[i] <= 0:
                raise RuntimeError(f"{self.name} {i} freed more often than it was taken")
            self._ref_counts[i] -= 1
            if self._ref_counts[i] == 0:
                self._free.append(i)

    def ref_count(self, i: int) -> int:
        return self._ref_counts[i]
