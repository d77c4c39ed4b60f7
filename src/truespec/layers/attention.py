"""Causal attention over a paged KV cache: Triton kernels on CUDA, ``ops/attention.py`` elsewhere.

The runner binds ``PagedAttention.kv_cache`` (shape from ``kv_cache_shape``) before the first step.
Each step first writes this step's K/V at ``slot_mapping`` (-1 = skip), then every query token at
absolute position ``p = seq_len - query_len + i`` of request ``r`` attends keys ``0..p`` of that
request, gathered through ``block_tables[r]``. Drafted tokens' KV is written before it is read,
exactly as in a plain decode (invariant 4). On CUDA a row at a prompt position (``ForwardContext.num_prompt_rows``)
goes to the prefill kernel, every other row to the split-KV kernel (kernels/step_attention.py).
"""

import functools

import torch
from torch import nn

from truespec.cpu_kernels import attention as cpu_attention
from truespec.forward_context import ForwardContext, get_forward_context
from truespec.layers.backend import kernels, use_kernels
from truespec.ops.attention import (
    SlotDecoder,
    SparseV,
    paged_attention_ref,
    reshape_and_cache_ref,
    store_packed_ref,
)
from truespec.ops.attention_batched import paged_attention_batched
from truespec.ops.attention_rows import StepAttentionRows


class PagedAttention(nn.Module):
    """The attention core every full-attention layer owns; it holds the layer's ``kv_cache``.

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim] in the model dtype (index 0 = K, 1 = V), or,
    with a compressed ``kv_format`` (kv_cache/formats.py, bound with the cache), uint8 [num_blocks, block_size,
    num_kv_heads, bytes per token]: each slot encoded on store (kernels/kv_store_packed.py) and read straight from
    its bytes (kernels/paged_attention_packed.py); fp64 models and CPU runs use the torch reference
    (``KVFormat.encode`` / ``decode``). ``sparse_v`` (bound with the cache): the sparse-V tile skip, the same rule
    in the kernels and the reference (ops/attention.py ``tiled_attention``).
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
        self.kv_format = None  # KVFormat of a compressed cache (encode / decode), None: the model dtype
        self.sparse_v: SparseV | None = None  # None: every tile's values are read

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int]:
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, num_heads, D]; k, v: [T, num_kv_heads, D] (after norm + RoPE) -> [T, num_heads, D].
        # Rows past the context's tokens (padding) come back as zeros.
        if self.kv_cache is None:
            raise RuntimeError("PagedAttention.kv_cache is not bound: the model runner must bind it first")
        ctx = get_forward_context()
        meta = (ctx.query_start_loc, ctx.seq_lens, ctx.block_tables)
        skip = {} if self.sparse_v is None else dict(sparse_v_threshold=self.sparse_v.threshold,
                                                     sparse_v_min_keys=self.sparse_v.min_keys)
        if use_kernels(q) and (q.dtype != torch.float64 or self.kv_format is None):  # fp64 packed: see below
            if self.kv_format is None:
                kernels().reshape_and_cache(k, v, self.kv_cache, ctx.slot_mapping)
            else:
                kernels().store_packed(k, v, self.kv_cache, ctx.slot_mapping, self.kv_format)
            # prompt rows by the prefill kernel, decode / verify rows split-KV (kernels/step_attention.py); fp64
            # keeps the split kernel for every row, as before (the prefill kernel is built for 16-bit / fp32 on CUDA)
            prompt_rows = ctx.num_prompt_rows if q.dtype != torch.float64 else None
            return kernels().step_attention(q, self.kv_cache, *meta, self.scale, prompt_rows, fmt=self.kv_format,
                                            is_prompt_only=ctx.is_prompt_only, **skip)
        # the torch path (CPU, TRUESPEC_BACKEND=torch, fp64 over a packed cache, whose reads do not compile on CUDA:
        # kernels/paged_attention_packed.py) computes every row the same way, prompt rows included
        if self.kv_format is not None:
            num_tokens = ctx.slot_mapping.shape[0]
            store_packed_ref(self.kv_format.encode(k[:num_tokens], v[:num_tokens]), self.kv_cache, ctx.slot_mapping)
            decode = functools.partial(self.kv_format.decode, head_dim=self.head_dim, dtype=q.dtype)
            return self._attend_torch(q, meta, decode)
        if cpu_attention.can_run(q, self.kv_cache) and k.stride(-1) == 1 and v.stride(-1) == 1:
            cpu_attention.store_kv(k, v, self.kv_cache, ctx.slot_mapping)
        else:
            reshape_and_cache_ref(k, v, self.kv_cache, ctx.slot_mapping)
        return self._attend_torch(q, meta, None)

    def _attend_torch(self, q: torch.Tensor, meta: tuple[torch.Tensor, ...],
                      decode: SlotDecoder | None) -> torch.Tensor:
        """The torch path: every request of the step at once (ops/attention_batched.py); with the sparse-V skip,
        the reference that follows the kernels' tiles and splits."""
        if self.sparse_v is not None:
            return paged_attention_ref(q, self.kv_cache, *meta, self.scale, decode=decode, sparse_v=self.sparse_v)
        ctx = get_forward_context()
        if decode is None and cpu_attention.can_run(q, self.kv_cache):  # every row in one compiled call
            return cpu_attention.attention_rows(q, self.kv_cache, *meta, self.scale, torch.zeros_like(q))
        return paged_attention_batched(q, self.kv_cache, *meta, self.scale, decode=decode,
                                       rows=self._step_rows(ctx, meta))  # fmt: skip

    def _step_rows(self, ctx: ForwardContext, meta: tuple[torch.Tensor, ...]) -> StepAttentionRows:
        """The step's ``StepAttentionRows`` for this layer's cache and heads: built by the first layer that needs them,
        shared by the others (ForwardContext.host_cache)."""
        shape = (self.kv_cache.shape[-3], self.num_kv_heads, self.num_heads // self.num_kv_heads)
        key = f"attention_rows_{shape}"
        if key not in ctx.host_cache:
            ctx.host_cache[key] = StepAttentionRows.of(*meta, *shape)
        return ctx.host_cache[key]

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
