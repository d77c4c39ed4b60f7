"""Split-KV (flash-decoding) paged attention: several splits per row against the reference, and invariant 4.

The split layout of a row is a function of its number of keys only, so on CPU a small ``min_split_keys`` and
``max_splits`` give rows of 2-5 splits at contexts of ~60 keys (the interpreter runs every program in numpy).
``@pytest.mark.gpu`` tests rerun the invariants compiled at Qwen3.5-0.8B sizes with the default layout, inside a
CUDA graph, and check the workspace bound of a big prefill.
"""

import functools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before truespec.kernels is imported: see tests/helpers/kernels.py

triton = pytest.importorskip("triton")

from helpers.attention_rows import (  # noqa: E402
    attention_batch,
    check_graph_replay_follows_new_contents,
    model_cache,
    rows_alone_and_in_batches,
    workspace_row_bytes,
)
from helpers.kernels import NUM_PAD_TOKENS, assert_near, gpu, i64, needs_cuda, randn  # noqa: E402
from truespec.kernels.paged_attention import (  # noqa: E402
    BLOCK_N,
    MAX_SPLITS,
    MIN_SPLIT_KEYS,
    paged_attention,
)
from truespec.ops.attention import paged_attention_ref, split_layout  # noqa: E402

SMALL = dict(block_n=16, max_splits=4, min_split_keys=16)  # rows of 17..64 keys: 2-4 splits of 16 keys
# (num_cached, query_len): decode, 1+3 verify, prefill chunk on a cached prefix, fresh prefill, empty query,
# first token, 1+1 verify at a longer context, a short decode (one split).
SPLIT_REQS = [(60, 1), (40, 4), (20, 8), (0, 5), (4, 0), (0, 1), (70, 2), (10, 1)]


def num_splits(num_keys: int, layout: dict[str, int]) -> int:
    return split_layout(num_keys, layout["block_n"], layout["max_splits"], layout["min_split_keys"])[1]


def row_keys(reqs: list[tuple[int, int]]) -> list[int]:
    """Number of keys of every real row of a packed batch, in order."""
    return [cached + i + 1 for cached, new in reqs for i in range(new)]


def test_split_layout_depends_on_num_keys_only_and_covers_every_key() -> None:
    for block_n, max_splits, min_split_keys in [(16, 4, 16), (32, 16, 32), (64, 8, 100), (16, 1, 16)]:
        for num_keys in range(1, 700, 7):
            size, count = split_layout(num_keys, block_n, max_splits, min_split_keys)
            assert size % block_n == 0 and size >= min_split_keys and 1 <= count <= max_splits
            assert (count - 1) * size < num_keys <= count * size  # every split holds keys, all keys covered
    assert split_layout(0, 16, 4, 16) == (16, 1)  # padding rows: one empty split


