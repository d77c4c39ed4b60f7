"""RMSNorm variants: plain weight (Llama/Qwen3), unit-offset (1 + w, Qwen3.5) and gated (Qwen3.5 GDN)."""

import torch
import torch.nn.functional as F
from torch import nn

from truespec.layers.backend import kernels, use_kernels
from truespec.layers.precision import compute_dtype


def _rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) over the last dim, in the compute dtype."""
    h = x.to(compute_dtype(x.dtype))
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim.

    ``unit_offset=False`` (Llama, Qwen3): ``w * norm(x).to(dtype)`` (cast, then scale in the model dtype).
    ``unit_offset=True`` (Qwen3.5): ``(norm(x) * (1 + w)).to(dtype)`` (scale in the compute dtype, then
    cast); the weight is stored as the offset from 1, initialised to 0. The two cast orders round
    differently in bf16, so each follows its transformers counterpart exactly.
    """

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_kernels(x) and x.stride(-1) == 1:  # one fused kernel (tests/test_kernels.py: same formula)
            return kernels().rms_norm(x, self.weight, self.eps, unit_offset=self.unit_offset)
        h = _rms_normalize(x, self.eps)
        if self.unit_offset:
            return (h * (1.0 + self.weight.to(h.dtype))).to(x.dtype)
        return self.weight * h.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, unit_offset={self.unit_offset}"


class GatedRMSNorm(nn.Module):
    """``w * rmsnorm(x) * silu(z)`` per head (Qwen3.5 GDN output norm; plain weight, init 1)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        # x, gate: [..., dim]. Norm before gate; the gate is applied in the compute dtype.
        h = _rms_normalize(x, self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * F.silu(gate.to(compute_dtype(x.dtype)))).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
