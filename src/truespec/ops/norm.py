"""RMSNorm in torch: plain weight (Llama, Qwen3), unit-offset weight (1 + w, Qwen3.5), gated (Qwen3.5 GDN
output), and the residual add fused in front of it.

normalize(x) = x * rsqrt(mean(x^2) + eps) runs in the compute dtype (fp32, fp64 for fp64 models); every cast
follows the transformers module it mirrors, because the cast orders round differently in bf16:

  plain:        w * normalize(x).to(dtype)                           scale in the model dtype
  unit offset:  (normalize(x) * (1 + w)).to(dtype)                   scale in the compute dtype
  gated:        ((w * normalize(x).to(dtype)) * silu(z)).to(dtype)   gate in the compute dtype
"""

import torch
import torch.nn.functional as F

from truespec.ops.precision import as_dtype, compute_dtype


def _rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) over the last dim, in the compute dtype."""
    h = as_dtype(x, compute_dtype(x.dtype))
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False, gate: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm of x [..., D] with weight [D]; ``gate`` [..., D] makes it the gated form (plain weight only).
    Returns [..., D] in x's dtype."""
    h = _rms_normalize(x, eps)
    if gate is not None:
        if unit_offset:
            raise ValueError("the gated RMSNorm uses a plain weight (unit_offset=False)")
        h = weight * as_dtype(h, x.dtype)
        return as_dtype(h * F.silu(as_dtype(gate, compute_dtype(x.dtype))), x.dtype)
    if unit_offset:
        return as_dtype(h * (1.0 + as_dtype(weight, h.dtype)), x.dtype)
    return weight * as_dtype(h, x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x), the sum rounded to the model dtype before it is normed."""
    residual = residual + x
    return rms_norm_ref(residual, weight, eps, unit_offset), residual
