"""The residual stream's add fused into the following RMSNorm, one program per row, matching
``ops/norm.py``'s ``add_rms_norm_ref``:

  residual' = (residual + x).to(dtype)         stored: the next layer adds to it
  out       = rms_norm(residual')              plain or unit-offset, exactly as kernels/rms_norm.py

The sum is rounded to the model dtype before it is normed, as the two torch ops round it.
"""

import torch
import triton
import triton.language as tl

from truespec.kernels.triton_utils import reduce_sum, tl_compute_dtype


@triton.jit
def _add_rms_norm_kernel(
    out_ptr,  # [N, D] contiguous
    residual_out_ptr,  # [N, D] contiguous
    x_ptr,  # [N, D]
    residual_ptr,  # [N, D]
    weight_ptr,  # [D]
    eps: tl.float64,
    stride_x_row,
    stride_r_row,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x_row + d, mask=mask, other=0.0).to(ACC_DTYPE)
    r = tl.load(residual_ptr + row * stride_r_row + d, mask=mask, other=0.0).to(ACC_DTYPE)
    s = (r + x).to(dtype)
    tl.store(residual_out_ptr + row * D + d, s, mask=mask)
    h = s.to(ACC_DTYPE)
    mean_sq = reduce_sum(h * h, 0) / D
    h = h * (1.0 / tl.sqrt(mean_sq + tl.full([], eps, ACC_DTYPE)))
    w = tl.load(weight_ptr + d, mask=mask, other=0.0)
    w = w.to(ACC_DTYPE)
    y = h * (1.0 + w) if UNIT_OFFSET else w * h.to(dtype).to(ACC_DTYPE)  # plain: cast, then scale in the dtype
    tl.store(out_ptr + row * D + d, y.to(dtype), mask=mask)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [N, D] (unit last stride), weight [D], one dtype. Returns (rms_norm(residual + x),
    residual + x), both new contiguous [N, D] tensors."""
    if x.shape != residual.shape or x.dim() != 2 or weight.shape != (x.shape[-1],):
        raise ValueError(f"x {tuple(x.shape)}, residual {tuple(residual.shape)}, weight {tuple(weight.shape)}")
    if x.stride(-1) != 1 or residual.stride(-1) != 1 or not x.dtype == residual.dtype == weight.dtype:
        raise ValueError("x and residual need a unit last stride; x, residual and weight one dtype")
    num_rows, dim = x.shape
    out = torch.empty(num_rows, dim, dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(out)
    if num_rows > 0:
        _add_rms_norm_kernel[(num_rows,)](
            out, residual_out, x, residual, weight, eps, x.stride(0), residual.stride(0),
            D=dim, BLOCK_D=triton.next_power_of_2(dim), UNIT_OFFSET=unit_offset, ACC_DTYPE=tl_compute_dtype(x.dtype),
        )  # fmt: skip
    return out, residual_out

