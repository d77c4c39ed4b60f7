"""Split-KV attention with many splits a row: the split cap ``max_splits`` at 16, 32, 64 and 128, model-dtype and
packed caches. Against the reference, and invariant 4 (a row alone equals the same row inside a verify, a prefill
chunk and a chunked mixed batch, bitwise) with rows that reach the cap.

The layout gives one split per ``min_split_keys`` keys up to the cap, so on CPU ``block_n = min_split_keys = 16``
reaches ``cap`` splits at 16 * cap keys (2,048 for 128: the interpreter's cost is the keys' tiles, not the splits).
The merge walks a row's split slots in groups of MERGE_SPLITS over MERGE_DIM output dims; some tests shrink that
tile so that small rows run several groups and several dim blocks. ``@pytest.mark.gpu`` tests rerun it compiled at
Qwen3.5-0.8B sizes with 32K-key rows.
"""

import functools
import importlib
import os
from collections.abc import Callable

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before truespec.kernels is imported: see tests/helpers/kernels.py

triton = pytest.importorskip("triton")

from helpers.attention_rows import (  # noqa: E402
    attention_batch,
    model_cache,
    packed_batch,
    packed_cache,
    packed_reference,
    rows_alone_and_in_batches,
    workspace_row_bytes,
)
from helpers.kernels import GPU_TOL_SCALE, assert_near, assert_padding_zero, gpu, needs_cuda, poisoned_empty  # noqa: E402
from truespec.kernels.paged_attention import BLOCK_N, MIN_SPLIT_KEYS, paged_attention  # noqa: E402
from truespec.kernels.paged_attention_packed import paged_attention_packed  # noqa: E402
from truespec.kv_cache.formats import FORMATS  # noqa: E402
from truespec.ops.attention import paged_attention_ref, split_layout  # noqa: E402

