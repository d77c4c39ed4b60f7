"""Attention and norm kernels (reshape_and_cache, paged_attention, rms_norm) against their torch references,
which reuse the layers' own code: exact cache writes to real slots only, attention within tolerance on a ragged
batch, and a row's attention bitwise the same whether computed as a decode, inside a verify or inside a prefill
chunk (invariant 4).

Batches are ragged on purpose: plain decodes, 1+k verifies, prefill chunks continuing a cached prefix, fresh
prefills, an empty query and trailing padding tokens (slot -1), with random (never zero) inputs and caches.
Without CUDA the kernels run in Triton's interpreter (see tests/helpers/kernels.py), so shapes are tiny;
``@pytest.mark.gpu`` tests rerun them compiled at Qwen3.5-0.8B sizes. The Gated DeltaNet kernels are in
tests/test_gdn_kernels.py.
"""

import pytest
import torch

from helpers.kernels import (
    DTYPES,
    GPU_DTYPES,
    GPU_TOL_SCALE,
    NUM_PAD_TOKENS,
    assert_near,
    gpu,
    i64,
    make_context,
    needs_cuda,
    paged_batch,
    randn,
    triton,
)
from truespec.forward_context import set_forward_context
from truespec.kernels import (
    paged_attention,
    paged_attention_ref,
    reshape_and_cache,
    reshape_and_cache_ref,
    rms_norm,
    rms_norm_ref,
)
from truespec.layers.attention import PagedAttention

# Attention requests (num_cached, query_len): decode, 1+3 verify, prefill chunk on a cached prefix,
# fresh prefill, empty query, first token.
ATTN_REQS = [(9, 1), (5, 4), (6, 7), (0, 5), (4, 0), (0, 1)]


