"""Write this step's K/V rows into the paged KV cache at ``slot_mapping`` (-1 = padding: no write)."""

import torch
import triton
import triton.language as tl

from truespec.kernels.triton_utils import pad_pow2


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr,  # [T, num_kv_heads, head_dim]
    v_ptr,  # [T, num_kv_heads, head_dim]
    kv_cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [T]
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_cache_kv,
    stride_cache_slot,  # flat slot = block * block_size + offset (blocks are contiguous)
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)  # int64
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    mask = (slot >= 0) & (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + token * stride_k_tok + h[:, None] * stride_k_head + d[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_v_tok + h[:, None] * stride_v_head + d[None, :], mask=mask)
    cache_ptrs = kv_cache_ptr + slot * stride_cache_slot + h[:, None] * stride_cache_head + d[None, :]
    tl.store(cache_ptrs, k.to(kv_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(cache_ptrs + stride_cache_kv, v.to(kv_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store k/v [T', num_kv_heads, head_dim] at ``slot_mapping`` [T] (T <= T'; rows with slot -1 write
    nothing) into ``kv_cache`` [2, num_blocks, block_size, num_kv_heads, head_dim], in place."""
    num_tokens = slot_mapping.shape[0]
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    if kv_cache.stride(1) != block_size * kv_cache.stride(2) or kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache blocks must be contiguous (flat slot = block * block_size + offset)")
    if k.shape[1:] != (num_kv_heads, head_dim) or v.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not fit kv_cache {tuple(kv_cache.shape)}")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v need a unit last stride")
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        k, v, kv_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=pad_pow2(num_kv_heads, 1), HEAD_DIM=head_dim,
        HEAD_DIM_PAD=pad_pow2(head_dim, 1),
    )  # fmt: skip

