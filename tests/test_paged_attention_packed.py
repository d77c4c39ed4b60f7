"""Paged attention read straight from a packed (compressed) KV cache, against the torch reference that decodes
the slots (``paged_attention_ref(..., decode=fmt.decode)``): every compressed ``kv_cache_dtype`` on a ragged
batch with padding rows, GQA, and a row bitwise the same alone and inside a batch (invariant 4).

K/V are encoded with ``KVFormat.encode`` and scattered into a random block layout; slots no request owns hold
0xFF bytes (NaN as fp8 and as fp16 norm / scale), so a kernel that reads them shows. Without CUDA the kernel runs
in Triton's interpreter (tests/helpers/kernels.py), so shapes are tiny; ``@pytest.mark.gpu`` reruns compiled.
"""

import functools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before truespec.kernels is imported: see tests/helpers/kernels.py

triton = pytest.importorskip("triton")

from helpers.kernels import (  # noqa: E402
    DEVICE,
    GPU_TOL_SCALE,
    NUM_PAD_TOKENS,
    assert_near,
    assert_padding_zero,
    gpu,
    i64,
    needs_cuda,
    paged_batch,
    poisoned_empty,
    randn,
)
from truespec.kernels.paged_attention_packed import paged_attention_packed  # noqa: E402
from truespec.kv_cache.formats import FORMATS, KVFormat  # noqa: E402
from truespec.ops.attention import paged_attention_ref  # noqa: E402

PACKED = ["fp8", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"]
# (num_cached, query_len): decode, 1+3 verify, prefill chunk on a cached prefix, empty query, first token.
REQS = [(20, 1), (9, 4), (3, 6), (4, 0), (0, 1)]


def packed_batch(fmt: KVFormat, reqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int, dtype: torch.dtype, seed: int) -> tuple:  # fmt: skip
    """paged_attention_packed's positional arguments (up to scale) for ``reqs`` over a randomly laid out cache."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(triton.cdiv(c + n, block_size) for c, n in reqs) + 3
    batch = paged_batch(reqs, block_size=block_size, num_blocks=num_blocks, gen=gen)
    num_slots = num_blocks * block_size
    k = randn(num_slots, num_kv_heads, head_dim, dtype=torch.float32, gen=gen)
    v = randn(num_slots, num_kv_heads, head_dim, dtype=torch.float32, gen=gen)
    slots = fmt.encode(k, v)  # [num_slots, H, bytes]
    slots[~batch["is_live"]] = 0xFF  # never read
    cache = slots.view(num_blocks, block_size, num_kv_heads, -1).contiguous()
    q = randn(batch["slot_mapping"].shape[0], num_heads, head_dim, dtype=dtype, gen=gen)
    return q, cache, batch["query_start_loc"], batch["seq_lens"], batch["block_tables"], head_dim**-0.5


def reference(args: tuple, fmt: KVFormat, head_dim: int) -> torch.Tensor:
    decode = functools.partial(fmt.decode, head_dim=head_dim, dtype=args[0].dtype)
    return paged_attention_ref(*args, decode=decode)


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
                                      block_size: int, context: int, k: int, block_n: int) -> None:  # fmt: skip
    """Rows at positions context-1-k .. context-1 of one sequence: as k+1 separate decodes, as one 1+k verify
    beside other requests and inside a prefill chunk with padding rows: bitwise equal."""
    fmt = FORMATS[name]
    gen = torch.Generator().manual_seed(3)
    other_len = context + 3 * block_size
    num_blocks = triton.cdiv(context, block_size) + triton.cdiv(other_len, block_size) + 2
    blocks = torch.randperm(num_blocks, generator=gen).tolist()
    table, other = blocks[: triton.cdiv(context, block_size)], blocks[-triton.cdiv(other_len, block_size) :]
    kv = randn(2, num_blocks * block_size, num_kv_heads, head_dim, dtype=torch.float32, gen=gen)
    cache = fmt.encode(kv[0], kv[1]).view(num_blocks, block_size, num_kv_heads, -1).contiguous()
    rows = randn(k + 1, num_heads, head_dim, dtype=torch.float32, gen=gen)
    first = context - 1 - k

    def run(reqs: list[tuple[list[int], int, int]], q_rows: torch.Tensor, num_before: int, num_after: int
            ) -> torch.Tensor:  # fmt: skip
        qsl = [0]
        for _, _, query_len in reqs:
            qsl.append(qsl[-1] + query_len)
        width = max(len(t) for t, _, _ in reqs)
        tables = i64([t + [-1] * (width - len(t)) for t, _, _ in reqs])
        q = torch.cat([randn(num_before, num_heads, head_dim, dtype=torch.float32, gen=gen), q_rows,
                       randn(num_after, num_heads, head_dim, dtype=torch.float32, gen=gen)])  # fmt: skip
        out = paged_attention_packed(q, cache, i64(qsl), i64([s for _, s, _ in reqs]), tables, head_dim**-0.5, fmt,
                                     head_dim, block_n=block_n)  # fmt: skip
        if num_after > NUM_PAD_TOKENS - 1:
            assert torch.equal(out[-NUM_PAD_TOKENS:], torch.zeros_like(out[-NUM_PAD_TOKENS:]))
        return out[num_before : num_before + q_rows.shape[0]]

    alone = torch.cat([run([(table, first + i + 1, 1)], rows[i : i + 1], 0, 0) for i in range(k + 1)])
    verify = run([(other, other_len, 2), (table, context, k + 1), (other, 5, 1)], rows, 2, 1 + NUM_PAD_TOKENS)
    prefill = run([(other, 3, 1), (table, context, k + 3)], rows, 3, NUM_PAD_TOKENS)
    assert torch.equal(alone, verify)
    assert torch.equal(alone, prefill)


@pytest.mark.parametrize("name", ["fp8", "turboquant_3bit_nc"])
def test_packed_row_is_bitwise_same_alone_and_in_batch(name: str) -> None:
    check_row_same_alone_and_in_batch(name, 4, 2, 16, 4, context=37, k=3, block_n=16)


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
    assert out.device == DEVICE


@gpu
@needs_cuda
@pytest.mark.parametrize("name", ["turboquant_k8v4", "turboquant_k3v4_nc"])
def test_gpu_packed_row_is_bitwise_same_alone_and_in_batch(name: str) -> None:
    check_row_same_alone_and_in_batch(name, 8, 2, 256, 16, context=800, k=5, block_n=32)
