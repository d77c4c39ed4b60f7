"""Split-KV (flash-decoding) over a packed cache: rows of several splits against the reference, padding, the
workspace chunking, one split equal to the unsplit kernel, and invariant 4 (a row alone equals the same row inside
a verify, a prefill chunk and a mixed batch, bitwise).

As in test_paged_attention_split.py, a small ``min_split_keys`` / ``max_splits`` give rows of 2-5 splits at ~60 keys
under the interpreter; ``@pytest.mark.gpu`` tests rerun compiled at Qwen3.5-0.8B sizes with the default layout
(hundreds to thousands of keys), inside a CUDA graph too.
"""

import functools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before truespec.kernels is imported: see tests/helpers/kernels.py

triton = pytest.importorskip("triton")

from helpers.attention_rows import (  # noqa: E402
    check_graph_replay_follows_new_contents,
    packed_batch,
    packed_cache,
    packed_reference,
    rows_alone_and_in_batches,
    workspace_row_bytes,
)
from helpers.kernels import (  # noqa: E402
    GPU_TOL_SCALE,
    NUM_PAD_TOKENS,
    assert_near,
    assert_padding_zero,
    gpu,
    i64,
    needs_cuda,
    poisoned_empty,
    randn,
)
from truespec.kernels.paged_attention import MAX_SPLITS  # noqa: E402
from truespec.kernels.paged_attention_packed import paged_attention_packed  # noqa: E402
from truespec.kv_cache.formats import FORMATS  # noqa: E402
from truespec.ops.attention import split_layout  # noqa: E402

