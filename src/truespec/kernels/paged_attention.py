"""Paged causal attention for every query row of a step (decode, verify and chunked prefill alike).

One program per (query token, kv head): it serves that kv head's GQA group of query heads (padded
to 16 rows for ``tl.dot``) and loops over KV tiles 0, BLOCK_N, 2*BLOCK_N, ... up to the row's own
position, with online softmax in fp32 (fp64 for fp64). Nothing in a row's computation depends on
its request's query length or on the other rows of the batch, so a row gives bitwise the same
output as a plain decode and as a row of a 1+k verify (DESIGN.md invariant 4), and prefill rows use
the very same code.

Not done here (later, for speed only; none changes a row's math unless noted):
- split-KV (flash-decoding) for long contexts with few requests: programs (token, kv head, split)
  would each run this loop over a fixed range of tiles and emit (m, l, acc); a second pass combines
  them as ``m = max m_i; l = sum l_i e^(m_i - m); out = sum acc_i e^(m_i - m) / l``. The combine
  reorders the sums, so a split layout must be a function of the row's position only (never of the
  batch) to keep invariant 4.
- packing several query tokens of one request into a program's rows (K/V reuse for long prefills).
- FP8 / TurboQuant caches (the dequantise step slots in where K and V tiles are loaded).
"""

import torch
import triton
import triton.language as tl

from truespec.kernels.triton_utils import (
    find_request,
    mma,
    needs_dot_upcast,
    pad_pow2,
    reduce_max,
    reduce_sum,
    tl_compute_dtype,
)
from truespec.layers.attention import causal_attention, gather_kv


@triton.jit(do_not_specialize=["num_reqs"])  # one binary for every batch (no num_reqs == 1 variant)
def _paged_attention_kernel(
    out_ptr,  # [T, num_heads, head_dim]
    q_ptr,  # [T, num_heads, head_dim]
    kv_cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc_ptr,  # [R + 1]
    seq_lens_ptr,  # [R]
    block_tables_ptr,  # [R, max_blocks]
    num_reqs,
    scale: tl.float64,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_bt_req,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # KV cache block size (tokens per block)
    BLOCK_N: tl.constexpr,  # keys per tile
    ACC_DTYPE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    r = find_request(query_start_loc_ptr, num_reqs, token)
    q_start = tl.load(query_start_loc_ptr + r)
    q_end = tl.load(query_start_loc_ptr + r + 1)
    is_valid = token < tl.load(query_start_loc_ptr + num_reqs)  # rows past the last request are padding
    position = tl.load(seq_lens_ptr + r) - (q_end - q_start) + (token - q_start)
    num_keys = tl.where(is_valid, position + 1, 0)  # causal: keys 0..position

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * GROUP + g
    q_mask = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + token * stride_q_tok + heads[:, None] * stride_q_head + d[None, :], mask=q_mask, other=0.0)
    scale_acc = tl.full([], scale, ACC_DTYPE)

    m = tl.full([GROUP_PAD], float("-inf"), ACC_DTYPE)  # running max of the scaled scores
    l = tl.full([GROUP_PAD], 0, ACC_DTYPE)  # running sum of exp(score - m)
    acc = tl.full([GROUP_PAD, HEAD_DIM_PAD], 0, ACC_DTYPE)
    cache_head_ptr = kv_cache_ptr + kv_head * stride_cache_head
    for tile_start in range(0, num_keys, BLOCK_N):
        n = tile_start + tl.arange(0, BLOCK_N)
        n_mask = n < num_keys
        blocks = tl.load(block_tables_ptr + r * stride_bt_req + n // BLOCK_SIZE, mask=n_mask, other=0)
        slot_off = blocks * stride_cache_block + (n % BLOCK_SIZE) * stride_cache_slot  # [BLOCK_N] int64
        kv_off = slot_off[:, None] + d[None, :]
        kv_mask = n_mask[:, None] & (d[None, :] < HEAD_DIM)
        k = tl.load(cache_head_ptr + kv_off, mask=kv_mask, other=0.0)  # [BLOCK_N, HEAD_DIM_PAD]
        s = mma(q, tl.trans(k), UPCAST) * scale_acc  # [GROUP_PAD, BLOCK_N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, reduce_max(s, 1))  # finite: every tile holds a key <= position
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + reduce_sum(p, 1)
        v = tl.load(cache_head_ptr + stride_cache_kv + kv_off, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, UPCAST)
        m = m_new

    out = acc / tl.where(l > 0, l, 1.0)[:, None]  # padding rows: acc = 0, l = 0 -> 0
    o_ptrs = out_ptr + token * stride_o_tok + heads[:, None] * stride_o_head + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    block_n: int = 32,
) -> torch.Tensor:
    """Causal attention of q [T, num_heads, head_dim] over the paged ``kv_cache``
    [2, num_blocks, block_size, num_kv_heads, head_dim]; query token i of request r sits at position
    ``seq_lens[r] - query_len + i``. Rows past ``query_start_loc[-1]`` (padding) come back as zeros.
    No host sync and no shape derived from the batch content: safe inside a captured CUDA graph.
    Returns ``out`` [T, num_heads, head_dim] (allocated if None)."""
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads != 0 or q.stride(-1) != 1:
        raise ValueError(f"q {tuple(q.shape)} (unit last stride) does not fit kv_cache {tuple(kv_cache.shape)}")
    if kv_cache.stride(-1) != 1 or q.dtype != kv_cache.dtype:
        raise ValueError("kv_cache needs a unit last stride and q's dtype")
    out = torch.empty_like(q) if out is None else out
    if seq_lens.shape[0] == 0:
        return out.zero_()
    group = num_heads // num_kv_heads
    group_pad, head_dim_pad = pad_pow2(group), pad_pow2(head_dim)
    grid = (num_tokens, num_kv_heads)
    _paged_attention_kernel[grid](
        out, q, kv_cache, query_start_loc, seq_lens, block_tables, seq_lens.shape[0], scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_tables.stride(0),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, GROUP=group, GROUP_PAD=group_pad,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, ACC_DTYPE=tl_compute_dtype(q.dtype),
        UPCAST=needs_dot_upcast(q.dtype), num_warps=8 if group_pad * head_dim_pad >= 4096 else 4,
    )  # fmt: skip
    return out


def paged_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The torch reference (``layers/attention.py``'s per-request loop), same signature and result."""
    out = torch.zeros_like(q)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for r, seq_len in enumerate(lens):
        start, end = qsl[r], qsl[r + 1]
        if end > start:
            keys, values = gather_kv(kv_cache, block_tables[r], seq_len)
            out[start:end] = causal_attention(q[start:end], keys, values, seq_len - (end - start), scale)
    return out
