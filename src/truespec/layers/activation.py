"""The gated products built on an activation: ``act_and_mul`` (SwiGLU's ``act(gate) * up`` of a merged gate/up
projection) and ``sigmoid_gate`` (Qwen3.5 attention's ``out * sigmoid(gate)``).

Each is one Triton kernel on CUDA (``kernels/act_mul.py``); on the CPU the gate is a compiled call
(cpu_kernels/activation.py); elsewhere ``ops/activation.py``'s torch form.
"""

import torch

from truespec.cpu_kernels import activation as cpu_activation
from truespec.layers.backend import kernels, use_kernels
from truespec.ops.activation import KERNEL_ACTIVATIONS, act_mul_ref


def can_use_act_mul_kernel(a: torch.Tensor, b: torch.Tensor, activation: str) -> bool:
    return use_kernels(a) and activation in KERNEL_ACTIVATIONS and a.stride(-1) == 1 and b.stride(-1) == 1


def act_and_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """[T, 2 * I] output of a merged gate/up projection -> act(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    if can_use_act_mul_kernel(gate, up, activation):
        return kernels().act_mul(gate, up, activation)
    return act_mul_ref(gate, up, activation)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate) for x, gate of one shape ([T, H, D]; gate may be a strided view)."""
    if can_use_act_mul_kernel(gate, x, "sigmoid"):
        return kernels().act_mul(gate, x, "sigmoid")
    if cpu_activation.can_run(x, gate):  # the gate stage of the CPU's whole attention layer (cpu_kernels/)
        return cpu_activation.sigmoid_gate(x, gate)
    return act_mul_ref(gate, x, "sigmoid")
