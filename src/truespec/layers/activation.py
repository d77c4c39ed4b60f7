"""Activation functions by their HF config name (``hidden_act``), and the gated products built on them.

``act_and_mul`` (SwiGLU's ``act(gate) * up`` of a merged gate/up projection) and ``sigmoid_gate``
(Qwen3.5 attention's ``out * sigmoid(gate)``) are one Triton kernel each on CUDA; the torch forms below
are the CPU path and the kernels' reference (``kernels/act_mul.py``).
"""

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from truespec.layers.backend import kernels, use_kernels

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
    "sigmoid": torch.sigmoid,
}
KERNEL_ACTIVATIONS = ("silu", "swish", "sigmoid")  # those kernels/act_mul.py implements


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation named ``name`` (an HF ``hidden_act``); ValueError naming it if unsupported."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def act_mul_torch(a: torch.Tensor, b: torch.Tensor, activation: str) -> torch.Tensor:
    """act(a) * b: the activation rounds to the model dtype, then the product does (as two torch ops)."""
    return get_activation(activation)(a) * b


def can_use_act_mul_kernel(a: torch.Tensor, b: torch.Tensor, activation: str) -> bool:
    return use_kernels(a) and activation in KERNEL_ACTIVATIONS and a.stride(-1) == 1 and b.stride(-1) == 1


def act_and_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """[T, 2 * I] output of a merged gate/up projection -> act(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    if can_use_act_mul_kernel(gate, up, activation):
        return kernels().act_mul(gate, up, activation)
    return act_mul_torch(gate, up, activation)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate) for x, gate of one shape ([T, H, D]; gate may be a strided view)."""
    if can_use_act_mul_kernel(gate, x, "sigmoid"):
        return kernels().act_mul(gate, x, "sigmoid")
    return x * torch.sigmoid(gate)
