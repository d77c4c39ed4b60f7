"""RMSNorm variants: plain weight (Llama/Qwen3), unit-offset (1 + w, Qwen3.5) and gated (Qwen3.5 GDN).

``RMSNorm.add_norm`` is the residual stream's pre-norm: ``residual + x`` and its norm in one step (one
fused kernel on CUDA), so a decoder layer never launches a separate residual add. The math, and the
cast order each variant follows, is ``ops/norm.py``'s.
"""

import torch
from torch import nn

from truespec.cpu_kernels import norm as cpu_norm
from truespec.layers.backend import kernels, use_kernels
from truespec.ops.norm import add_rms_norm_ref, rms_norm_ref


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
        if cpu_norm.can_run(x, self.weight):  # one compiled call instead of ~7 torch ops
            return cpu_norm.rms_norm(x, self.weight, self.eps, self.unit_offset)[0]
        return rms_norm_ref(x, self.weight, self.eps, self.unit_offset)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); ``residual`` None: x starts the stream, (norm(x), x).
        x, residual: [T, dim]. On CUDA the add and the norm are one kernel."""
        if residual is None:
            return self(x), x
        if use_kernels(x) and x.stride(-1) == 1 and residual.stride(-1) == 1:
            return kernels().add_rms_norm(x, residual, self.weight, self.eps, unit_offset=self.unit_offset)
        if cpu_norm.can_run(x, self.weight) and residual.shape == x.shape and residual.dtype == x.dtype \
                and residual.stride(-1) == 1:
            return cpu_norm.rms_norm(x, self.weight, self.eps, self.unit_offset, residual)
        return add_rms_norm_ref(x, residual, self.weight, self.eps, self.unit_offset)

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
        return rms_norm_ref(x, self.weight, self.eps, gate=gate)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