PACKED = ["fp8", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"]
SMALL = dict(block_n=16, max_splits=4, min_split_keys=16)  # rows of 17..64 keys: 2-4 splits of 16 keys
# (num_cached, query_len): decode, 1+3 verify, prefill chunk on a cached prefix, fresh prefill, empty query,
# first token, 1+1 verify at a longer context, a short decode (one split).
SPLIT_REQS = [(60, 1), (40, 4), (20, 8), (0, 5), (4, 0), (0, 1), (70, 2), (10, 1)]


def row_splits(reqs: list[tuple[int, int]], layout: dict[str, int]) -> list[int]:
    """Number of splits of every real row of a packed batch, in order."""
    keys = [cached + i + 1 for cached, new in reqs for i in range(new)]
    return [split_layout(n, layout["block_n"], layout["max_splits"], layout["min_split_keys"])[1] for n in keys]


@pytest.mark.parametrize("name", PACKED)
def test_packed_split_attention_matches_reference_on_ragged_batch(name: str) -> None:
    fmt = FORMATS[name]
    args = packed_batch(fmt, SPLIT_REQS, 4, 2, 16, 4, torch.float32, seed=11)
    assert max(row_splits(SPLIT_REQS, SMALL)) == 4
    # Workspace for 7 rows: the batch runs in chunks of 7 tokens, padding rows in the last one.
    row_bytes = workspace_row_bytes(4, 16, SMALL["max_splits"], torch.float32)
    with poisoned_empty():  # NaN workspace and output: every row must be written, none read before written
        out = paged_attention_packed(*args, fmt, 16, **SMALL, max_workspace_bytes=7 * row_bytes)
    assert_near(out, packed_reference(args, fmt, 16)[0], torch.float32)
    assert_padding_zero(out)


@pytest.mark.parametrize("name", ["fp8", "turboquant_k3v4_nc"])
def test_packed_split_attention_in_fp64(name: str) -> None:
    """fp64 q accumulates in fp64: the split merge agrees with the reference to ~1e-12."""
    fmt = FORMATS[name]
    reqs = [(50, 1), (30, 3), (0, 2)]
    args = packed_batch(fmt, reqs, 6, 2, 16, 4, torch.float64, seed=12)
    out = paged_attention_packed(*args, fmt, 16, **SMALL)
    assert max(row_splits(reqs, SMALL)) == 4
    assert_near(out, packed_reference(args, fmt, 16)[0], torch.float64)
    assert_padding_zero(out)


def test_packed_split_padding_rows_are_zero() -> None:
    """A graph-padded batch: padding tokens and padded (empty) requests with -1 tables come back as zeros."""
    fmt = FORMATS["turboquant_4bit_nc"]
    q, cache, qsl, seq_lens, tables, scale = packed_batch(fmt, [(50, 1), (30, 2)], 4, 2, 16, 4, torch.float32, 13)
    qsl = torch.cat([qsl, qsl[-1:].repeat(2)])  # two padded requests with empty queries
    seq_lens = torch.cat([seq_lens, i64([0, 0])])
    tables = torch.cat([tables, torch.full_like(tables[:2], -1)])
    args = (q, cache, qsl, seq_lens, tables, scale)
    out = paged_attention_packed(*args, fmt, 16, out=torch.full_like(q, float("nan")), **SMALL)
    assert torch.equal(out[-NUM_PAD_TOKENS:], torch.zeros_like(out[-NUM_PAD_TOKENS:]))
    assert_near(out, packed_reference(args, fmt, 16)[0], torch.float32)


def test_packed_single_split_row_equals_unsplit_kernel() -> None:
    """Rows of <= min_split_keys keys keep the unsplit loop: bitwise the ``max_splits=1`` kernel's output, while
    longer rows of the same batch are split (and agree with it to rounding)."""
    fmt = FORMATS["turboquant_k8v4"]
    args = packed_batch(fmt, SPLIT_REQS, 4, 2, 16, 4, torch.float32, seed=14)
    split = paged_attention_packed(*args, fmt, 16, **SMALL)
    unsplit = paged_attention_packed(*args, fmt, 16, **dict(SMALL, max_splits=1))
    single = torch.tensor([n == 1 for n in row_splits(SPLIT_REQS, SMALL)] + [True] * NUM_PAD_TOKENS)
    assert 0 < single.sum() < single.numel()
    assert torch.equal(split[single], unsplit[single])
    assert_near(split, unsplit, torch.float32)


def check_split_rows_same_alone_and_in_batches(name: str, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                                               head_dim: int, block_size: int, context: int, k: int,
                                               layout: dict[str, int], min_row_splits: int) -> None:  # fmt: skip
    fmt = FORMATS[name]
    keys = range(context - k, context + 1)
    assert min(split_layout(n, layout["block_n"], layout["max_splits"], layout["min_split_keys"])[1]
               for n in keys) >= min_row_splits  # fmt: skip

    attend = functools.partial(paged_attention_packed, fmt=fmt, head_dim=head_dim, **layout)
    row_bytes = workspace_row_bytes(num_heads, head_dim, layout["max_splits"], dtype)
    alone, *batched = rows_alone_and_in_batches(attend, packed_cache(fmt, block_size), num_heads, num_kv_heads,
                                                head_dim, block_size, context, k, dtype, row_bytes)  # fmt: skip
    for out in batched:
        assert torch.equal(alone, out)


@pytest.mark.parametrize(("name", "dtype"), [("fp8", torch.bfloat16), ("turboquant_3bit_nc", torch.float32)])
def test_packed_split_row_is_bitwise_same_alone_in_verify_and_in_mixed_batch(name: str, dtype: torch.dtype) -> None:
    # Keys 64..67 with max_splits 8 and 16-key splits: rows of 4 and of 5 splits.
    check_split_rows_same_alone_and_in_batches(name, dtype, 4, 2, 16, 4, context=67, k=3,
                                               layout=dict(block_n=16, max_splits=8, min_split_keys=16),
                                               min_row_splits=4)  # fmt: skip


# ------------------------------------------------------------------------- GPU: Qwen3.5-0.8B sizes, compiled
@gpu
@needs_cuda
@pytest.mark.parametrize("name", PACKED)
def test_gpu_packed_split_attention_matches_reference(name: str) -> None:
    fmt = FORMATS[name]
    reqs = [(3000, 1), (1200, 4), (64, 33), (500, 0), (0, 1), (700, 1)]
    args = packed_batch(fmt, reqs, 8, 2, 256, 16, torch.bfloat16, seed=15)
    out = paged_attention_packed(*args, fmt, 256)
    # the 3001-key row: 47 splits of 64 keys, or the cap if lower
    assert max(row_splits(reqs, dict(block_n=32, max_splits=MAX_SPLITS, min_split_keys=64))) == min(MAX_SPLITS, 47)
    assert_near(out, packed_reference(args, fmt, 256)[0], torch.bfloat16, GPU_TOL_SCALE)
    assert_padding_zero(out)


@gpu
@needs_cuda
@pytest.mark.parametrize(("name", "dtype"), [("turboquant_k8v4", torch.bfloat16),
                                             ("turboquant_k3v4_nc", torch.bfloat16),
                                             ("turboquant_4bit_nc", torch.float32)])  # fmt: skip
def test_gpu_packed_split_row_is_bitwise_same_alone_in_verify_and_in_mixed_batch(name: str, dtype: torch.dtype
                                                                                 ) -> None:  # fmt: skip
    layout = dict(block_n=32, max_splits=MAX_SPLITS, min_split_keys=64)  # the defaults
    check_split_rows_same_alone_and_in_batches(name, dtype, 8, 2, 256, 16, context=800, k=5, layout=layout,
                                               min_row_splits=4)  # fmt: skip


@gpu
@needs_cuda
def test_gpu_packed_split_attention_in_cuda_graph_follows_new_contents() -> None:
    """Captured once (after a warm-up call), replayed with other seq_lens / tables / queries: equal to eager."""
    fmt = FORMATS["turboquant_k3v4_nc"]
    gen = torch.Generator().manual_seed(16)
    kv = randn(2, 400 * 16, 2, 256, dtype=torch.float32, gen=gen)
    cache = fmt.encode(kv[0], kv[1]).view(400, 16, 2, -1).contiguous()
    attend = functools.partial(paged_attention_packed, fmt=fmt, head_dim=256)
    check_graph_replay_follows_new_contents(attend, cache, lambda args: packed_reference(args, fmt, 256)[0],
                                            GPU_TOL_SCALE, gen)
