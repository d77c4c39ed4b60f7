"""A queued speculative step's per-request updates in one launch each (torch references: ops/spec_step.py).

One program per request walks its few query tokens (1 + k) with scalar loads: the work is tiny, and what these
replace is a dozen small torch launches per forward on the host's critical path."""

import torch
import triton
import triton.language as tl


@triton.jit
def _move_positions_kernel(positions_ptr, seq_lens_ptr, state_src_ptr, slot_mapping_ptr, block_tables_ptr,
                           query_start_loc_ptr, shift_ptr, width, stride_table, block_size):
    r = tl.program_id(0)
    shift = tl.load(shift_ptr + r)
    tl.store(seq_lens_ptr + r, tl.load(seq_lens_ptr + r) + shift)
    src = tl.load(state_src_ptr + r)
    tl.store(state_src_ptr + r, tl.where(src >= 0, src + shift, src))
    for t in range(tl.load(query_start_loc_ptr + r), tl.load(query_start_loc_ptr + r + 1)):
        position = tl.load(positions_ptr + t) + shift
        tl.store(positions_ptr + t, position)
        column = position // block_size
        block = tl.load(block_tables_ptr + r * stride_table + column, mask=column < width, other=-1)
        tl.store(slot_mapping_ptr + t, tl.where(block >= 0, block * block_size + position % block_size, -1))


def move_positions(positions: torch.Tensor, seq_lens: torch.Tensor, state_src: torch.Tensor,
                   slot_mapping: torch.Tensor, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                   shift: torch.Tensor, num_tokens: int, block_size: int) -> None:
    """``ops.spec_step.move_positions_ref``, in place (``num_tokens``: unused, the query ends say it)."""
    num_reqs = len(shift)
    if num_reqs:
        _move_positions_kernel[(num_reqs,)](positions, seq_lens, state_src, slot_mapping, block_tables,
                                            query_start_loc, shift, block_tables.shape[1], block_tables.stride(0),
                                            block_size)


@triton.jit
def _greedy_accepted_kernel(argmax_ptr, input_ids_ptr, query_start_loc_ptr, num_accepted_ptr, next_token_ptr):
    r = tl.program_id(0)
    start = tl.load(query_start_loc_ptr + r)
    num_drafts = tl.load(query_start_loc_ptr + r + 1) - start - 1
    num_accepted = num_drafts * 0
    is_run = num_drafts >= 0  # still inside the leading run of matches
    for j in range(0, num_drafts):
        is_run = is_run & (tl.load(argmax_ptr + start + j) == tl.load(input_ids_ptr + start + j + 1))
        num_accepted += is_run.to(num_accepted.dtype)
    tl.store(num_accepted_ptr + r, num_accepted)
    tl.store(next_token_ptr + r, tl.load(argmax_ptr + start + num_accepted))


def greedy_accepted(argmax: torch.Tensor, input_ids: torch.Tensor, query_start_loc: torch.Tensor,
                    max_drafts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``ops.spec_step.greedy_accepted_ref`` (``max_drafts``: unused, each request's query length says it)."""
    num_reqs = len(query_start_loc) - 1
    num_accepted = torch.empty(num_reqs, dtype=torch.int64, device=argmax.device)
    next_token = torch.empty(num_reqs, dtype=argmax.dtype, device=argmax.device)
    if num_reqs:
        _greedy_accepted_kernel[(num_reqs,)](argmax, input_ids, query_start_loc, num_accepted, next_token)
    return num_accepted, next_token
