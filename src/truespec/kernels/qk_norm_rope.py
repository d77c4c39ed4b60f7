"""Per-head q/k RMSNorm (optional) and neox RoPE of q and k in one kernel, one program per (token, head).

Matches ``ops/rotary.py``'s ``qk_norm_rope_ref`` op by op: the norm is ``ops/norm.py``'s (plain
or unit-offset weight, rounded to the model dtype), then over the first ``rotary_dim`` dims
``x * cos + rotate_half(x) * sin`` with each product and the sum rounded to the model dtype, as the torch
ops round them; dims past ``rotary_dim`` (partial rotary) pass through. rotate_half(x)[d] is -x[d + R/2]
for d < R/2 and x[d - R/2] after, so each program loads its head twice: at d and at the partner dim.
"""

import torch
import triton
import triton.language as tl

from truespec.kernels.triton_utils import reduce_sum, tl_compute_dtype


@triton.jit
def _normed(x, w, rstd, DTYPE: tl.constexpr, HAS_NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr):
    """x [BLOCK_D] in the compute dtype -> its (optionally) normed value, rounded to ``DTYPE``."""
    y = x
    if HAS_NORM:
        h = x * rstd
        y = h * (1.0 + w) if UNIT_OFFSET else w * h.to(DTYPE).to(w.dtype)  # plain: cast, then scale in DTYPE
    return y.to(DTYPE).to(x.dtype)


@triton.jit
def _qk_norm_rope_kernel(
    q_out_ptr,  # [T, H, D] contiguous
    k_out_ptr,  # [T, HK, D] contiguous
    q_ptr,  # [T, H, D]
    k_ptr,  # [T, HK, D]
    cos_ptr,  # [T, R]
    sin_ptr,  # [T, R]
    q_weight_ptr,  # [D] (read only if HAS_NORM)
    k_weight_ptr,  # [D]
    eps: tl.float64,
    stride_q_row,
    stride_q_head,
    stride_k_row,
    stride_k_head,
    stride_cos_row,
    stride_sin_row,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    D: tl.constexpr,
    R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_NORM: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # 0..H-1: q heads, H..H+HK-1: k heads
    if head < NUM_Q_HEADS:
        src = q_ptr + token * stride_q_row + head * stride_q_head
        dst = q_out_ptr + (token * NUM_Q_HEADS + head) * D
        w_ptr = q_weight_ptr
    else:
        src = k_ptr + token * stride_k_row + (head - NUM_Q_HEADS) * stride_k_head
        dst = k_out_ptr + (token * NUM_K_HEADS + head - NUM_Q_HEADS) * D
        w_ptr = k_weight_ptr
    dtype = q_out_ptr.dtype.element_ty
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    is_rot = d < R
    is_first_half = d < R // 2
    partner = tl.where(is_first_half, d + R // 2, d - R // 2)
    x = tl.load(src + d, mask=mask, other=0.0).to(ACC_DTYPE)
    x_partner = tl.load(src + partner, mask=is_rot, other=0.0).to(ACC_DTYPE)
    rstd = tl.full([], 1.0, ACC_DTYPE)
    w = x
    w_partner = x_partner
    if HAS_NORM:
        rstd = 1.0 / tl.sqrt(reduce_sum(x * x, 0) / D + tl.full([], eps, ACC_DTYPE))
        w = tl.load(w_ptr + d, mask=mask, other=0.0).to(ACC_DTYPE)
        w_partner = tl.load(w_ptr + partner, mask=is_rot, other=0.0).to(ACC_DTYPE)
    y = _normed(x, w, rstd, dtype, HAS_NORM, UNIT_OFFSET)
    y_partner = _normed(x_partner, w_partner, rstd, dtype, HAS_NORM, UNIT_OFFSET)
    y_partner = tl.where(is_first_half, -y_partner, y_partner)  # rotate_half
    cos = tl.load(cos_ptr + token * stride_cos_row + d, mask=is_rot, other=0.0).to(ACC_DTYPE)
    sin = tl.load(sin_ptr + token * stride_sin_row + d, mask=is_rot, other=0.0).to(ACC_DTYPE)
    rotated = (y * cos).to(dtype).to(ACC_DTYPE) + (y_partner * sin).to(dtype).to(ACC_DTYPE)
    tl.store(dst + d, tl.where(is_rot, rotated, y).to(dtype), mask=mask)


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [T, HK, D] (unit last stride, any row/head strides: views of a merged qkv output are
    fine); cos, sin [T, R] in q's dtype (R even, <= D). With weights [D], each head is RMSNormed first.
    Returns new contiguous (q, k)."""
    (num_tokens, num_q_heads, head_dim), num_k_heads = q.shape, k.shape[1]
    rotary_dim = cos.shape[-1]
    if k.shape != (num_tokens, num_k_heads, head_dim) or cos.shape != sin.shape or cos.shape[0] != num_tokens:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    if rotary_dim % 2 or rotary_dim > head_dim or (q_weight is None) != (k_weight is None):
        raise ValueError(f"rotary_dim {rotary_dim} must be even and <= head_dim {head_dim}; both weights or none")
    if any(t.stride(-1) != 1 or t.dtype != q.dtype for t in (q, k, cos, sin)):
        raise ValueError("q, k, cos and sin need a unit last stride and q's dtype")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    has_norm = q_weight is not None
    if num_tokens > 0:
        _qk_norm_rope_kernel[(num_tokens, num_q_heads + num_k_heads)](
            q_out, k_out, q, k, cos, sin, q_weight if has_norm else q, k_weight if has_norm else k, eps,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
            NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, D=head_dim, R=rotary_dim,
            BLOCK_D=triton.next_power_of_2(head_dim), HAS_NORM=has_norm, UNIT_OFFSET=unit_offset,
            ACC_DTYPE=tl_compute_dtype(q.dtype),
        )  # fmt: skip
    return q_out, k_out

