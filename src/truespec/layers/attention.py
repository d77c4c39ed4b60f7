"""Causal attention over a paged KV cache (torch reference path, CPU and CUDA).

The runner binds ``PagedAttention.kv_cache`` (shape from ``kv_cache_shape``) before the first step.
Each step first writes this step's K/V at ``slot_mapping`` (-1 = skip), then every query token at
absolute position ``p = seq_len - query_len + i`` of request ``r`` attends keys ``0..p`` of that
request, gathered through ``block_tables[r]``. Drafted tokens' KV is written before it is read,
exactly as in a plain decode (invariant 4). Clarity over speed: one loop over requests.
"""

import torch
from torch import nn

from truespec.forward_context import ForwardContext, get_forward_context
from truespec.layers.backend import kernels, use_kernels
from truespec.layers.precision import compute_dtype


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store k/v rows [num_tokens, num_kv_heads, head_dim] at flat slots; rows with slot -1 write nothing."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    num_tokens = slot_mapping.shape[0]
    is_valid = slot_mapping >= 0
    slots = slot_mapping[is_valid]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k[:num_tokens][is_valid])
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v[:num_tokens][is_valid])


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of positions 0..seq_len-1 of one request: each [seq_len, num_kv_heads, head_dim]."""
    block_size, num_kv_heads, head_dim = kv_cache.shape[-3:]
    positions = torch.arange(seq_len, device=kv_cache.device)
    slots = block_table[positions // block_size] * block_size + positions % block_size
    keys = kv_cache[0].view(-1, num_kv_heads, head_dim)[slots]
    values = kv_cache[1].view(-1, num_kv_heads, head_dim)[slots]
    return keys, values


def causal_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, num_cached: int, scale: float
) -> torch.Tensor:
    """One request: q [query_len, num_heads, D] (positions num_cached..), keys/values [seq_len, num_kv_heads, D].

    Same operation order as transformers' eager attention: scores in the model dtype, softmax in the
    compute dtype, probabilities cast back, then P @ V. Returns [query_len, num_heads, D].
    """
    query_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads  # kv head j serves query heads j*group .. j*group+group-1
    keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
    values = values.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
    scores = torch.matmul(q.transpose(0, 1), keys.transpose(1, 2)) * scale  # [H, L, S]
    query_pos = num_cached + torch.arange(query_len, device=q.device)
    key_pos = torch.arange(seq_len, device=q.device)
    is_future = key_pos[None, :] > query_pos[:, None]  # [L, S]
    scores = scores.masked_fill(is_future, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=compute_dtype(q.dtype)).to(q.dtype)
    return torch.matmul(probs, values).transpose(0, 1)  # [L, H, D]


class PagedAttention(nn.Module):
    """The attention core every full-attention layer owns; it holds the layer's ``kv_cache``.

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim] in the model dtype (index 0 = K, 1 = V).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.kv_cache: torch.Tensor | None = None

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int]:
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, num_heads, D]; k, v: [T, num_kv_heads, D] (after norm + RoPE) -> [T, num_heads, D].
        # Rows past the context's tokens (padding) come back as zeros.
        if self.kv_cache is None:
            raise RuntimeError("PagedAttention.kv_cache is not bound: the model runner must bind it first")
        ctx = get_forward_context()
        if use_kernels(q):  # one Triton kernel for decode, verify and prefill rows (invariant 4)
            kernels().reshape_and_cache(k, v, self.kv_cache, ctx.slot_mapping)
            return kernels().paged_attention(q, self.kv_cache, ctx.query_start_loc, ctx.seq_lens, ctx.block_tables,
                                             self.scale)
        write_kv(self.kv_cache, k, v, ctx.slot_mapping)
        out = torch.zeros_like(q)
        for r in range(ctx.num_reqs):
            self._attend_request(ctx, r, q, out)
        return out

    def _attend_request(self, ctx: ForwardContext, r: int, q: torch.Tensor, out: torch.Tensor) -> None:
        start, end = ctx.query_start_loc_cpu[r], ctx.query_start_loc_cpu[r + 1]
        seq_len = ctx.seq_lens_cpu[r]
        if end == start:
            return
        if seq_len < end - start:
            raise ValueError(f"request {r}: seq_len {seq_len} < query_len {end - start}")
        keys, values = gather_kv(self.kv_cache, ctx.block_tables[r], seq_len)
        out[start:end] = causal_attention(q[start:end], keys, values, seq_len - (end - start), self.scale)

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
