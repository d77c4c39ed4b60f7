"""``y = x @ weight.T (+ bias)`` with fp32 sums (fp64 for fp64): the reference of kernels/skinny_matmul.py and
kernels/row_invariant_matmul.py."""

import torch

from truespec.ops.activation import act_mul_ref
from truespec.ops.precision import compute_dtype


def linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, input_act: str | None = None
) -> torch.Tensor:
    """Products and sums in the compute dtype, rounded once to x's dtype; with ``input_act``, x is a merged
    gate/up output [M, 2K] and the input is ``act_mul_ref(gate, up, input_act)`` (in x's dtype, as the kernel's)."""
    if input_act is not None:
        x = act_mul_ref(*x.chunk(2, dim=-1), input_act)
    acc = compute_dtype(x.dtype)
    y = x.to(acc) @ weight.to(acc).T
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype)
