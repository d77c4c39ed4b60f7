"""The sparse-V tile skip of both attention kernels (model dtype and packed): threshold 0 gives the bits of off, a
positive threshold equals the tiled float64 reference (``ops.attention.tiled_attention``) with tiles actually
skipped, and a row skips the same tiles alone and inside a verify or mixed batch (invariant 4), bitwise.

Skipping needs peaked attention: ``peak_attention`` (tests/helpers/attention_rows.py) aligns the queries with the
early keys of each request, so a split's first tile outweighs the later ones. Layouts keep splits of >= 2 tiles
(the first tile of a split never skips: its largest p / l is >= 1 / BLOCK_N).
"""

import functools
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
from helpers.kernels import GPU_TOL_SCALE, TOL, assert_near, assert_padding_zero, gpu, needs_cuda  # noqa: E402
from truespec.kernels.paged_attention import BLOCK_N, MAX_SPLITS, MIN_SPLIT_KEYS, paged_attention  # noqa: E402
from truespec.kernels.paged_attention_packed import paged_attention_packed  # noqa: E402
from truespec.kv_cache.formats import FORMATS  # noqa: E402
from truespec.ops.attention import SparseV, paged_attention_skips_ref, split_layout, tiled_attention  # noqa: E402

LAYOUT = dict(block_n=16, max_splits=2, min_split_keys=32)  # splits of >= 2 tiles
UNSPLIT = dict(block_n=16, max_splits=1, min_split_keys=16)  # one chain of up to 7 tiles per row
# (num_cached, query_len): decodes at 90 / 100 keys, a 1+3 verify, a prefill chunk, a fresh prefill, an empty
# query, a first token, a 1+1 verify.
REQS = [(90, 1), (60, 4), (30, 3), (0, 5), (4, 0), (0, 1), (100, 2)]
PEAK, THRESHOLD = 8.0, 1e-2


def model_reference(args: tuple, sparse_v: SparseV | None) -> tuple[torch.Tensor, int]:
    return paged_attention_skips_ref(*args, sparse_v=sparse_v)


