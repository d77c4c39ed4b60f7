"""act(a) * b in one kernel: SwiGLU's silu(gate) * up, and gated attention's out * sigmoid(gate).

Mirrors ``ops/activation.py``'s ``act_mul_ref`` op by op: the activation is computed in fp32 (fp64 for fp64)
and rounded to the model dtype, then the product is computed and rounded, as the two torch ops do.
a and b are [T, N] or [T, H, N] views with a unit last stride (e.g. the halves of a merged gate/up output,
or the gate interleaved per head in Qwen3.5's q projection); the output is contiguous.
"""

import torch
import triton
import triton.language as tl

from truespec.kernels.triton_utils import tl_compute_dtype
from truespec.ops.activation import KERNEL_ACTIVATIONS

_MAX_BLOCK = 1024


@triton.jit
def act_mul_block(a, b, IS_SILU: tl.constexpr, ACC_DTYPE: tl.constexpr):
    """act(a) * b for a, b loaded in the model dtype, returned in it: the one arithmetic of this kernel and of
    the skinny matmul's fused input (kernels/skinny_matmul.py), so the two give the same bits."""
    dtype = a.dtype
    a = a.to(ACC_DTYPE)
    act = (a if IS_SILU else 1.0) / (1.0 + tl.exp(-a))  # silu(a) = a / (1 + e^-a), sigmoid(a) = 1 / (1 + e^-a)
    y = act.to(dtype).to(ACC_DTYPE) * b.to(ACC_DTYPE)  # the activation rounds to dtype first, as a torch op would
    return y.to(dtype)


@triton.jit
def _act_mul_kernel(
    out_ptr,  # [T, H, N] contiguous
    a_ptr,  # [T, H, N] (the activation's input)
    b_ptr,  # [T, H, N]
    stride_a_row,
    stride_a_head,
    stride_b_row,
    stride_b_head,
    N,
    BLOCK: tl.constexpr,
    IS_SILU: tl.constexpr,  # else sigmoid
    ACC_DTYPE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    n = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = n < N
    a = tl.load(a_ptr + row * stride_a_row + head * stride_a_head + n, mask=mask, other=0.0)
    b = tl.load(b_ptr + row * stride_b_row + head * stride_b_head + n, mask=mask, other=0.0)
    out = out_ptr + (row * tl.num_programs(1) + head) * N + n
    tl.store(out, act_mul_block(a, b, IS_SILU, ACC_DTYPE), mask=mask)


def act_mul(a: torch.Tensor, b: torch.Tensor, activation: str) -> torch.Tensor:
    """act(a) * b for a, b [T, N] or [T, H, N] of one dtype (unit last stride); ``activation`` silu/swish/sigmoid.
    Returns a contiguous tensor of a's shape."""
    if activation not in KERNEL_ACTIVATIONS:
        raise ValueError(f"act_mul supports {KERNEL_ACTIVATIONS}, got {activation!r}")
    if a.shape != b.shape or a.dtype != b.dtype or a.dim() not in (2, 3) or a.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError(f"a {tuple(a.shape)}, b {tuple(b.shape)}: one shape and dtype, 2 or 3 dims, unit last stride")
    out = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    a3, b3 = (a, b) if a.dim() == 3 else (a[:, None], b[:, None])
    num_rows, num_heads, n = a3.shape
    if out.numel() > 0:
        block = min(_MAX_BLOCK, triton.next_power_of_2(n))
        _act_mul_kernel[(num_rows, num_heads, triton.cdiv(n, block))](
            out, a3, b3, a3.stride(0), a3.stride(1), b3.stride(0), b3.stride(1), n,
            BLOCK=block, IS_SILU=activation != "sigmoid", ACC_DTYPE=tl_compute_dtype(a.dtype),
        )  # fmt: skip
    return out

