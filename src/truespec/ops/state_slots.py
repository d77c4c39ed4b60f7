"""The recurrent-state slot protocol (forward_context.py), in torch: where a request's state comes from and
which slots keep it.

Request r starts from slot ``state_src[r]`` (-1: zeros) and, after each query token t >= state_write_start[r],
keeps its state in slot ``state_dst[r] + t - state_write_start[r]``; ``state_dst == -1`` keeps nothing
(docs/ARCHITECTURE.md invariants 2 and 3). Every source is read before any slot is written, so a source inside
the request's own destination group (a verify restarting from a slot it overwrites) is read intact. The GDN
references (conv windows, recurrent states) and the chunked prefill path all read the protocol from here.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateSlots:
    """Host copies of a step's per-request state metadata."""

    query_start_loc: list[int]  # [R + 1]: request r owns token rows [qsl[r], qsl[r + 1])
    state_src: list[int]  # [R]
    state_dst: list[int]  # [R]
    state_write_start: list[int]  # [R]

    @classmethod
    def from_tensors(
        cls,
        query_start_loc: torch.Tensor,
        state_src: torch.Tensor,
        state_dst: torch.Tensor,
        state_write_start: torch.Tensor,
    ) -> "StateSlots":
        """Reads the four metadata tensors back to the host."""
        return cls(*(t.tolist() for t in (query_start_loc, state_src, state_dst, state_write_start)))

    @property
    def num_reqs(self) -> int:
        return len(self.state_src)

    def rows(self, r: int) -> slice:
        """Request r's token rows."""
        return slice(self.query_start_loc[r], self.query_start_loc[r + 1])

    def query_len(self, r: int) -> int:
        return self.query_start_loc[r + 1] - self.query_start_loc[r]

    def kept_slot(self, r: int, t: int) -> int | None:
        """The slot that keeps request r's state after its query token t; None where that state is not kept."""
        dst, write_start = self.state_dst[r], self.state_write_start[r]
        return dst + t - write_start if dst >= 0 and t >= write_start else None


def gather_states(states: torch.Tensor, src: list[int]) -> torch.Tensor:
    """A copy of slots ``src`` of ``states`` [num_slots, ...]: [len(src), ...], zeros where the slot is -1."""
    return SlotGather.of(src)(states)


@dataclass(frozen=True)
class SlotGather:
    """``gather_states`` for one list of source slots, its index tensors built once: a step's layers all gather
    from the same slots (ops/gdn_batched.StepRows keeps one per step)."""

    index: torch.Tensor | None  # [R] slot per row (-1 read as slot 0, then zeroed); None: every slot is -1
    is_zero: torch.Tensor | None  # [R] bool, the rows whose slot is -1; None when no slot is
    num_rows: int

    @classmethod
    def of(cls, src: list[int]) -> "SlotGather":
        if not any(s >= 0 for s in src):
            return cls(None, None, len(src))
        is_zero = torch.tensor([s < 0 for s in src]) if min(src) < 0 else None
        return cls(torch.tensor([max(s, 0) for s in src], dtype=torch.long), is_zero, len(src))

    def __call__(self, states: torch.Tensor) -> torch.Tensor:
        """[R, ...]: a copy of each row's slot of ``states``, zeros for slot -1."""
        if self.index is None:
            return torch.zeros(self.num_rows, *states.shape[1:], dtype=states.dtype, device=states.device)
        gathered = states.index_select(0, self.index.to(states.device))
        if self.is_zero is not None:  # masked_fill_, not a boolean index: that would read the mask on the host
            gathered.masked_fill_(self.is_zero.to(states.device).view(-1, *[1] * (gathered.dim() - 1)), 0)
        return gathered
