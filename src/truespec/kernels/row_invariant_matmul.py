"""``y = x @ weight.T (+ bias)`` whose every row is bitwise the same whatever other rows share the call.

A decode row and the same row inside a verify of 1 + k rows, or among other requests, or beside a prefill chunk,
must give the same bits (docs/ARCHITECTURE.md, invariant 4): cuBLAS picks its algorithm (split-K, tile shape)
from the row count, and a one-row matrix-vector kernel and a GEMM round differently, which was measured to
change bf16 tokens at batch size 1. Here a row's result depends only on the weight's shape:

* The reduction over K is cut into ``split`` segments whose bounds depend on (N, K) only (``plan``). Each
  segment's products are chained into an fp32 accumulator that starts at zero (``tl.dot``'s accumulator
  operand, chunk after chunk); the segments are then added in order, ``((s0 + s1) + s2) + ...``, then the
  bias, then one rounding to the output dtype.
* The tile depends on the row count (``TILES``): up to ``PARALLEL_MAX_M`` rows (decode and verify steps) the
  products are "swapped" (weight rows on the MMA's 64-wide side, input rows on its narrow side, so one row
  still uses the tensor cores) and each segment is its own program, its sums written to an fp32 workspace and
  added by ``_sum_segments`` (split-K spreads a narrow weight over every SM: a decode step streams weights).
  More rows (long prefill chunks): a large plain tile whose program adds its segments itself, in the same order;
  16-bit operands that TMA can stream take kernels/prefill_matmul.py instead (the same sums, a persistent grid).

Every tile feeds the tensor cores the same products in the same order, so the paths agree bitwise when the MMA's
per-element result does not depend on the tile's shape or the chunk width: true on the H100 (benchmarks/
batch_invariance_cost.py, BENCHMARKS.md), and checked on every card the GPU tests run on
(tests/test_row_invariant_matmul.py). The interpreter emulates the products with one fixed-order sum per chunk.

With ``input_act`` the input is a merged gate/up output ``[gate | up]`` ([M, 2K]) and the kernel computes
``act(gate) * up`` as it loads each chunk (act_mul's own arithmetic, rounded to the model dtype): a gated MLP's
down projection is then one launch, bitwise ``row_invariant_matmul(act_mul(gate, up, act), weight)``.
"""

import torch
import triton
import triton.language as tl

from truespec.kernels import prefill_matmul
from truespec.kernels.act_mul import act_mul, act_mul_block
from truespec.kernels.triton_utils import is_interpreter, reduce_sum, tl_compute_dtype
from truespec.ops.linear import matmul_operands

SEGMENT_K = 128  # segment bounds are multiples of this (a function of K only: part of the result)
# Tile per row count: (up to rows, (weight rows, input rows, K chunk, warps, stages, swapped)). The products are
# chained into the accumulator (tl.dot's acc operand), so the K chunk does not change the bits on the tested
# cards; the interpreter sums each chunk first, so there every tile uses SEGMENT_K (``_tile``).
TILES = [(16, (64, 16, 128, 4, 3, True)), (32, (64, 32, 128, 4, 4, True)), (64, (64, 64, 128, 4, 3, True)),
         (512, (64, 128, 128, 4, 3, True)), (None, (128, 128, 128, 8, 3, False))]  # H100 sweep, BENCHMARKS.md
PARALLEL_MAX_M = 512  # up to this many rows the segments run in parallel programs (narrow weights need them)
_TARGET_PROGRAMS = 64  # column blocks x segments at which a narrow weight's stream is spread enough (H100)
_SHARED_MEMORY = 200 * 1024  # bytes of operand buffers a tile may stage (H100: 227 KB per SM)


def _tile(m: int, element_size: int) -> tuple[int, int, int, int, int, bool]:
    """(weight rows, input rows, K chunk, warps, stages, swapped) of the tile for ``m`` rows; the K chunk is halved
    until the staged operands fit the shared memory (fp32 operands take twice bf16's)."""
    block_n, block_m, block_k, warps, stages, swap = next(t for limit, t in TILES if limit is None or m <= limit)
    if is_interpreter():
        return block_n, block_m, SEGMENT_K, warps, stages, swap
    while (block_n + block_m) * block_k * element_size * stages > _SHARED_MEMORY and block_k > 16:
        block_k //= 2
    return block_n, block_m, block_k, warps, stages, swap


