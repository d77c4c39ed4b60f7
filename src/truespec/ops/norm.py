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

from truespec.ops.precision import compute_dtype


def _rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) over the last dim, in the compute dtype."""
    h = x.to(compute_dtype(x.dtype))
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
        h = weight * h.to(x.dtype)
        return (h * F.silu(gate.to(compute_dtype(x.dtype)))).to(x.dtype)
    if unit_offset:
        return (h * (1.0 + weight.to(h.dtype))).to(x.dtype)
    return weight * h.to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x), the sum rounded to the model dtype before it is normed."""
    residual = residual + x
    return rms_norm_ref(residual, weight, eps, unit_offset), residual
