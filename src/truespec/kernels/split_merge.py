"""The split layout of a query row and the merge of its splits: the two halves of split-KV attention that do not
read the cache (kernels/paged_attention.py runs the splits themselves).

Split layout, the rule that keeps docs/ARCHITECTURE.md invariant 4: a row with ``num_keys`` keys (position + 1) uses
``split_size = round_up(max(MIN_SPLIT_KEYS, cdiv(num_keys, MAX_SPLITS)), BLOCK_N)`` keys per split and
``num_splits = cdiv(num_keys, split_size)`` (<= MAX_SPLITS) splits: one split per MIN_SPLIT_KEYS keys until the cap
MAX_SPLITS, after which the splits grow instead, by whole tiles: a split then holds ``ceil(num_tiles /
MAX_SPLITS)`` tiles (the last one may hold fewer), the shortest chain of dependent tiles any layout of at most
MAX_SPLITS tile-aligned splits allows, which is what bounds a row's latency when few rows run. The count itself may
then fall below the cap (8,215 keys at cap 128: 257 tiles, 86 splits of 3). A larger cap changes only rows of more
than ``16 * MIN_SPLIT_KEYS`` keys against the former cap of 16 (1,024 keys at the defaults), and gives a 32K-key
row MAX_SPLITS splits of ``32768 / MAX_SPLITS`` keys. The layout is a function of ``num_keys`` and the
compile-time constants only (``row_layout``; its torch twin is ``ops.attention.split_layout``).

The merge, one program per (row, query head, MERGE_DIM output dims): ``m = max m_i`` and
``l = sum l_i e^(m_i - m)`` over all SPLITS_PAD slots of the row at once (one scalar per slot; slots past
``num_splits`` add exact zeros), then ``acc = sum acc_i e^(m_i - m)`` in groups of MERGE_SPLITS slots taken in slot
order, each group one fixed reduction tree over its [MERGE_SPLITS, MERGE_DIM] tile, and ``out = acc / l``. The
order of every sum depends on ``num_splits`` and the constants only, and a program holds one group's tile, not all
of a row's splits: at 128 splits of 256 dims the former single [SPLITS_PAD, HEAD_DIM] tile would take 256 fp32
registers a thread. Splitting the dims over programs gives the merge more programs at batch size 1 (8 heads x 4);
MERGE_SPLITS / MERGE_DIM / its warps are constants of kernels/paged_attention.py, not yet tuned on a GPU.
"""

import triton
import triton.language as tl

from truespec.kernels.triton_utils import find_request, reduce_max, reduce_sum