def _prefill_tile() -> tuple[int, int, int, int, int]:
    """prefill_matmul's tile; in the interpreter its K chunk is SEGMENT_K, the chunk the small tiles sum at once."""
    block_m, block_n, block_k, stages, warps = prefill_matmul.TILE
    return block_m, block_n, SEGMENT_K if is_interpreter() else block_k, stages, warps


def plan(n: int, k: int) -> int:
    """Segments of the K reduction for a weight [n, k]: a function of the weight's shape only. Narrow weights
    (the 0.8B shape's o / down / out projections, n = 1024) get up to 4, so the small tile keeps every SM
    streaming; wide ones need none."""
    column_blocks = triton.cdiv(n, 64)
    split = 1
    while split < 4 and column_blocks * split < _TARGET_PROGRAMS and k >= 2 * split * 4 * SEGMENT_K:
        split *= 2
    return split


@triton.jit
def _load_input(ptrs, mask, K, HAS_ACT: tl.constexpr, IS_SILU: tl.constexpr, ACC_DTYPE: tl.constexpr):
    """The input chunk [rows, BLOCK_K] in the model dtype; with ``HAS_ACT`` act(gate) * up from ``[gate | up]``."""
    if HAS_ACT:
        gate = tl.load(ptrs, mask=mask, other=0.0)
        up = tl.load(ptrs + K, mask=mask, other=0.0)
        return act_mul_block(gate, up, IS_SILU, ACC_DTYPE)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _segment_sum(x_ptr, w_ptr, offs_m, offs_n, mask_m, mask_n, k_start, k_end, K, stride_xm, stride_wn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr,
                 EVEN_K: tl.constexpr, HAS_ACT: tl.constexpr, IS_SILU: tl.constexpr, ACC_DTYPE: tl.constexpr,
                 INTERPRETED: tl.constexpr):
    """fp32 sums over K columns [k_start, k_end), chunk after chunk from zero: [BLOCK_N, BLOCK_M] with SWAP
    (weight rows on the MMA's M side), else [BLOCK_M, BLOCK_N]. EVEN_K: no chunk runs past k_end (no K mask)."""
    acc = tl.full([BLOCK_N, BLOCK_M] if SWAP else [BLOCK_M, BLOCK_N], 0, tl.float32)
    offs_k = k_start + tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K], advanced per chunk
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    for _ in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
            x = _load_input(x_ptrs, mask_m[:, None], K, HAS_ACT, IS_SILU, ACC_DTYPE)
        else:
            mask_k = offs_k < k_end
            w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            x = _load_input(x_ptrs, mask_m[:, None] & mask_k[None, :], K, HAS_ACT, IS_SILU, ACC_DTYPE)
            offs_k += BLOCK_K
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        if INTERPRETED:  # numpy's matmul sums in an order that depends on the tile's shape; this sum does not
            if SWAP:
                acc = acc + reduce_sum(w.to(tl.float32)[:, None, :] * x.to(tl.float32)[None, :, :], 2)
            else:
                acc = acc + reduce_sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], 2)
        elif SWAP:
            acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")  # fp32 operands: never TF32
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    return acc


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, M, N, K, SEGMENT, stride_xm, stride_wn, stride_ym,
                   SPLIT: tl.constexpr, PARALLEL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr, EVEN_K: tl.constexpr,
                   HAS_ACT: tl.constexpr, IS_SILU: tl.constexpr, ACC_DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """One tile of BLOCK_N columns x BLOCK_M rows. PARALLEL (always SWAP): this program sums segment
    program_id(2) into the workspace [SPLIT, M, N]; else it sums all SPLIT segments in order, adds the bias
    and writes y."""
    offs_n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # vocab x hidden > 2^31
    offs_m = (tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    mask_n = offs_n < N
    mask_m = offs_m < M
    if PARALLEL:
        s = tl.program_id(2)
        part = _segment_sum(x_ptr, w_ptr, offs_m, offs_n, mask_m, mask_n, s * SEGMENT,
                            tl.minimum(K, (s + 1) * SEGMENT), K, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K,
                            True, EVEN_K, HAS_ACT, IS_SILU, ACC_DTYPE, INTERPRETED)
        tl.store(ws_ptr + (s * M + offs_m[None, :]) * N + offs_n[:, None], part,
                 mask=mask_n[:, None] & mask_m[None, :])
    else:
        total = _segment_sum(x_ptr, w_ptr, offs_m, offs_n, mask_m, mask_n, 0, tl.minimum(K, SEGMENT), K,
                             stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, SWAP, EVEN_K, HAS_ACT, IS_SILU,
                             ACC_DTYPE, INTERPRETED)
        for s in tl.static_range(1, SPLIT):
            total = total + _segment_sum(x_ptr, w_ptr, offs_m, offs_n, mask_m, mask_n, s * SEGMENT,
                                         tl.minimum(K, (s + 1) * SEGMENT), K, stride_xm, stride_wn, BLOCK_M,
                                         BLOCK_N, BLOCK_K, SWAP, EVEN_K, HAS_ACT, IS_SILU, ACC_DTYPE, INTERPRETED)
        if SWAP:
            if HAS_BIAS:
                total = total + tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
            tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], total.to(y_ptr.dtype.element_ty),
                     mask=mask_n[:, None] & mask_m[None, :])
        else:
            if HAS_BIAS:
                total = total + tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], total.to(y_ptr.dtype.element_ty),
                     mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _sum_segments(ws_ptr, b_ptr, y_ptr, M, N, stride_ym, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BLOCK: tl.constexpr):
    """y = ((ws[0] + ws[1]) + ...) + bias, rounded once: the same additions as the non-parallel path."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    total = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        total = total + tl.load(ws_ptr + s * M * N + offs, mask=mask, other=0.0)
    n = offs % N
    if HAS_BIAS:
        total = total + tl.load(b_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + (offs // N) * stride_ym + n, total.to(y_ptr.dtype.element_ty), mask=mask)


def row_invariant_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         input_act: str | None = None) -> torch.Tensor:
    """``x`` [M, K] (unit last stride), ``weight`` [N, K], ``bias`` [N] or None -> [M, N] in x's dtype (bf16,
    fp16 or fp32; fp32 products are IEEE, never TF32). With ``input_act`` (silu/swish/sigmoid) ``x`` is a merged
    gate/up output [M, 2K] and the input is ``act_mul(gate, up, input_act)``."""
    x, weight = matmul_operands("row_invariant_matmul", x, weight, input_act)
    n, k = weight.shape
    m = x.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    split = plan(n, k)
    segment = triton.cdiv(triton.cdiv(k, split), SEGMENT_K) * SEGMENT_K
    if m > PARALLEL_MAX_M:
        tile = _prefill_tile()
        if prefill_matmul.can_run(x, weight, segment, tile[2]):
            if input_act is not None:
                x = act_mul(*x.chunk(2, dim=-1), input_act)  # the fused input's bits, in a launch of its own
            return prefill_matmul.prefill_matmul(x, weight, bias, split, segment, tile)
    parallel = m <= PARALLEL_MAX_M and split > 1
    block_n, block_m, block_k, warps, stages, swap = _tile(m, x.element_size())
    ws = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if parallel else y
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split if parallel else 1)
    _matmul_kernel[grid](x, weight, bias if bias is not None else weight, y, ws, m, n, k, segment, x.stride(0),
                         weight.stride(0), y.stride(0), SPLIT=split, PARALLEL=parallel, HAS_BIAS=bias is not None,
                         BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SWAP=swap or parallel,
                         EVEN_K=k % block_k == 0 and segment % block_k == 0, HAS_ACT=input_act is not None,
                         IS_SILU=input_act != "sigmoid", ACC_DTYPE=tl_compute_dtype(x.dtype),
                         INTERPRETED=is_interpreter(), num_warps=warps, num_stages=1 if is_interpreter() else stages)
    if parallel:
        block = 1024
        _sum_segments[(triton.cdiv(m * n, block),)](ws, bias if bias is not None else weight, y, m, n, y.stride(0),
                                                     SPLIT=split, HAS_BIAS=bias is not None, BLOCK=block)
    return y
