"""``y = x @ weight.T (+ bias)`` for the few rows of a decode step: a memory-bound matrix-vector kernel.

At batch size 1 a projection reads its whole weight matrix to produce one row, so its time is the weight's
bytes over the HBM bandwidth. On an H100, cuBLAS streams the 0.8B shape's projection weights at 1.87 TB/s at
one row, against a 3.0 TB/s copy rate; this kernel at 2.70 TB/s (BENCHMARKS.md). Each program owns
``BLOCK_N`` output columns for every row: it streams its ``BLOCK_N x K`` slice of the weight once, in
``BLOCK_K`` chunks, and accumulates each row's dot products in fp32.

It loops over rows on CUDA cores, so from two rows on cuBLAS is faster and the engine sends it only one-row
steps (layers/linear.py). It accepts more rows (tests, benchmarks): each row is computed by the same
instructions in the same order whatever the other rows are (the row loop is unrolled to the row count rounded
up to a power of two; each row's sums are its own), so a row's result does not depend on the other rows. The
block sizes are fixed, not autotuned per shape or batch.

With ``input_act`` the kernel reads a merged gate/up output ``[gate | up]`` ([M, 2K]) and computes its input
``act(gate) * up`` while it streams the weight: a gated MLP's down projection then needs no separate act_mul
launch (layers/linear.py). The input is computed by act_mul's own arithmetic (``act_mul_block``) and rounded
to the model dtype as act_mul writes it; the weight loop and the sums are unchanged, so the result is bitwise
``skinny_matmul(act_mul(gate, up, act), weight)``.
"""

import torch
import triton
import triton.language as tl

from truespec.kernels.act_mul import act_mul_block
from truespec.kernels.triton_utils import reduce_sum, tl_compute_dtype
from truespec.ops.linear import matmul_operands

MAX_ROWS = 8  # rows per launch (more rows: one launch per group of 8)
BLOCK_N, BLOCK_K, NUM_WARPS = 8, 1024, 8  # the fastest on the 0.8B shape's projections at one row (H100)


@triton.jit
def _load_row_chunk(x_ptr, offs_k, mask, K, HAS_ACT: tl.constexpr, IS_SILU: tl.constexpr,
                    ACT_DTYPE: tl.constexpr):
    """``BLOCK_K`` entries of an input row in fp32; with ``HAS_ACT`` the row is ``[gate | up]`` (2K wide) and
    its input is act(gate) * up, rounded to the model dtype exactly as the act_mul kernel writes it."""
    if HAS_ACT:
        gate = tl.load(x_ptr + offs_k, mask=mask, other=0.0)
        up = tl.load(x_ptr + K + offs_k, mask=mask, other=0.0)
        x = act_mul_block(gate, up, IS_SILU, ACT_DTYPE)
    else:
        x = tl.load(x_ptr + offs_k, mask=mask, other=0.0)
    return x.to(tl.float32)


@triton.jit
def _skinny_matmul_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                          HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, HAS_ACT: tl.constexpr, IS_SILU: tl.constexpr,
                          ACT_DTYPE: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = tl.arange(0, ROWS)
    acc = tl.full([ROWS, BLOCK_N], 0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                    mask=mask_n[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        for m in tl.static_range(ROWS):  # row by row: a row's sums never depend on the other rows
            x = _load_row_chunk(x_ptr + m * stride_xm, offs_k, mask_k & (m < M), K, HAS_ACT, IS_SILU, ACT_DTYPE)
            part = reduce_sum(w * x[None, :], 1)  # [BLOCK_N]
            acc = tl.where(rows[:, None] == m, acc + part[None, :], acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & mask_n[None, :])


def skinny_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  input_act: str | None = None, block_n: int = BLOCK_N, block_k: int = BLOCK_K,
                  num_warps: int = NUM_WARPS) -> torch.Tensor:
    """``x`` [M, K] (rows contiguous in K), ``weight`` [N, K] contiguous, ``bias`` [N] or None -> [M, N] in x's
    dtype. With ``input_act`` (silu/swish/sigmoid), ``x`` is a merged gate/up output [M, 2K] and the input is
    ``act_mul(gate, up, input_act)``, computed on the fly. Rows are processed ``MAX_ROWS`` at a time; the block
    arguments are for benchmarks only."""
    x, weight = matmul_operands("skinny_matmul", x, weight, input_act)
    k = weight.shape[-1]
    m, n = x.shape[0], weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, block_n),)
    for start in range(0, m, MAX_ROWS):  # more rows than MAX_ROWS: the same kernel per group of rows
        rows = min(MAX_ROWS, m - start)
        _skinny_matmul_kernel[grid](x[start:], weight, bias if bias is not None else weight, y[start:], rows, n, k,
                                    x.stride(0), weight.stride(0), y.stride(0), HAS_BIAS=bias is not None,
                                    ROWS=triton.next_power_of_2(rows), BLOCK_N=block_n, BLOCK_K=block_k,
                                    HAS_ACT=input_act is not None, IS_SILU=input_act != "sigmoid",
                                    ACT_DTYPE=tl_compute_dtype(x.dtype), num_warps=num_warps)
    return y

