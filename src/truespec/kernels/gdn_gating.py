"""Gated DeltaNet's per-token gates in one kernel (instead of ~12 torch ops), one program per token:

  g    = -exp(A_log) * softplus(a + dt_bias)     log decay, in the compute dtype
  beta = sigmoid(b)                              rounded to the model dtype, then to the compute dtype

as ``ops/gdn.py``'s ``gdn_gating_ref`` computes them. softplus is torch's:
x above 20 passes through, else log1p(exp(x)), with log1p(u) = log(1 + u) * u / ((1 + u) - 1), which
keeps full relative precision for tiny u (Triton has no log1p).

The arithmetic lives in one ``@triton.jit`` helper, ``gdn_gates``, which ``gdn_recurrent`` also calls when
given the raw ``GateInputs`` (it then computes each token's gates itself, saving this launch): both kernels
run the same operations in the same dtypes, so their g and beta are the same bits. This kernel serves
the chunked prefill path (fla's kernel takes g and beta tensors).
"""

import torch
import triton
import triton.language as tl

from truespec.kernels.triton_utils import tl_compute_dtype
from truespec.ops.gdn import GateInputs
from truespec.ops.precision import compute_dtype

SOFTPLUS_THRESHOLD = 20.0  # torch.nn.functional.softplus's default


@triton.jit
def gdn_gates(a, b, A_log, dt_bias, THRESHOLD: tl.constexpr, MODEL_DTYPE: tl.constexpr):
    """(g, beta) from a, b, A_log, dt_bias already loaded in the compute dtype (any one shape: a head's
    scalar or a row of heads); see the module docstring. The one copy of the gate arithmetic."""
    x = a + dt_bias
    u = tl.exp(tl.minimum(x, THRESHOLD))  # clamped: the branch that uses it never sees x > THRESHOLD
    w = 1.0 + u
    is_tiny = w == 1.0
    log1p_u = tl.where(is_tiny, u, tl.log(w) * (u / tl.where(is_tiny, 1.0, w - 1.0)))
    softplus = tl.where(x > THRESHOLD, x, log1p_u)
    g = -tl.exp(A_log) * softplus
    beta = (1.0 / (1.0 + tl.exp(-b))).to(MODEL_DTYPE).to(b.dtype)
    return g, beta


@triton.jit
def _gdn_gating_kernel(
    g_ptr,  # [T, HV] compute dtype, contiguous
    beta_ptr,  # [T, HV] compute dtype, contiguous
    a_ptr,  # [T, HV] model dtype
    b_ptr,  # [T, HV] model dtype
    A_log_ptr,  # [HV]
    dt_bias_ptr,  # [HV]
    stride_a_row,
    stride_b_row,
    HV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    THRESHOLD: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    mask = h < HV
    a = tl.load(a_ptr + token * stride_a_row + h, mask=mask, other=0.0).to(ACC_DTYPE)
    b = tl.load(b_ptr + token * stride_b_row + h, mask=mask, other=0.0).to(ACC_DTYPE)
    A_log = tl.load(A_log_ptr + h, mask=mask, other=0.0).to(ACC_DTYPE)
    dt_bias = tl.load(dt_bias_ptr + h, mask=mask, other=0.0).to(ACC_DTYPE)
    g, beta = gdn_gates(a, b, A_log, dt_bias, THRESHOLD, a_ptr.dtype.element_ty)
    tl.store(g_ptr + token * HV + h, g, mask=mask)
    tl.store(beta_ptr + token * HV + h, beta, mask=mask)


def gating_buffer_size(num_tokens: int, num_heads: int) -> int:
    """Elements of a ``gdn_gating(out=)`` buffer: g, then beta at a 16-byte aligned offset (fp32: 4 elements)."""
    return 2 * (-(-num_tokens * num_heads // 4) * 4)


def gdn_gating(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b [T, HV] (the in_proj_a / in_proj_b outputs, unit last stride, any row stride), A_log, dt_bias
    [HV], all in the model dtype. Returns (g, beta), each a contiguous [T, HV] in the compute dtype; with ``out`` (a
    contiguous buffer of at least ``gating_buffer_size(T, HV)`` compute-dtype elements) views of it."""
    GateInputs(a, b, A_log, dt_bias)  # validates
    num_tokens, num_heads = a.shape
    if out is None:
        g = torch.empty(num_tokens, num_heads, dtype=compute_dtype(a.dtype), device=a.device)
        beta = torch.empty_like(g)
    else:
        span = gating_buffer_size(num_tokens, num_heads) // 2
        if out.dtype != compute_dtype(a.dtype) or not out.is_contiguous() or out.numel() < 2 * span:
            raise ValueError(f"out must be a contiguous {compute_dtype(a.dtype)} buffer of >= {2 * span} elements")
        g, beta = (out.view(-1)[i * span:i * span + num_tokens * num_heads].view(num_tokens, num_heads) for i in (0, 1))
    if num_tokens > 0:
        _gdn_gating_kernel[(num_tokens,)](
            g, beta, a, b, A_log, dt_bias, a.stride(0), b.stride(0),
            HV=num_heads, BLOCK_H=triton.next_power_of_2(num_heads), THRESHOLD=SOFTPLUS_THRESHOLD,
            ACC_DTYPE=tl_compute_dtype(a.dtype),
        )  # fmt: skip
    return g, beta