def check_skipping_matches_tiled_reference(attend: Callable[..., torch.Tensor], args: tuple,
                                           reference: Callable[..., tuple[torch.Tensor, int]],
                                           layout: dict[str, int], dtype: torch.dtype) -> None:  # fmt: skip
    """The kernel with THRESHOLD equals the tiled reference that skipped tiles, and skipping shows in the output
    (the reference without it is far from the kernel's result)."""
    sparse_v = SparseV(THRESHOLD, **layout)
    expected, num_skipped = reference(args, sparse_v=sparse_v)
    unskipped, none_skipped = reference(args, sparse_v=sparse_v._replace(threshold=0.0))
    assert num_skipped >= 5 and none_skipped == 0
    assert (expected - unskipped).abs().max() > 100 * TOL[dtype]
    out = attend(*args, **layout, sparse_v_threshold=THRESHOLD)
    assert_near(out, expected, dtype)
    assert_padding_zero(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", [LAYOUT, UNSPLIT], ids=["split", "unsplit"])
def test_threshold_zero_is_bitwise_off(dtype: torch.dtype, layout: dict[str, int]) -> None:
    args = attention_batch(REQS, 4, 2, 16, dtype, seed=21, peak=PEAK)
    off = paged_attention(*args, **layout)
    assert torch.equal(paged_attention(*args, **layout, sparse_v_threshold=0.0), off)
    assert not torch.equal(paged_attention(*args, **layout, sparse_v_threshold=THRESHOLD), off)  # the skip is live


@pytest.mark.parametrize("name", ["fp8", "turboquant_3bit_nc"])
def test_packed_threshold_zero_is_bitwise_off(name: str) -> None:
    fmt = FORMATS[name]
    args = packed_batch(fmt, REQS, 4, 2, 16, 4, torch.float32, seed=22, peak=PEAK)
    off = paged_attention_packed(*args, fmt, 16, **LAYOUT)
    assert torch.equal(paged_attention_packed(*args, fmt, 16, **LAYOUT, sparse_v_threshold=0.0), off)
    assert not torch.equal(paged_attention_packed(*args, fmt, 16, **LAYOUT, sparse_v_threshold=THRESHOLD), off)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("layout", [LAYOUT, UNSPLIT], ids=["split", "unsplit"])
def test_sparse_v_matches_tiled_reference(dtype: torch.dtype, layout: dict[str, int]) -> None:
    """fp64: the same skip decisions as the float64 reference and ~1e-12 from it; fp32 within fp32 rounding."""
    args = attention_batch(REQS, 6, 2, 16, dtype, seed=23, peak=PEAK)
    check_skipping_matches_tiled_reference(paged_attention, args, model_reference, layout, dtype)


@pytest.mark.parametrize(("name", "dtype"), [("fp8", torch.float32), ("turboquant_k8v4", torch.float64),
                                             ("turboquant_4bit_nc", torch.float32),
                                             ("turboquant_3bit_nc", torch.float64)])  # fmt: skip
def test_packed_sparse_v_matches_tiled_reference(name: str, dtype: torch.dtype) -> None:
    fmt = FORMATS[name]
    args = packed_batch(fmt, REQS, 4, 2, 16, 4, dtype, seed=24, peak=PEAK)
    attend = functools.partial(paged_attention_packed, fmt=fmt, head_dim=16)
    reference = functools.partial(packed_reference, fmt=fmt, head_dim=16)
    check_skipping_matches_tiled_reference(attend, args, reference, LAYOUT, dtype)


def test_sparse_v_with_many_splits_matches_tiled_reference() -> None:
    """Rows of 32 splits of 2 tiles (cap 32): each split decides its skips on its own running sum, and the merge of
    the 32 splits (in groups of split slots) equals the tiled reference's."""
    layout = dict(block_n=16, max_splits=32, min_split_keys=32)
    args = attention_batch([(1000, 1), (985, 2), (30, 1)], 4, 2, 16, torch.float32, seed=28, peak=14.0)
    check_skipping_matches_tiled_reference(paged_attention, args, model_reference, layout, torch.float32)


def check_skipping_rows_same_alone_and_in_batches(name: str | None, dtype: torch.dtype, num_heads: int,
                                                  head_dim: int, block_size: int, context: int, k: int,
                                                  layout: dict[str, int], peak: float) -> None:  # fmt: skip
    """A sequence's last k+1 rows with the skip on: bitwise the same alone, in a verify, in a prefill chunk and in
    a chunked mixed batch; the decodes alone skip tiles (counted by the reference on the recorded calls)."""
    fmt = None if name is None else FORMATS[name]
    kernel = paged_attention if fmt is None else functools.partial(paged_attention_packed, fmt=fmt, head_dim=head_dim)
    calls = []

    def attend(*args: torch.Tensor, **kwargs: int) -> torch.Tensor:
        calls.append(args)
        return kernel(*args, **layout, **kwargs, sparse_v_threshold=THRESHOLD)

    make_cache = model_cache(dtype, block_size) if fmt is None else packed_cache(fmt, block_size)
    row_bytes = workspace_row_bytes(num_heads, head_dim, layout["max_splits"], dtype)
    alone, *batched = rows_alone_and_in_batches(attend, make_cache, num_heads, 2, head_dim, block_size, context, k,
                                                dtype, row_bytes, peak=peak)  # fmt: skip
    for out in batched:
        assert torch.equal(alone, out)
    decode = None if fmt is None else functools.partial(fmt.decode, head_dim=head_dim, dtype=dtype)
    skips = [paged_attention_skips_ref(*args, decode=decode, sparse_v=SparseV(THRESHOLD, **layout))[1]
             for args in calls[: k + 1]]  # fmt: skip
    assert all(n > 0 for n in skips), skips


@pytest.mark.parametrize(("name", "dtype"), [(None, torch.float32), (None, torch.bfloat16),
                                             ("turboquant_k3v4_nc", torch.float32)])  # fmt: skip
def test_skipping_row_is_bitwise_same_alone_in_verify_and_in_mixed_batch(name: str | None, dtype: torch.dtype
                                                                          ) -> None:  # fmt: skip
    check_skipping_rows_same_alone_and_in_batches(name, dtype, 4, 16, 4, context=99, k=3, layout=LAYOUT,
                                                  peak=PEAK)  # fmt: skip


def _tile_by_tile(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, sv: SparseV
                  ) -> tuple[torch.Tensor, int]:  # fmt: skip
    """One row and kv head (q [G, D], keys / values [n, D]) as the kernels loop: splits, tiles, online softmax."""
    split_size, _ = split_layout(keys.shape[0], sv.block_n, sv.max_splits, sv.min_split_keys)
    parts, num_skipped = [], 0
    for a in range(0, keys.shape[0], split_size):
        m = torch.full(q.shape[:1], float("-inf"), dtype=q.dtype)
        l, acc = torch.zeros_like(m), torch.zeros_like(q)
        for t in range(a, min(a + split_size, keys.shape[0]), sv.block_n):
            b = min(t + sv.block_n, a + split_size, keys.shape[0])
            s = (q @ keys[t:b].T) * scale
            m_new = torch.maximum(m, s.amax(1))
            alpha, p = torch.exp(m - m_new), torch.exp(s - m_new[:, None])
            l = l * alpha + p.sum(1)
            skip = bool((p.amax(1) / l).amax() < sv.threshold)
            acc = acc * alpha[:, None] + (0 if skip else p @ values[t:b])
            m, num_skipped = m_new, num_skipped + skip
        parts.append((m, l, acc))
    m_i, l_i, acc_i = (torch.stack(x) for x in zip(*parts, strict=True))
    w = torch.exp(m_i - m_i.amax(0))
    return (acc_i * w[..., None]).sum(0) / (l_i * w).sum(0)[:, None], num_skipped


@pytest.mark.parametrize("threshold", [0.0, 1e-2, 5e-2])
def test_the_tiled_reference_is_the_tile_by_tile_recurrence(threshold: float) -> None:
    """``tiled_attention`` computes each row's tiles at once (closed forms of the running max and sum); a loop over
    splits and tiles, as the kernels run, gives the same outputs (float64 rounding) and skips the same tiles, on
    peaked rows of 1 to ~700 keys in layouts of 1 to 64 splits."""
    gen = torch.Generator().manual_seed(3)
    num_skipped = 0
    for num_keys, layout in [(1, LAYOUT), (37, UNSPLIT), (300, LAYOUT), (700, dict(block_n=32, max_splits=64,
                                                                                  min_split_keys=64))]:
        sv = SparseV(threshold, **layout)
        q = 6 * torch.randn(1, 8, 16, generator=gen, dtype=torch.float64)  # one row, 2 kv heads x 4: peaked scores
        keys = 2 * torch.randn(num_keys, 2, 16, generator=gen, dtype=torch.float64)
        values = torch.randn(num_keys, 2, 16, generator=gen, dtype=torch.float64)
        out, skipped = tiled_attention(q, keys, values, num_keys - 1, 0.25, sv)
        for h in range(2):
            expected, expected_skipped = _tile_by_tile(q[0, 4 * h:4 * h + 4], keys[:, h], values[:, h], 0.25, sv)
            torch.testing.assert_close(out[0, 4 * h:4 * h + 4], expected, rtol=1e-12, atol=1e-12)
            skipped -= expected_skipped
            num_skipped += expected_skipped
        assert skipped == 0
    assert (num_skipped > 0) == (threshold > 0)


def test_sparse_v_threshold_is_checked() -> None:
    args = attention_batch([(3, 1)], 2, 2, 16, torch.float32, seed=25)
    for bad in (-1e-3, 1.5, float("nan")):
        with pytest.raises(ValueError, match="sparse_v_threshold"):
            paged_attention(*args, sparse_v_threshold=bad)


# ------------------------------------------------------------------------- GPU: Qwen3.5-0.8B sizes, compiled
GPU_LAYOUT = dict(block_n=BLOCK_N, max_splits=MAX_SPLITS, min_split_keys=MIN_SPLIT_KEYS)  # the defaults
GPU_REQS = [(3000, 1), (1200, 4), (300, 33), (500, 0), (0, 1), (700, 1)]
GPU_PEAK = 64.0  # head_dim 256 and ~1000-key rows: the scores still fall by >= 0.1 a key (CPU: 644 tiles skipped)


@gpu
@needs_cuda
@pytest.mark.parametrize("name", [None, "fp8", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_3bit_nc"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_threshold_zero_is_bitwise_off_and_positive_matches_reference(name: str | None, dtype: torch.dtype
                                                                          ) -> None:  # fmt: skip
    if name is None:
        args = attention_batch(GPU_REQS, 8, 2, 256, dtype, seed=26, peak=GPU_PEAK)
        attend = paged_attention
        reference = model_reference
    else:
        fmt = FORMATS[name]
        args = packed_batch(fmt, GPU_REQS, 8, 2, 256, 16, dtype, seed=26, peak=GPU_PEAK)
        attend = functools.partial(paged_attention_packed, fmt=fmt, head_dim=256)
        reference = functools.partial(packed_reference, fmt=fmt, head_dim=256)
    off = attend(*args)
    assert torch.equal(attend(*args, sparse_v_threshold=0.0), off)
    # The GPU's exp is not float64's: a tile whose largest weight sits within a hair of the threshold may be
    # skipped by one and kept by the other (an fp32 difference up to that tile's weight x |v|, measured ~1.7e-4 on
    # an H100). Compare the rule where no tile is that close: the first threshold whose decisions do not change
    # within +-1% (the reference counts the same skips at both ends).
    threshold = next((t for t in (THRESHOLD, 0.8 * THRESHOLD, 1.25 * THRESHOLD, 0.6 * THRESHOLD, 1.6 * THRESHOLD)
                      if reference(args, sparse_v=SparseV(0.99 * t, **GPU_LAYOUT))[1]
                      == reference(args, sparse_v=SparseV(1.01 * t, **GPU_LAYOUT))[1]), None)
    assert threshold is not None, "every candidate threshold has a tile within 1% of it"
    out = attend(*args, sparse_v_threshold=threshold)
    expected, num_skipped = reference(args, sparse_v=SparseV(threshold, **GPU_LAYOUT))
    assert num_skipped > 100
    # The peaked scores reach ~|256|: fp32 rounds them by ~1e-5, so the kernel without skipping is already
    # ~1.8e-4 from float64 (H100). Skipping may add no error of its own: the skipping kernel is as close to the
    # skipping reference as the plain kernel is to plain attention (one tile decided differently: ~4e-3).
    own_error = (off - reference(args, sparse_v=None)[0]).abs().max().item()
    assert (out - expected).abs().max().item() <= max(TOL[dtype] * GPU_TOL_SCALE, 1.5 * own_error)
    assert not torch.equal(out, off)


@gpu
@needs_cuda
@pytest.mark.parametrize(("name", "dtype"), [(None, torch.bfloat16), ("turboquant_k8v4", torch.bfloat16),
                                             ("turboquant_4bit_nc", torch.bfloat16),  # its own warps (8)
                                             ("turboquant_k3v4_nc", torch.float32)])  # fmt: skip
def test_gpu_skipping_row_is_bitwise_same_alone_in_verify_and_in_mixed_batch(name: str | None, dtype: torch.dtype
                                                                              ) -> None:  # fmt: skip
    check_skipping_rows_same_alone_and_in_batches(name, dtype, 8, 256, 16, context=800, k=5, layout=GPU_LAYOUT,
                                                  peak=GPU_PEAK)  # fmt: skip
