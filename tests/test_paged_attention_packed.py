"""Paged attention read straight from a packed (compressed) KV cache, against the torch reference that decodes
the slots (``paged_attention_ref(..., decode=fmt.decode)``): every compressed ``kv_cache_dtype`` on a ragged
batch with padding rows, GQA, and a row bitwise the same alone and inside a batch (invariant 4); Lloyd-Max keys
also scored a chunk of head dims at a time (``key_dim_chunk``).

K/V are encoded with ``KVFormat.encode`` and scattered into a random block layout; slots no request owns hold
0xFF bytes (NaN as fp8 and as an fp16 scale), so a kernel that reads them shows. Without CUDA the kernel runs
in Triton's interpreter (tests/helpers/kernels.py), so shapes are tiny; ``@pytest.mark.gpu`` reruns compiled.
"""

import functools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before truespec.kernels is imported: see tests/helpers/kernels.py

triton = pytest.importorskip("triton")

from helpers.attention_rows import (  # noqa: E402
    packed_batch,
    packed_cache,
    packed_reference,
    rows_alone_and_in_batches,
    workspace_row_bytes,
)
from helpers.kernels import (  # noqa: E402
    GPU_TOL_SCALE,
    assert_near,
    assert_padding_zero,
    gpu,
    needs_cuda,
    poisoned_empty,
)
from truespec.kernels.paged_attention import MAX_SPLITS  # noqa: E402
from truespec.kernels.paged_attention_packed import paged_attention_packed  # noqa: E402
from truespec.kv_cache.formats import FORMATS, KVFormat  # noqa: E402

