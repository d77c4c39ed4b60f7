"""Rows times the normalised Sylvester Hadamard matrix H_D (ops/kv_quant.py ``hadamard``, torch reference ``rotate``)
by the fast Walsh-Hadamard transform: log2(D) butterfly stages of sums and differences, then one product by
H[0, 0] = 1 / sqrt(D) rounded (every entry of H is +-H[0, 0]). D log D additions where the [D, D] product takes D^2
multiply-adds: the TurboQuant formats rotate each key on store (kernels/kv_store_packed.py) and each query once per
step (kernels/paged_attention_packed.py) this way.

Each row is transformed by itself in a fixed order, so its bits do not depend on how many rows share the call
(invariant 4: a query row rotates to the same bits in a decode and in a verify). Against ``x @ H`` the sums are
associated differently (and 1 / sqrt(D), inexact at odd powers of two, multiplies each sum once instead of each
term): the last bits may differ (tests/test_hadamard.py).
"""

from functools import cache

import torch
import triton
import triton.language as tl

from truespec.kernels.triton_utils import tl_compute_dtype
from truespec.ops.kv_quant import hadamard
from truespec.ops.precision import compute_dtype

BLOCK_ROWS = 16


@triton.jit
def walsh_hadamard(x, D: tl.constexpr):
    """x [R, D] times the Sylvester matrix of +-1 entries (H_2n = [[H, H], [H, -H]]) along its last axis: stage s
    pairs x[:, i] with x[:, i + 2^s] into (sum, difference) within blocks of 2^(s + 1)."""
    R: tl.constexpr = x.shape[0]
    for stage in tl.static_range(D.bit_length() - 1):
        pairs = tl.permute(tl.reshape(x, [R, D // (2 << stage), 2, 1 << stage]), [0, 1, 3, 2])  # [R, ., 2^s, 2]
        a, b = tl.split(pairs)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), [0, 1, 3, 2]), [R, D])
    return x


@triton.jit
def _rotate_rows_kernel(x_ptr, out_ptr, h00_ptr, num_rows, stride_x_row, D: tl.constexpr, BLOCK_R: tl.constexpr,
                        COMPUTE_DTYPE: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, D)
    mask = rows[:, None] < num_rows
    x = tl.load(x_ptr + rows[:, None] * stride_x_row + d[None, :], mask=mask, other=0.0).to(COMPUTE_DTYPE)
    tl.store(out_ptr + rows[:, None] * D + d[None, :], walsh_hadamard(x, D) * tl.load(h00_ptr), mask=mask)


@cache
def h00(head_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """H[0, 0] of ``hadamard(head_dim, dtype)`` as a 1-element tensor on ``device`` (cached: no host-to-device copy
    once warmed up)."""
    return hadamard(head_dim, dtype, device)[0, :1].contiguous()


def rotate_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (D a power of two, unit last stride) @ H_D in the compute dtype (fp32; fp64 for fp64 x), a new
    tensor. No host sync; CUDA-graph capturable once H[0, 0] is cached (a first eager call)."""
    head_dim = x.shape[-1]
    if head_dim < 2 or head_dim & (head_dim - 1) or x.stride(-1) != 1:
        raise ValueError(f"rotate_rows needs a power-of-two last dim >= 2 with unit stride, got {tuple(x.shape)}")
    rows = x.reshape(-1, head_dim)
    out = torch.empty(rows.shape, dtype=compute_dtype(x.dtype), device=x.device)
    if rows.shape[0]:
        _rotate_rows_kernel[(triton.cdiv(rows.shape[0], BLOCK_ROWS),)](
            rows, out, h00(head_dim, out.dtype, x.device), rows.shape[0], rows.stride(0), D=head_dim,
            BLOCK_R=BLOCK_ROWS, COMPUTE_DTYPE=tl_compute_dtype(x.dtype))  # fmt: skip
    return out.view(x.shape)
