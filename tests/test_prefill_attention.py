"""The tiled prefill attention kernel (kernels/prefill_attention.py) against the torch reference
(``paged_attention_ref``): ragged chunks with padding rows, chunks that start mid-block over keys of earlier chunks
in the cache, GQA groups of 1 / 2 / 4 / 3 (padded), every cache dtype; and a prompt position gives the same bits
however the prompt is chunked and whatever shares its program.

Without CUDA the kernel runs in Triton's interpreter (tests/helpers/kernels.py), so shapes are tiny;
``@pytest.mark.gpu`` reruns compiled at the Qwen3.5-0.8B attention shape.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before truespec.kernels is imported: see tests/helpers/kernels.py

triton = pytest.importorskip("triton")

from helpers.attention_rows import attention_batch, packed_batch, packed_reference  # noqa: E402
from helpers.kernels import GPU_TOL_SCALE, assert_near, assert_padding_zero, gpu, i64, needs_cuda  # noqa: E402
from truespec.kernels.paged_attention_packed import packed_cache_tiles  # noqa: E402
from truespec.kernels.prefill_attention import prefill_attention, prefill_rows  # noqa: E402
from truespec.kv_cache.formats import FORMATS  # noqa: E402
from truespec.ops.attention import paged_attention_ref  # noqa: E402

# (num_cached, query_len): a first chunk longer than one query tile, a chunk starting mid-block over cached keys,
# a one-token chunk, an empty query, a chunk shorter than a tile after a long prefix.
REQS = [(0, 37), (13, 20), (40, 1), (5, 0), (70, 9)]
PACKED = ["fp8", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_3bit_nc"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 2, 16), (4, 4, 32), (4, 1, 16),
                                                                     (6, 2, 24)])  # fmt: skip
def test_prefill_matches_reference_on_ragged_chunks(dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                                                    head_dim: int) -> None:  # fmt: skip
    args = attention_batch(REQS, num_heads, num_kv_heads, head_dim, dtype, seed=3)
    out = prefill_attention(*args, config=(16, 16, 4, 3))
    assert out.dtype == dtype
    assert_near(out, paged_attention_ref(*args), dtype)
    assert_padding_zero(out)


@pytest.mark.parametrize("name", PACKED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_over_packed_cache_matches_reference(name: str, dtype: torch.dtype) -> None:
    fmt = FORMATS[name]
    args = packed_batch(fmt, [(0, 21), (9, 12), (30, 1)], 4, 2, 16, 8, dtype, seed=4)
    out = prefill_attention(*args, fmt=fmt, config=(8, 16, 4, 1))
    assert_near(out, packed_reference(args, fmt, 16)[0], dtype)
    assert_padding_zero(out)


def test_prefill_lloyd_max_key_dim_chunk_matches_reference() -> None:
    """A chunked Lloyd-Max key tile (kernels/kv_tiles.py ``key_dim_chunk``) reads each row's q in the prefill
    kernel too (BLOCK_M tokens x the GQA group as rows)."""
    fmt = FORMATS["turboquant_3bit_nc"]
    args = packed_batch(fmt, [(0, 21), (9, 12), (30, 1)], 4, 2, 32, 8, torch.bfloat16, seed=4)
    q, cache, qsl, seq_lens, tables, scale = args
    q_in, tiles = packed_cache_tiles(q, cache, fmt, 32, key_dim_chunk=16)
    num_rows = qsl[1:] - qsl[:-1]
    out = prefill_rows(q_in, tiles, qsl, seq_lens, tables, num_rows, scale, torch.zeros_like(q), (8, 16, 4, 1))
    assert_near(out, packed_reference(args, fmt, 32)[0], torch.bfloat16)


def chunked_rows(args: tuple, length: int, cuts: list[int], other: int, **kwargs: object) -> list[torch.Tensor]:
    """Rows 0..length-1 of request 0 of ``args`` (a fresh prompt of ``length`` tokens, request 1 another of
    ``other``): as one chunk alone, as chunks cut at ``cuts`` each alone, and as those chunks each behind the last
    5 rows of request 1 in one batch."""
    q, cache, _, _, tables, scale = args
    own, rest = tables[:1], tables[[1, 0]]
    whole = prefill_attention(q[:length], cache, i64([0, length]), i64([length]), own, scale, **kwargs)
    bounds = list(zip([0, *cuts], [*cuts, length], strict=True))
    alone = [prefill_attention(q[a:b], cache, i64([0, b - a]), i64([b]), own, scale, **kwargs) for a, b in bounds]
    behind = []
    for a, b in bounds:
        rows = torch.cat([q[length + other - 5 : length + other], q[a:b]])
        out = prefill_attention(rows, cache, i64([0, 5, 5 + b - a]), i64([other, b]), rest, scale, **kwargs)
        behind.append(out[5:])
    return [whole, torch.cat(alone), torch.cat(behind)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_prompt_position_is_bitwise_same_however_chunked(dtype: torch.dtype) -> None:
    args = attention_batch([(0, 45), (0, 30)], 4, 2, 16, dtype, seed=5)
    whole, *others = chunked_rows(args, 45, [7, 23], 30, config=(16, 16, 4, 3))
    for out in others:
        assert torch.equal(whole, out)


@pytest.mark.parametrize("name", PACKED)
def test_prompt_position_over_a_packed_cache_is_bitwise_same_however_chunked(name: str) -> None:
    fmt = FORMATS[name]
    args = packed_batch(fmt, [(0, 45), (0, 30)], 4, 2, 16, 8, torch.float32, seed=5)
    whole, *others = chunked_rows(args, 45, [7, 23], 30, fmt=fmt)
    for out in others:
        assert torch.equal(whole, out)


def test_prefill_rejects_bad_block_sizes() -> None:
    args = attention_batch([(0, 4)], 2, 2, 16, torch.float32, seed=6)
    with pytest.raises(ValueError, match="powers of two"):
        prefill_attention(*args, config=(12, 64, 4, 3))
    with pytest.raises(ValueError, match=">= 16 rows"):
        prefill_attention(*args, config=(4, 64, 4, 3))


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", [None, "fp8", "turboquant_k8v4", "turboquant_4bit_nc"])
def test_gpu_prefill_matches_reference(dtype: torch.dtype, name: str | None) -> None:
    reqs = [(0, 300), (500, 129), (64, 1), (3, 0), (1000, 77)]
    if name is None:
        args = attention_batch(reqs, 8, 2, 256, dtype, seed=7)
        out, expected = prefill_attention(*args), paged_attention_ref(*args)
    else:
        fmt = FORMATS[name]
        args = packed_batch(fmt, reqs, 8, 2, 256, 16, dtype, seed=7)
        out, expected = prefill_attention(*args, fmt=fmt), packed_reference(args, fmt, 256)[0]
    assert_near(out, expected, dtype, GPU_TOL_SCALE)
    assert_padding_zero(out)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", [None, *PACKED])
def test_gpu_prompt_position_is_bitwise_same_however_chunked(dtype: torch.dtype, name: str | None) -> None:
    """A key tile a row sees whole runs the unmasked build or the masked one depending on where the chunk starts:
    the same bits either way, for every cache format (the accumulate is one explicit fma in both)."""
    if name is None:
        args, kwargs = attention_batch([(0, 700), (0, 300)], 8, 2, 256, dtype, seed=8), {}
    else:
        args, kwargs = packed_batch(FORMATS[name], [(0, 700), (0, 300)], 8, 2, 256, 16, dtype, seed=8), {
            "fmt": FORMATS[name]}
    whole, *others = chunked_rows(args, 700, [100, 333, 512], 300, **kwargs)
    for out in others:
        assert torch.equal(whole, out)
