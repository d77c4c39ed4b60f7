"""``y = x @ weight.T (+ bias)`` with fp32 sums (fp64 for fp64): the reference of kernels/skinny_matmul.py and
kernels/row_invariant_matmul.py."""

import torch

from truespec.ops.activation import KERNEL_ACTIVATIONS, act_mul_ref
from truespec.ops.precision import compute_dtype

CPU_ROW_MULTIPLE = 4  # CPU matmuls whose rows must not depend on each other run on a multiple of this many rows


def padded_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] with zero rows below it up to a multiple of CPU_ROW_MULTIPLE (``x`` itself if M is a multiple).
    The CPU BLAS rounds a row of ``x @ W`` by the kernel it picks for the row count: one for a single row, another for
    2-3, and rows in a last partial tile of 4 differently again (measured on an AMD EPYC in fp32 and fp64:
    BENCHMARKS.md); computed among a multiple of 4 rows, every row is a row of a full tile, with the same bits whatever
    else is in the product (tests/test_cpu_batched_ops.py). Slice the product's first M rows."""
    pad = -x.shape[0] % CPU_ROW_MULTIPLE
    return torch.cat([x, x.new_zeros(pad, x.shape[1])]) if pad else x


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


def matmul_operands(name: str, x: torch.Tensor, weight: torch.Tensor,
                    input_act: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The checks and layout every linear kernel needs: ``x`` [M, K] (or [M, 2K] ``[gate | up]`` with
    ``input_act``) and ``weight`` [N, K], both returned with a unit last stride; errors name kernel ``name``."""
    width = None if weight.dim() != 2 else weight.shape[1] * (1 if input_act is None else 2)
    if x.dim() != 2 or x.shape[1] != width:
        raise ValueError(f"{name}: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match"
                         + ("" if input_act is None else f" (x is [gate | up] for input_act={input_act!r})"))
    if input_act is not None and input_act not in KERNEL_ACTIVATIONS:
        raise ValueError(f"{name}: input_act must be one of {KERNEL_ACTIVATIONS}, got {input_act!r}")
    return (x if x.stride(-1) == 1 else x.contiguous()), (weight if weight.stride(-1) == 1 else weight.contiguous())
