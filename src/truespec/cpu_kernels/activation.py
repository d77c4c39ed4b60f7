"""Qwen3.5 attention's output gate ``x * sigmoid(gate)`` of float32 / float64 rows in one compiled call
(activation_core.c): the CPU path of layers/activation.sigmoid_gate where build.py could build it, and the gate stage
of attention_layer.c (so a row's gate has the same bits on both paths)."""

import torch

from truespec.cpu_kernels import build


def can_run(x: torch.Tensor, gate: torch.Tensor) -> bool:
    """x, gate [T, H, D] of one float32 / float64 dtype on the CPU (unit last strides), no autograd to record, the
    library built."""
    return x.device.type == "cpu" and x.dim() == 3 and x.shape == gate.shape and x.dtype in build.SCALARS \
        and gate.dtype == x.dtype and x.stride(-1) == 1 and gate.stride(-1) == 1 and not build.tracks_grad(x, gate) \
        and build.load() is not None


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate), a new contiguous [T, H, D] tensor. Check ``can_run`` first."""
    num_tokens, num_heads, head_dim = x.shape
    out = torch.empty(x.shape, dtype=x.dtype)
    suffix, _ = build.SCALARS[x.dtype]
    p, i = build.POINTER, build.INT
    build.function(f"sigmoid_gate_{suffix}", [p, i, i, p, i, i, i, i, i, p])(
        x.data_ptr(), x.stride(0), x.stride(1), gate.data_ptr(), gate.stride(0), gate.stride(1), num_tokens,
        num_heads, head_dim, out.data_ptr())  # fmt: skip
    return out