PACKED = ["fp8", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"]
# (num_cached, query_len): decode, 1+3 verify, prefill chunk on a cached prefix, empty query, first token.
REQS = [(20, 1), (9, 4), (3, 6), (4, 0), (0, 1)]


def reference(args: tuple, fmt: KVFormat, head_dim: int) -> torch.Tensor:
    return packed_reference(args, fmt, head_dim)[0]


@pytest.mark.parametrize("name", PACKED)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"), [(2, 2, 16, 4), (4, 1, 32, 8)])
def test_packed_attention_matches_reference_on_ragged_batch(
    name: str, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    fmt = FORMATS[name]
    args = packed_batch(fmt, REQS, num_heads, num_kv_heads, head_dim, block_size, torch.float32, seed=1)
    with poisoned_empty():
        out = paged_attention_packed(*args, fmt, head_dim, block_n=16)
    assert_near(out, reference(args, fmt, head_dim), torch.float32)
    assert_padding_zero(out)


@pytest.mark.parametrize("name", ["fp8", "turboquant_k3v4_nc"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_packed_attention_other_dtypes(name: str, dtype: torch.dtype) -> None:
    """fp64 accumulates in fp64 (the same fp16 / fp8 / code inputs: ~1e-12 from the reference); bf16 in fp32."""
    fmt = FORMATS[name]
    args = packed_batch(fmt, [(6, 1), (2, 3)], 4, 2, 16, 4, dtype, seed=2)
    out = paged_attention_packed(*args, fmt, 16, block_n=16)
    assert out.dtype == dtype
    assert_near(out, reference(args, fmt, 16), dtype)
    assert_padding_zero(out)


def check_row_same_alone_and_in_batch(name: str, num_heads: int, num_kv_heads: int, head_dim: int,
                                      block_size: int, context: int, k: int, **layout: int) -> None:  # fmt: skip
    """Rows at positions context-1-k .. context-1 of one sequence: as k+1 separate decodes, as one 1+k verify
    beside other requests, inside a prefill chunk with padding rows and inside a mixed batch run in row chunks:
    bitwise equal."""
    fmt = FORMATS[name]
    attend = functools.partial(paged_attention_packed, fmt=fmt, head_dim=head_dim, **layout)
    row_bytes = workspace_row_bytes(num_heads, head_dim, layout.get("max_splits", MAX_SPLITS), torch.float32)
    alone, *batched = rows_alone_and_in_batches(attend, packed_cache(fmt, block_size), num_heads, num_kv_heads,
                                                head_dim, block_size, context, k, torch.float32, row_bytes)  # fmt: skip
    for out in batched:
        assert torch.equal(alone, out)


@pytest.mark.parametrize("name", ["fp8", "turboquant_3bit_nc"])
def test_packed_row_is_bitwise_same_alone_and_in_batch(name: str) -> None:
    check_row_same_alone_and_in_batch(name, 4, 2, 16, 4, context=37, k=3, block_n=16)


LLOYD_MAX_PRESETS = [name for name in PACKED if FORMATS[name].is_rotated]


@pytest.mark.parametrize("name", LLOYD_MAX_PRESETS)
@pytest.mark.parametrize(("head_dim", "key_dim_chunk", "unroll", "dtype"),
                         [(64, 32, True, torch.float32), (64, 16, False, torch.bfloat16),
                          (128, 64, True, torch.bfloat16), (128, 32, False, torch.float32)])  # fmt: skip
def test_lloyd_max_key_dim_chunks_match_reference(name: str, head_dim: int, key_dim_chunk: int, unroll: bool,
                                                  dtype: torch.dtype) -> None:  # fmt: skip
    """Keys scored a chunk of head dims at a time, the chunk loop unrolled or not (bf16: the split q by 16-bit
    centroids; fp32: IEEE products) on a ragged batch with padding rows."""
    fmt = FORMATS[name]
    args = packed_batch(fmt, REQS, 4, 2, head_dim, 8, dtype, seed=6)
    with poisoned_empty():
        out = paged_attention_packed(*args, fmt, head_dim, block_n=16, key_dim_chunk=key_dim_chunk,
                                     key_dim_unroll=unroll)  # fmt: skip
    assert_near(out, reference(args, fmt, head_dim), dtype)
    assert_padding_zero(out)


@pytest.mark.parametrize("name", LLOYD_MAX_PRESETS)
def test_whole_head_key_dim_chunk_is_the_default(name: str) -> None:
    """key_dim_chunk = head_dim compiles the engine's whole-head path: the default's bits."""
    fmt = FORMATS[name]
    args = packed_batch(fmt, REQS, 4, 2, 32, 8, torch.bfloat16, seed=7)
    out = paged_attention_packed(*args, fmt, 32, block_n=16, key_dim_chunk=32)
    assert torch.equal(out, paged_attention_packed(*args, fmt, 32, block_n=16))


def test_chunked_key_row_is_bitwise_same_alone_and_in_batch() -> None:
    check_row_same_alone_and_in_batch("turboquant_4bit_nc", 4, 2, 32, 4, context=37, k=3, block_n=16,
                                      key_dim_chunk=16, key_dim_unroll=False)  # fmt: skip


def test_key_dim_chunk_needs_lloyd_max_keys_and_a_power_of_two() -> None:
    for name, chunk in [("turboquant_k8v4", 16), ("turboquant_4bit_nc", 24), ("turboquant_4bit_nc", 8),
                        ("turboquant_4bit_nc", 64)]:  # fmt: skip
        fmt = FORMATS[name]
        args = packed_batch(fmt, [(2, 1)], 2, 2, 32, 4, torch.float32, seed=4)
        with pytest.raises(ValueError, match="key_dim_chunk"):
            paged_attention_packed(*args, fmt, 32, key_dim_chunk=chunk)


def test_packed_attention_rejects_mismatched_cache() -> None:
    fmt = FORMATS["turboquant_4bit_nc"]
    args = packed_batch(fmt, [(2, 1)], 2, 2, 16, 4, torch.float32, seed=4)
    with pytest.raises(ValueError, match="not a contiguous-slot uint8 cache"):
        paged_attention_packed(*args, FORMATS["turboquant_3bit_nc"], 16)
    with pytest.raises(ValueError, match="not a packed format"):
        paged_attention_packed(*args, FORMATS["auto"], 16)


# ------------------------------------------------------------------------- GPU: Qwen3.5-0.8B sizes, compiled
@gpu
@needs_cuda
@pytest.mark.parametrize("name", PACKED)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_packed_attention_matches_reference(name: str, dtype: torch.dtype) -> None:
    fmt = FORMATS[name]
    reqs = [(700, 1), (300, 4), (64, 33), (0, 17), (5, 0), (0, 1)]
    args = packed_batch(fmt, reqs, 8, 2, 256, 16, dtype, seed=5)
    out = paged_attention_packed(*args, fmt, 256)
    assert_near(out, reference(args, fmt, 256), dtype, GPU_TOL_SCALE)
    assert_padding_zero(out)
    assert out.is_cuda


@gpu
@needs_cuda
@pytest.mark.parametrize("name", ["turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc"])
def test_gpu_packed_row_is_bitwise_same_alone_and_in_batch(name: str) -> None:
    check_row_same_alone_and_in_batch(name, 8, 2, 256, 16, context=800, k=5)


@gpu
@needs_cuda
@pytest.mark.parametrize("name", LLOYD_MAX_PRESETS)
@pytest.mark.parametrize(("key_dim_chunk", "unroll"), [(64, True), (32, False)])
def test_gpu_lloyd_max_key_dim_chunks_match_reference(name: str, key_dim_chunk: int, unroll: bool) -> None:
    fmt = FORMATS[name]
    reqs = [(700, 1), (300, 4), (64, 33), (0, 17), (5, 0), (0, 1)]
    args = packed_batch(fmt, reqs, 8, 2, 256, 16, torch.bfloat16, seed=5)
    out = paged_attention_packed(*args, fmt, 256, key_dim_chunk=key_dim_chunk, key_dim_unroll=unroll)
    assert_near(out, reference(args, fmt, 256), torch.bfloat16, GPU_TOL_SCALE)
    assert_padding_zero(out)