CAPS = [16, 32, 64, 128]
PACKED = ["fp8", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"]
SMALL_MERGE = (4, 8)  # merge tile (split slots a step, dims a program): head_dim 16 -> 2 dim blocks


def layout(cap: int) -> dict[str, int]:
    return dict(block_n=16, max_splits=cap, min_split_keys=16)


def cap_reqs(cap: int) -> list[tuple[int, int]]:
    """(num_cached, query_len): a decode and a 1+1 verify whose rows have ``cap`` splits, a decode of cap / 2 + 1
    splits, a short 1+1 verify, an empty query, a first token."""
    return [(16 * cap - 4, 1), (16 * cap - 9, 2), (8 * cap, 1), (20, 2), (5, 0), (0, 1)]


def max_row_splits(reqs: list[tuple[int, int]], cap: int) -> int:
    return max(split_layout(c + i + 1, 16, cap, 16)[1] for c, n in reqs for i in range(n))


SetTile = Callable[[tuple[int, int]], None]


@pytest.fixture
def merge_tile(monkeypatch: pytest.MonkeyPatch) -> SetTile:
    """Set the merge kernel's tile (MERGE_SPLITS, MERGE_DIM) for one test."""
    module = importlib.import_module("truespec.kernels.paged_attention")  # the package re-exports the function

    def set_tile(tile: tuple[int, int]) -> None:
        monkeypatch.setattr(module, "MERGE_SPLITS", tile[0])
        monkeypatch.setattr(module, "MERGE_DIM", tile[1])

    return set_tile


def test_split_layout_gives_the_shortest_tile_chain_under_the_cap_and_keeps_short_rows() -> None:
    """Each split of a row holds the fewest tiles any layout of at most ``cap`` tile-aligned splits allows (at least
    MIN_SPLIT_KEYS keys): what bounds a row's latency. The count itself may fall below the cap past
    ``cap * MIN_SPLIT_KEYS`` keys (whole tiles); rows of up to 16 * MIN_SPLIT_KEYS keys split as with cap 16."""
    min_tiles = -(-MIN_SPLIT_KEYS // BLOCK_N)
    for cap in CAPS:
        for num_keys in range(1, 40000, 37):
            size, count = split_layout(num_keys, BLOCK_N, cap, MIN_SPLIT_KEYS)
            assert size // BLOCK_N == max(min_tiles, -(-triton.cdiv(num_keys, BLOCK_N) // cap)) and count <= cap
        for num_keys in range(1, 16 * MIN_SPLIT_KEYS + 1):
            assert split_layout(num_keys, BLOCK_N, cap, MIN_SPLIT_KEYS) == split_layout(num_keys, BLOCK_N, 16,
                                                                                         MIN_SPLIT_KEYS)  # fmt: skip
        assert split_layout(32768, BLOCK_N, cap, MIN_SPLIT_KEYS) == (32768 // cap, cap)
    assert split_layout(8215, BLOCK_N, 128, MIN_SPLIT_KEYS) == (96, 86)  # 257 tiles: 3 a split, 86 splits


# (cap, merge tile, kv heads): 2 kv heads (of 2 query heads each) where rows are short, 1 where the tiles cost
@pytest.mark.parametrize(("cap", "tile", "num_kv_heads"), [(16, SMALL_MERGE, 2), (32, SMALL_MERGE, 2), (64, None, 1),
                                                           (128, None, 1)])  # fmt: skip
def test_many_splits_match_reference_on_ragged_batch(cap: int, tile: tuple[int, int] | None, num_kv_heads: int,
                                                     merge_tile: SetTile) -> None:  # fmt: skip
    if tile is not None:
        merge_tile(tile)
    reqs = cap_reqs(cap)
    args = attention_batch(reqs, 2 * num_kv_heads, num_kv_heads, 16, torch.float32, seed=31)
    assert max_row_splits(reqs, cap) == cap
    row_bytes = workspace_row_bytes(2 * num_kv_heads, 16, cap, torch.float32)
    with poisoned_empty():  # NaN workspace and output: every row written, no slot read before it is written
        out = paged_attention(*args, **layout(cap), max_workspace_bytes=3 * row_bytes)  # chunks of 3 rows
    assert_near(out, paged_attention_ref(*args), torch.float32)
    assert_padding_zero(out)


@pytest.mark.parametrize(("name", "cap"), [("fp8", 32), ("turboquant_3bit_nc", 64), ("turboquant_4bit_nc", 128)])
def test_packed_many_splits_match_reference_on_ragged_batch(name: str, cap: int) -> None:
    fmt = FORMATS[name]
    reqs = cap_reqs(cap)[:1] + cap_reqs(cap)[2:]
    args = packed_batch(fmt, reqs, 2, 1, 16, 16, torch.float32, seed=32)
    assert max_row_splits(reqs, cap) == cap
    with poisoned_empty():
        out = paged_attention_packed(*args, fmt, 16, **layout(cap))
    assert_near(out, packed_reference(args, fmt, 16)[0], torch.float32)
    assert_padding_zero(out)


@pytest.mark.parametrize(("cap", "dtype", "tile"), [(16, torch.bfloat16, SMALL_MERGE), (32, torch.float32, SMALL_MERGE),
                                                    (64, torch.float32, None), (128, torch.float32, None)])  # fmt: skip
def test_row_with_many_splits_is_bitwise_same_alone_in_verify_and_in_mixed_batch(
    cap: int, dtype: torch.dtype, tile: tuple[int, int] | None, merge_tile: SetTile
) -> None:
    """The last 2 rows of a sequence of 16 * cap - 1 keys (cap splits each): bitwise the same as decodes, in a
    verify, in a prefill chunk and in a mixed batch run in chunks of 3 rows."""
    if tile is not None:
        merge_tile(tile)
    context = 16 * cap - 1
    assert split_layout(context - 1, 16, cap, 16)[1] == cap
    attend = functools.partial(paged_attention, **layout(cap))
    alone, *batched = rows_alone_and_in_batches(attend, model_cache(dtype, 16), 2, 1, 16, 16, context, 1, dtype,
                                                workspace_row_bytes(2, 16, cap, dtype))  # fmt: skip
    for out in batched:
        assert torch.equal(alone, out)


def test_packed_row_with_many_splits_is_bitwise_same_alone_in_verify_and_in_mixed_batch(merge_tile: SetTile) -> None:
    merge_tile(SMALL_MERGE)
    fmt, cap = FORMATS["turboquant_k3v4_nc"], 32
    context = 16 * cap - 1
    attend = functools.partial(paged_attention_packed, fmt=fmt, head_dim=16, **layout(cap))
    row_bytes = workspace_row_bytes(2, 16, cap, torch.float32)
    alone, *batched = rows_alone_and_in_batches(attend, packed_cache(fmt, 16), 2, 1, 16, 16, context, 1,
                                                torch.float32, row_bytes)  # fmt: skip
    for out in batched:
        assert torch.equal(alone, out)


# ------------------------------------------------------------------------- GPU: Qwen3.5-0.8B sizes, 32K keys
GPU_CONTEXT = 32768
GPU_REQS = [(GPU_CONTEXT - 1, 1), (GPU_CONTEXT - 8, 4), (9000, 1), (700, 2), (0, 1)]  # decode, 1+3 verify, 9K, short


def gpu_layout(cap: int) -> dict[str, int]:
    return dict(block_n=BLOCK_N, max_splits=cap, min_split_keys=MIN_SPLIT_KEYS)


# Each cap compiles its own binaries (MAX_SPLITS is a constexpr): the model dtype runs at every cap, the packed
# formats at the caps meant for them.
GPU_CASES = [(None, cap) for cap in CAPS] + [(name, cap) for cap in (64, 128) for name in PACKED]


@gpu
@needs_cuda
@pytest.mark.parametrize(("name", "cap"), GPU_CASES)
def test_gpu_32k_rows_match_reference(name: str | None, cap: int) -> None:
    """bf16, 8 q / 2 kv heads of 256: rows of GPU_CONTEXT keys, the cap's splits, against the reference."""
    if name is None:
        args = attention_batch(GPU_REQS, 8, 2, 256, torch.bfloat16, seed=33)
        attend, expected = paged_attention, paged_attention_ref(*args)
    else:
        fmt = FORMATS[name]
        args = packed_batch(fmt, GPU_REQS, 8, 2, 256, 16, torch.bfloat16, seed=33)
        attend = functools.partial(paged_attention_packed, fmt=fmt, head_dim=256)
        expected = packed_reference(args, fmt, 256)[0]
    assert split_layout(GPU_CONTEXT, **gpu_layout(cap))[1] == cap
    out = attend(*args, **gpu_layout(cap))
    # A 32K-key row averages 32K random values: its outputs (~0.01) sit far below bf16's absolute tolerance, so
    # both sides are scaled to a largest |value| of 1 first (a split dropped or weighted wrongly moves them by ~1).
    scale = expected.abs().max().float()
    assert_near(out.float() / scale, expected.float() / scale, torch.bfloat16, GPU_TOL_SCALE)
    assert_padding_zero(out)


@gpu
@needs_cuda
@pytest.mark.parametrize(("name", "dtype", "cap"), [(None, torch.bfloat16, cap) for cap in CAPS] + [
    ("turboquant_4bit_nc", torch.bfloat16, 64), ("turboquant_4bit_nc", torch.bfloat16, 128),
    ("turboquant_k8v4", torch.float32, 128)])  # fmt: skip
def test_gpu_32k_row_is_bitwise_same_alone_in_verify_and_in_mixed_batch(name: str | None, dtype: torch.dtype,
                                                                         cap: int) -> None:  # fmt: skip
    """The last 4 rows of a 32,768-key sequence: the same bits as decodes, in a 1+3 verify, a prefill chunk and a
    mixed batch run in chunks of 3 rows."""
    if name is None:
        attend, make_cache = functools.partial(paged_attention, **gpu_layout(cap)), model_cache(dtype, 16)
    else:
        fmt = FORMATS[name]
        attend = functools.partial(paged_attention_packed, fmt=fmt, head_dim=256, **gpu_layout(cap))
        make_cache = packed_cache(fmt, 16)
    alone, *batched = rows_alone_and_in_batches(attend, make_cache, 8, 2, 256, 16, GPU_CONTEXT, 3, dtype,
                                                workspace_row_bytes(8, 256, cap, dtype))  # fmt: skip
    for out in batched:
        assert torch.equal(alone, out)
