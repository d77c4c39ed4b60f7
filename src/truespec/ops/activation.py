"""Activation functions by their HF config name (``hidden_act``), and ``act(a) * b``, the gated product of
SwiGLU (``silu(gate) * up``) and of Qwen3.5's gated attention (``sigmoid(gate) * out``)."""

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

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


def act_mul_ref(a: torch.Tensor, b: torch.Tensor, activation: str) -> torch.Tensor:
    """act(a) * b: the activation rounds to the model dtype, then the product does (as two torch ops)."""
    return get_activation(activation)(a) * b
