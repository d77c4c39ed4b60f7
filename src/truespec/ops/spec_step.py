"""Per-request updates of a queued speculative step, on the device (references for kernels/spec_step.py).

- ``move_positions_ref``: a step planned before the previous step's accepted counts were read moves request r's
  query ``shift[r]`` positions further: positions, context length and state source (when it has one) move by the
  shift, and each token's KV slot is looked up again in the block table (-1 past the request's blocks).
- ``greedy_accepted_ref``: a greedy verify accepts draft j while it equals the target's argmax of the row before
  it: the accepted count is the length of that leading run, and the next token is the argmax of the row after
  the last accepted draft (the rules of ``layers/rejection_sampler.greedy_verify``).
"""

import torch


def move_positions_ref(positions: torch.Tensor, seq_lens: torch.Tensor, state_src: torch.Tensor,
                       slot_mapping: torch.Tensor, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                       shift: torch.Tensor, num_tokens: int, block_size: int) -> None:
    """In place. positions / slot_mapping [>= T]; seq_lens / state_src [>= R]; block_tables [>= R, width];
    query_start_loc [R + 1]; shift [R]."""
    num_reqs = len(shift)
    request = torch.repeat_interleave(torch.arange(num_reqs, device=shift.device), query_start_loc.diff(),
                                      output_size=num_tokens)  # [T]: each query token's request
    moved = positions[:num_tokens]
    moved += shift[request]
    seq_lens[:num_reqs] += shift
    src = state_src[:num_reqs]
    src += torch.where(src >= 0, shift, 0)
    slot_mapping[:num_tokens] = kv_slots_on_device(block_tables[:num_reqs], request, moved, block_size)


def kv_slots_on_device(tables: torch.Tensor, request: torch.Tensor, positions: torch.Tensor, block_size: int,
                       is_real: torch.Tensor | None = None) -> torch.Tensor:
    """The flat KV slot of each token [T] at ``positions`` [T] of request ``request`` [T], looked up in the block
    ``tables`` [R, width]: -1 past a request's blocks (a column beyond the table or a -1 cell) and where
    ``is_real`` [T] is False."""
    column = positions // block_size
    block = tables[request, column.clamp(max=tables.shape[1] - 1)]
    is_held = (column < tables.shape[1]) & (block >= 0)
    if is_real is not None:
        is_held &= is_real
    return torch.where(is_held, block * block_size + positions % block_size, -1)


def greedy_accepted_ref(argmax: torch.Tensor, input_ids: torch.Tensor, query_start_loc: torch.Tensor,
                        max_drafts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per request r (query rows qsl[r] .. qsl[r + 1] - 1, drafts after the first): accepted drafts [R] and next
    token [R], from the step's argmax [T] and input ids [T]; ``max_drafts``: the most drafts of any request."""
    starts, lens = query_start_loc[:-1], query_start_loc.diff()
    j = torch.arange(max_drafts, device=argmax.device)
    rows = (starts[:, None] + j).clamp(max=max(len(argmax) - 2, 0))  # [R, k]: the row that checks draft j
    is_draft = j < (lens - 1)[:, None]
    has_drafts = max_drafts and len(argmax) > 1
    match = (argmax[rows] == input_ids[rows + 1]) & is_draft if has_drafts else is_draft
    num_accepted = match.long().cumprod(dim=1).sum(dim=1)
    return num_accepted, argmax[starts + num_accepted]