# --------------------------------------------------------------------------------------------- attention
@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_writes_only_real_slots(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    batch = paged_batch(ATTN_REQS, block_size=4, num_blocks=16, gen=gen)
    num_tokens = batch["slot_mapping"].shape[0]
    kv = randn(num_tokens, 2, 2, 24, dtype=dtype, gen=gen)  # k and v as strided views, like a qkv split
    cache = randn(2, 16, 4, 2, 24, dtype=dtype, gen=gen)
    expected = cache.clone()
    reshape_and_cache(kv[:, 0], kv[:, 1], cache, batch["slot_mapping"])
    reshape_and_cache_ref(kv[:, 0], kv[:, 1], expected, batch["slot_mapping"])
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(6, 2, 24), (4, 4, 16)])
def test_paged_attention_matches_reference_on_ragged_batch(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    gen = torch.Generator().manual_seed(1)
    batch = paged_batch(ATTN_REQS, block_size=4, num_blocks=24, gen=gen)
    cache = randn(2, 24, 4, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    cache.view(2, -1, num_kv_heads, head_dim)[:, ~batch["is_live"]] = float("nan")  # never read
    q = randn(batch["slot_mapping"].shape[0], num_heads, head_dim, dtype=dtype, gen=gen)
    args = (q, cache, batch["query_start_loc"], batch["seq_lens"], batch["block_tables"], head_dim**-0.5)
    out = paged_attention(*args, block_n=16)
    assert_near(out, paged_attention_ref(*args), dtype)
    assert torch.equal(out[-NUM_PAD_TOKENS:], torch.zeros_like(out[-NUM_PAD_TOKENS:]))


def check_rows_same_in_decode_verify_and_prefill(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, context: int, k: int
) -> None:
    """Rows at positions context-1-k .. context-1 of one sequence, computed as k+1 separate decodes, as one
    1+k verify, and inside a prefill chunk (each batch also holding an unrelated request), must be equal."""
    gen = torch.Generator().manual_seed(2)
    num_blocks = 2 * triton.cdiv(context, block_size) + 2
    blocks = torch.randperm(num_blocks, generator=gen).tolist()
    table = blocks[: triton.cdiv(context, block_size)]
    other = blocks[-2:]  # an unrelated request of 2 * block_size tokens
    width = len(table)
    cache = randn(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    rows = randn(k + 1, num_heads, head_dim, dtype=dtype, gen=gen)
    first = context - 1 - k

    def run(reqs: list[tuple[list[int], int, int]], q_other: int, q_rows: torch.Tensor) -> torch.Tensor:
        """reqs: (block table, seq_len, query_len); the first request is the unrelated one."""
        qsl = [0]
        for _, _, query_len in reqs:
            qsl.append(qsl[-1] + query_len)
        tables = i64([t + [-1] * (width - len(t)) for t, _, _ in reqs])
        q = torch.cat([randn(q_other, num_heads, head_dim, dtype=dtype, gen=gen), q_rows])
        out = paged_attention(q, cache, i64(qsl), i64([s for _, s, _ in reqs]), tables, head_dim**-0.5)
        return out[-(k + 1) :]

    decodes = run([(other, 2 * block_size, 2)] + [(table, first + i + 1, 1) for i in range(k + 1)], 2, rows)
    verify = run([(other, 2 * block_size, 1), (table, context, k + 1)], 1, rows)
    prefill_q = torch.cat([randn(2, num_heads, head_dim, dtype=dtype, gen=gen), rows])
    prefill = run([(other, block_size, 1), (table, context, k + 3)], 1, prefill_q)
    assert torch.equal(decodes, verify)
    assert torch.equal(decodes, prefill)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_row_is_bitwise_same_in_decode_verify_and_prefill(dtype: torch.dtype) -> None:
    check_rows_same_in_decode_verify_and_prefill(dtype, 4, 2, 24, block_size=4, context=11, k=3)


def test_attention_kernels_reproduce_paged_attention_layer() -> None:
    """The wiring recipe: reshape_and_cache + paged_attention == PagedAttention.forward (float64)."""
    gen = torch.Generator().manual_seed(3)
    batch = paged_batch(ATTN_REQS, block_size=4, num_blocks=24, gen=gen)
    layer = PagedAttention(6, 2, 24, scale=24**-0.5)
    layer.kv_cache = randn(2, 24, 4, 2, 24, dtype=torch.float64, gen=gen)
    cache = layer.kv_cache.clone()
    num_tokens = batch["slot_mapping"].shape[0]
    q, k, v = randn(num_tokens, 10, 24, dtype=torch.float64, gen=gen).split([6, 2, 2], dim=1)
    with set_forward_context(make_context(batch, num_tokens)):
        expected = layer(q, k, v)
    reshape_and_cache(k, v, cache, batch["slot_mapping"])
    out = paged_attention(q, cache, batch["query_start_loc"], batch["seq_lens"], batch["block_tables"], 24**-0.5)
    assert_near(out, expected, torch.float64)
    assert torch.equal(cache, layer.kv_cache)


# ------------------------------------------------------------------------------------------- rms_norm
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", ["plain", "unit_offset", "gated", "gated_strided"])
def test_rms_norm_matches_reference(dtype: torch.dtype, form: str) -> None:
    gen = torch.Generator().manual_seed(6)
    x = randn(5, 3, 20, dtype=dtype, gen=gen)
    gate = randn(5, 3, 20, dtype=dtype, gen=gen) if form == "gated" else None
    if form == "gated_strided":  # heads sliced out of a wider projection output, read in place
        gate = randn(5, 7 + 3 * 20, dtype=dtype, gen=gen)[:, 7:].unflatten(-1, (3, 20))
    weight = 1 + 0.2 * randn(20, dtype=dtype, gen=gen)
    args = (x, weight, 1e-6, form == "unit_offset", gate)
    assert_near(rms_norm(*args), rms_norm_ref(*args), dtype)


# ------------------------------------------------------------------------- GPU: Qwen3.5-0.8B sizes, compiled
@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_paged_attention_at_qwen3_5_size(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(10)
    reqs = [(1000, 1), (2043, 5), (300, 64), (0, 128), (57, 0), (4095, 1), (16, 1)]
    batch = paged_batch(reqs, block_size=16, num_blocks=600, gen=gen)
    cache = randn(2, 600, 16, 2, 256, dtype=dtype, gen=gen)
    qkv = randn(batch["slot_mapping"].shape[0], 12, 256, dtype=dtype, gen=gen)
    q, k, v = qkv.split([8, 2, 2], dim=1)
    expected_cache = cache.clone()
    reshape_and_cache(k, v, cache, batch["slot_mapping"])
    reshape_and_cache_ref(k, v, expected_cache, batch["slot_mapping"])
    assert torch.equal(cache, expected_cache)
    args = (q, cache, batch["query_start_loc"], batch["seq_lens"], batch["block_tables"], 256**-0.5)
    assert_near(paged_attention(*args), paged_attention_ref(*args), dtype, GPU_TOL_SCALE)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_attention_row_invariance_at_qwen3_5_size(dtype: torch.dtype) -> None:
    check_rows_same_in_decode_verify_and_prefill(dtype, 8, 2, 256, block_size=16, context=3001, k=5)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_rms_norms_at_qwen3_5_size(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    core, gate = randn(37, 16, 128, dtype=dtype, gen=gen), randn(37, 16, 128, dtype=dtype, gen=gen)
    hidden = randn(37, 1024, dtype=dtype, gen=gen)
    for x, z, unit_offset in [(core, gate, False), (hidden, None, True), (hidden, None, False)]:
        weight = 1 + 0.2 * randn(x.shape[-1], dtype=dtype, gen=gen)
        args = (x, weight, 1e-6, unit_offset, z)
        assert_near(rms_norm(*args), rms_norm_ref(*args), dtype, GPU_TOL_SCALE)
