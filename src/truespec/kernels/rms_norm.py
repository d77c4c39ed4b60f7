"""Fused RMSNorm (plain / unit-offset) and gated RMSNorm, one program per row, matching ops/norm.py:

  plain:        w * normalize(x).to(dtype)                  (Llama, Qwen3: scale in the model dtype)
  unit offset:  (normalize(x) * (1 + w)).to(dtype)          (Qwen3.5: scale in the compute dtype)
  gated:        ((w * normalize(x).to(dtype)) * silu(z)).to(dtype)   (Qwen3.5 GDN output, gate in fp32)
with normalize(x) = x * rsqrt(mean(x^2) + eps) in fp32 (fp64 for fp64). Every cast the torch module
makes is made here too, so bf16 results round the same way up to the reduction order of mean(x^2).
"""

import torch
import triton
import triton.language as tl

from truespec.kernels.triton_utils import reduce_sum, tl_compute_dtype


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [N, D]
    x_ptr,  # [N, D]
    gate_ptr,  # [N // G, G, D] (read only if HAS_GATE): row r is gate[r // G, r % G], any outer strides
    weight_ptr,  # [D]
    eps: tl.float64,
    stride_x_row,
    stride_g_outer,
    stride_g_inner,
    stride_o_row,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
    HAS_GATE: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
):
    row = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    dtype = out_ptr.dtype.element_ty
    h = tl.load(x_ptr + row * stride_x_row + d, mask=mask, other=0.0).to(ACC_DTYPE)
    mean_sq = reduce_sum(h * h, 0) / D
    h = h * (1.0 / tl.sqrt(mean_sq + tl.full([], eps, ACC_DTYPE)))
    w = tl.load(weight_ptr + d, mask=mask, other=0.0)
    if UNIT_OFFSET:
        y = h * (1.0 + w.to(ACC_DTYPE))
    else:
        y = (w.to(ACC_DTYPE) * h.to(dtype).to(ACC_DTYPE)).to(dtype).to(ACC_DTYPE)  # product rounds to dtype
    if HAS_GATE:
        gate_row = gate_ptr + (row // G) * stride_g_outer + (row % G) * stride_g_inner
        z = tl.load(gate_row + d, mask=mask, other=0.0).to(ACC_DTYPE)
        y = y * (z / (1.0 + tl.exp(-z)))
    tl.store(out_ptr + row * stride_o_row + d, y.to(dtype), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False, gate: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm of x [..., D] with weight [D]; ``gate`` [..., D] makes it the gated form (plain weight only).
    The gate may be a strided view, e.g. heads [T, H, D] sliced out of a wider projection output: it is read
    in place as [-1, H, D] (no copy). Returns [..., D] in x's dtype."""
    if gate is not None and unit_offset:
        raise ValueError("the gated RMSNorm uses a plain weight (unit_offset=False)")
    dim = x.shape[-1]
    x2 = x.reshape(-1, dim)
    gate3 = x2[:, None] if gate is None else gate.reshape(-1, gate.shape[-2] if gate.dim() > 2 else 1, dim)
    if gate is not None and gate3.shape[0] * gate3.shape[1] != x2.shape[0]:
        raise ValueError(f"gate {tuple(gate.shape)} does not match x {tuple(x.shape)}")
    if x2.stride(-1) != 1 or gate3.stride(-1) != 1 or weight.dtype != x.dtype or weight.shape != (dim,):
        raise ValueError("x and gate need a unit last stride; weight must be [D] in x's dtype")
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](
            out, x2, gate3, weight, eps, x2.stride(0), gate3.stride(0), gate3.stride(1), out.stride(0),
            G=gate3.shape[1], D=dim, BLOCK_D=triton.next_power_of_2(dim), UNIT_OFFSET=unit_offset,
            HAS_GATE=gate is not None, ACC_DTYPE=tl_compute_dtype(x.dtype),
        )  # fmt: skip
    return out.view(x.shape)