@triton.jit
def row_layout(query_start_loc_ptr, seq_lens_ptr, num_reqs, token, BLOCK_N: tl.constexpr,
               MAX_SPLITS: tl.constexpr, MIN_SPLIT_KEYS: tl.constexpr):  # fmt: skip
    """(request, num_keys, split_size, num_splits) of packed row ``token``: 0 keys and one empty split for
    padding rows. ``ops.attention.split_layout``'s rule, from ``num_keys`` and the constants only."""
    r = find_request(query_start_loc_ptr, num_reqs, token)
    q_start = tl.load(query_start_loc_ptr + r)
    q_end = tl.load(query_start_loc_ptr + r + 1)
    is_valid = token < tl.load(query_start_loc_ptr + num_reqs)  # rows past the last request are padding
    position = tl.load(seq_lens_ptr + r) - (q_end - q_start) + (token - q_start)
    num_keys = tl.where(is_valid, position + 1, 0)  # causal: keys 0..position
    split_size = tl.maximum((num_keys + MAX_SPLITS - 1) // MAX_SPLITS, MIN_SPLIT_KEYS)
    split_size = (split_size + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    num_splits = tl.maximum((num_keys + split_size - 1) // split_size, 1)
    return r, num_keys, split_size, num_splits


@triton.jit
def prompt_row(query_start_loc_ptr, num_prompt_rows_ptr, skip_prompt_rows, r, token):
    """Whether packed row ``token`` of request ``r`` is one of the request's leading ``num_prompt_rows[r]`` rows,
    which the prefill kernel computes (kernels/step_attention.py; only with ``skip_prompt_rows``; padding rows
    never are)."""
    offset = token - tl.load(query_start_loc_ptr + r)
    return (skip_prompt_rows != 0) & (offset < tl.load(num_prompt_rows_ptr + r))


@triton.jit(do_not_specialize=["num_reqs", "row_offset", "ws_splits", "skip_prompt_rows"])
def combine_splits_kernel(
    out_ptr,  # [T, num_heads, head_dim]
    ws_m_ptr,  # [chunk, num_heads, ws_splits]
    ws_l_ptr,  # [chunk, num_heads, ws_splits]
    ws_acc_ptr,  # [chunk, num_heads, ws_splits, HEAD_DIM]
    query_start_loc_ptr,  # [R + 1]
    seq_lens_ptr,  # [R]
    num_prompt_rows_ptr,  # [R] (read only with skip_prompt_rows)
    num_reqs,
    row_offset,
    ws_splits,
    skip_prompt_rows,
    stride_o_tok,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # next_power_of_2(MAX_SPLITS)
    MIN_SPLIT_KEYS: tl.constexpr,
    MERGE_SPLITS: tl.constexpr,  # split slots per step of the acc loop (<= SPLITS_PAD)
    MERGE_DIM: tl.constexpr,  # output dims per program
):
    """Program (row, head, dims): merges the row's splits 0..num_splits-1 into ``out`` (module docstring); rows
    of one split (already written by the first kernel) and the prefill kernel's rows store nothing."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    token = row_offset + row
    r, _, _, num_splits = row_layout(query_start_loc_ptr, seq_lens_ptr, num_reqs, token, BLOCK_N, MAX_SPLITS,
                                     MIN_SPLIT_KEYS)  # fmt: skip
    if (num_splits == 1) | prompt_row(query_start_loc_ptr, num_prompt_rows_ptr, skip_prompt_rows, r, token):
        return

    ws_head = (row * tl.num_programs(1) + head) * ws_splits  # the (row, head)'s split slot 0
    s = tl.arange(0, SPLITS_PAD)
    m_i = tl.load(ws_m_ptr + ws_head + s, mask=s < num_splits, other=float("-inf"))
    l_i = tl.load(ws_l_ptr + ws_head + s, mask=s < num_splits, other=0.0)
    m = reduce_max(m_i, 0)  # finite: split 0 holds keys
    l = reduce_sum(l_i * tl.exp(m_i - m), 0)
    g = tl.arange(0, MERGE_SPLITS)
    d = tl.program_id(2) * MERGE_DIM + tl.arange(0, MERGE_DIM)
    acc = tl.full([MERGE_DIM], 0, ws_acc_ptr.dtype.element_ty)
    for first in range(0, num_splits, MERGE_SPLITS):  # groups in slot order
        slot = first + g
        s_mask = slot < num_splits
        w = tl.exp(tl.load(ws_m_ptr + ws_head + slot, mask=s_mask, other=float("-inf")) - m)  # 0 past num_splits
        acc_mask = s_mask[:, None] & (d[None, :] < HEAD_DIM)
        acc_i = tl.load(ws_acc_ptr + (ws_head + slot)[:, None] * HEAD_DIM + d[None, :], mask=acc_mask, other=0.0)
        acc += reduce_sum(acc_i * w[:, None], 0)  # [MERGE_DIM]
    out = acc / tl.where(l > 0, l, 1.0)
    o_ptrs = out_ptr + token * stride_o_tok + head * stride_o_head + d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def merge_grid_and_tile(num_rows: int, num_heads: int, head_dim: int, max_splits: int, merge_splits: int,
                        merge_dim: int) -> tuple[tuple[int, int, int], dict[str, int]]:  # fmt: skip
    """The merge kernel's grid for ``num_rows`` rows, from shapes only, and its tile constants (SPLITS_PAD,
    MERGE_SPLITS, MERGE_DIM), each a power of two: merge_splits / merge_dim clipped to the padded split count and
    head_dim."""
    splits_pad = triton.next_power_of_2(max_splits)
    dims = min(triton.next_power_of_2(merge_dim), triton.next_power_of_2(head_dim))
    tile = dict(SPLITS_PAD=splits_pad, MERGE_SPLITS=min(triton.next_power_of_2(merge_splits), splits_pad),
                MERGE_DIM=dims)  # fmt: skip
    return (num_rows, num_heads, triton.cdiv(head_dim, dims)), tile
