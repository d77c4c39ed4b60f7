"""A queued speculative step's per-request updates in one launch each (torch references: ops/spec_step.py).

One program per request walks its few query tokens (1 + k) with scalar loads: the work is tiny, and what these
replace is a dozen small torch launches per forward on the host's critical path. ``chain_metadata`` is one
program for a whole drafting chain's metadata (every forward of it), which inside the chain's CUDA graph replaces
some ninety tiny kernels."""

import torch
import triton
import triton.language as tl

from truespec.ops.spec_step import ChainMetadata


@triton.jit
def _kv_slot(tables_ptr, row, position, is_held, width, stride_table, block_size):
    """The flat KV slot of ``position`` in block-table row ``row`` (``ops.spec_step.kv_slots_on_device``): -1 past
    the table's columns, at a -1 cell, or where not ``is_held``."""
    column = position // block_size
    block = tl.load(tables_ptr + row * stride_table + column, mask=is_held & (column < width), other=-1)
    return tl.where(block >= 0, block * block_size + position % block_size, -1)


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
        tl.store(slot_mapping_ptr + t, _kv_slot(block_tables_ptr, r, position, True, width, stride_table, block_size))


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


@triton.jit
def _chain_metadata_kernel(argmax_ptr, input_ids_ptr, positions_ptr, qsl_ptr, tables_ptr, num_reqs_ptr,
                           step_qsl_ptr, chain_qsl_ptr, accepted_ptr, next_token_ptr, hidden_rows_ptr, seq_lens_ptr,
                           slots_ptr, draft_positions_ptr, draft_seq_lens_ptr, draft_slots_ptr, size, num_rows,
                           width, stride_table, stride_draft, block_size, K: tl.constexpr, BLOCK_R: tl.constexpr,
                           BLOCK_T: tl.constexpr):
    """One program: requests as one vector of BLOCK_R >= size + 1 lanes (lane r: query edge r, request r), the
    catch-up's tokens as one of BLOCK_T >= size * (1 + K) (their requests found by a loop over the query ends)."""
    num_reqs = tl.load(num_reqs_ptr)
    end = tl.load(qsl_ptr + num_reqs)  # the step's token count
    r = tl.arange(0, BLOCK_R)
    is_edge, is_req, is_real = r <= size, r < size, r < num_reqs
    first = tl.where(r <= num_reqs, tl.load(qsl_ptr + r, mask=is_edge & (r <= num_reqs), other=0), end)
    tl.store(step_qsl_ptr + r, first, mask=is_edge)
    tl.store(chain_qsl_ptr + r, tl.minimum(r, num_reqs), mask=is_edge)
    has_next = (r + 1 <= size) & (r + 1 <= num_reqs)
    num_rows_r = tl.where(has_next, tl.load(qsl_ptr + r + 1, mask=has_next, other=0), end) - first
    accepted = tl.full([BLOCK_R], 0, tl.int64)
    is_run = is_req
    for j in tl.static_range(K):  # draft j is row first + j + 1, checked by the argmax of row first + j
        is_draft = is_req & (j < num_rows_r - 1)
        target = tl.load(argmax_ptr + first + j, mask=is_draft, other=0)
        draft = tl.load(input_ids_ptr + first + j + 1, mask=is_draft, other=0)
        is_run = is_run & is_draft & (target == draft)
        accepted += is_run.to(tl.int64)
    row = first + accepted
    tl.store(accepted_ptr + r, accepted, mask=is_req)
    tl.store(hidden_rows_ptr + r, row, mask=is_req)
    tl.store(next_token_ptr + r, tl.load(argmax_ptr + row, mask=is_req & (row < num_rows), other=0), mask=is_req)
    start = tl.load(positions_ptr + first, mask=is_req, other=0)
    tl.store(seq_lens_ptr + r, tl.where(is_real, start + tl.maximum(num_rows_r - 1, 0) + 1, 0), mask=is_req)
    for j in tl.static_range(1, K):
        at = start + accepted + j
        slot = _kv_slot(tables_ptr, r, at, is_real, width, stride_table, block_size)
        tl.store(draft_positions_ptr + (j - 1) * stride_draft + r, at, mask=is_req)
        tl.store(draft_seq_lens_ptr + (j - 1) * stride_draft + r, tl.where(is_real, at + 1, 0), mask=is_req)
        tl.store(draft_slots_ptr + (j - 1) * stride_draft + r, slot, mask=is_req)
    # the catch-up: token t's request is the number of query ends (edges 1 .. size) at or before t
    t = tl.arange(0, BLOCK_T)
    is_token = t < size * (K + 1)
    owner = tl.full([BLOCK_T], 0, tl.int32)
    for e in range(1, size + 1):  # a loop, not a [tokens, requests] matrix: registers stay O(BLOCK_T)
        edge = tl.where(e <= num_reqs, tl.load(qsl_ptr + e, mask=e <= num_reqs, other=0), end)
        owner += (edge <= t).to(tl.int32)
    owner = tl.minimum(owner, size - 1)
    position = tl.load(positions_ptr + t, mask=is_token, other=0)
    slot = _kv_slot(tables_ptr, owner, position, is_token & (t < end), width, stride_table, block_size)
    tl.store(slots_ptr + t, slot, mask=is_token)


def chain_metadata(argmax: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                   query_start_loc: torch.Tensor, tables: torch.Tensor, num_reqs: torch.Tensor, size: int, k: int,
                   block_size: int, out: ChainMetadata) -> None:
    """``ops.spec_step.chain_metadata_ref`` in one launch (block sizes from ``out``'s capacity, so every request
    count shares one compiled kernel)."""
    top = len(out.accepted)
    _chain_metadata_kernel[(1,)](
        argmax, input_ids, positions, query_start_loc, tables, num_reqs, out.step_qsl, out.chain_qsl, out.accepted,
        out.next_token, out.hidden_rows, out.seq_lens, out.slots, out.draft_positions, out.draft_seq_lens,
        out.draft_slots, size, argmax.numel(), tables.shape[1], tables.stride(0), out.draft_positions.stride(0),
        block_size, K=k, BLOCK_R=triton.next_power_of_2(top + 1), BLOCK_T=triton.next_power_of_2(top * (1 + k)))