@pytest.mark.parametrize(
    ("dtype", "num_heads", "num_kv_heads", "head_dim"),
    [(torch.float64, 6, 2, 24), (torch.float32, 4, 4, 16), (torch.bfloat16, 6, 2, 24)],
)
def test_split_attention_matches_reference_on_ragged_batch(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    args = attention_batch(SPLIT_REQS, num_heads, num_kv_heads, head_dim, dtype, seed=5)
    assert max(num_splits(n, SMALL) for n in row_keys(SPLIT_REQS)) == 4
    # Workspace for 7 rows: the batch runs in chunks of 7 tokens, padding rows in the last one.
    row_bytes = workspace_row_bytes(num_heads, head_dim, SMALL["max_splits"], dtype)
    out = torch.full_like(args[0], float("nan"))  # every row must be written, padding rows too
    paged_attention(*args, out=out, **SMALL, max_workspace_bytes=7 * row_bytes)
    assert_near(out, paged_attention_ref(*args), dtype)
    assert torch.equal(out[-NUM_PAD_TOKENS:], torch.zeros_like(out[-NUM_PAD_TOKENS:]))


def test_padding_rows_are_zero_with_splits() -> None:
    """A graph-padded batch: padding tokens and padded (empty) requests with -1 tables come back as zeros."""
    q, cache, qsl, seq_lens, tables, scale = attention_batch([(50, 1), (30, 2)], 4, 2, 16, torch.float32, seed=6)
    qsl = torch.cat([qsl, qsl[-1:].repeat(2)])  # two padded requests with empty queries
    seq_lens = torch.cat([seq_lens, i64([0, 0])])
    tables = torch.cat([tables, torch.full_like(tables[:2], -1)])
    out = paged_attention(q, cache, qsl, seq_lens, tables, scale, out=torch.full_like(q, float("nan")), **SMALL)
    assert torch.equal(out[-NUM_PAD_TOKENS:], torch.zeros_like(out[-NUM_PAD_TOKENS:]))
    assert_near(out, paged_attention_ref(q, cache, qsl, seq_lens, tables, scale), torch.float32)


def check_row_same_alone_in_verify_and_in_mixed_batch(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, context: int, k: int,
    layout: dict[str, int], min_row_splits: int,
) -> None:  # fmt: skip
    """Rows at positions context-1-k .. context-1 of one sequence, each computed as the only row of a batch
    of one decode, as one 1+k verify beside other requests, inside a prefill chunk, and inside a big mixed
    batch run in chunks of 3 rows with a wider block table: bitwise equal."""
    first = context - 1 - k
    assert min(num_splits(first + 1 + i, layout) for i in range(k + 1)) >= min_row_splits
    attend = functools.partial(paged_attention, **layout)
    row_bytes = workspace_row_bytes(num_heads, head_dim, layout["max_splits"], dtype)
    alone, *batched = rows_alone_and_in_batches(attend, model_cache(dtype, block_size), num_heads, num_kv_heads,
                                                head_dim, block_size, context, k, dtype, row_bytes)  # fmt: skip
    for out in batched:
        assert torch.equal(alone, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_row_is_bitwise_same_alone_in_verify_and_in_mixed_batch(dtype: torch.dtype) -> None:
    # Keys 64..67 with max_splits 8 and 16-key splits: rows of 4 and of 5 splits.
    layout = dict(block_n=16, max_splits=8, min_split_keys=16)
    check_row_same_alone_in_verify_and_in_mixed_batch(dtype, 4, 2, 16, 4, context=67, k=3, layout=layout,
                                                      min_row_splits=4)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32])
def test_single_split_row_equals_unsplit_kernel(dtype: torch.dtype) -> None:
    """Rows of <= min_split_keys keys keep the unsplit loop: bitwise the ``max_splits=1`` kernel's output,
    while longer rows of the same batch are split (and agree with it to rounding)."""
    args = attention_batch(SPLIT_REQS, 6, 2, 24, dtype, seed=8)
    split, unsplit = paged_attention(*args, **SMALL), paged_attention(*args, **dict(SMALL, max_splits=1))
    single = torch.tensor([num_splits(n, SMALL) == 1 for n in row_keys(SPLIT_REQS)] + [True] * NUM_PAD_TOKENS)
    assert 0 < single.sum() < single.numel()
    assert torch.equal(split[single], unsplit[single])
    assert_near(split, unsplit, dtype)


# ------------------------------------------------------------------------- GPU: Qwen3.5-0.8B sizes, compiled
@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_split_row_is_bitwise_same_alone_in_verify_and_in_mixed_batch(dtype: torch.dtype) -> None:
    layout = dict(block_n=BLOCK_N, max_splits=MAX_SPLITS, min_split_keys=MIN_SPLIT_KEYS)  # the defaults
    check_row_same_alone_in_verify_and_in_mixed_batch(dtype, 8, 2, 256, 16, context=800, k=5, layout=layout,
                                                      min_row_splits=4)  # fmt: skip


@gpu
@needs_cuda
def test_gpu_split_attention_in_cuda_graph_follows_new_contents() -> None:
    """Captured once, replayed with other seq_lens / tables / queries (other split counts): equal to eager."""
    gen = torch.Generator().manual_seed(9)
    cache = randn(2, 400, 16, 2, 256, dtype=torch.bfloat16, gen=gen)
    check_graph_replay_follows_new_contents(paged_attention, cache, lambda args: paged_attention_ref(*args), 5.0,
                                            gen)


@gpu
@needs_cuda
def test_gpu_big_prefill_workspace_is_bounded() -> None:
    """An 8192-token prefill, 64 heads of 128: the split workspace stays far below 300 MB, and its last row
    equals the same row computed as a decode."""
    args = attention_batch([(0, 8192)], 64, 8, 128, torch.bfloat16, seed=12)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = paged_attention(*args)
    torch.cuda.synchronize()
    out_bytes = out.numel() * out.element_size()
    assert torch.cuda.max_memory_allocated() - base - out_bytes < 300 << 20
    assert out.isfinite().all()
    q, cache, _, seq_lens, tables, scale = args
    decode = paged_attention(q[8191:8192].contiguous(), cache, i64([0, 1]), seq_lens, tables, scale)
    assert torch.equal(decode[0], out[8191])
