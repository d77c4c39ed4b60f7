"""``x @ weight.T + bias`` for float32 / float64 rows in one compiled call over a packed copy of the weight: the CPU
path of layers/linear.py where build.py could build linear_core.c (otherwise torch's BLAS on rows padded to a
multiple of 4, ops/linear.padded_rows).

torch's BLAS at these sizes (a few rows, weights of a few hundred KB) reads the weights at ~5 GB/s on one core, and
rounds a row by the kernel it picks for the row count; linear_core.c streams a packed weight at memory speed and
sums each output in k order whatever the rows beside it (measured in BENCHMARKS.md, session 21). The packed copy
([panels][K][4 x vector], ``pack_*``) is made on first use and again whenever the weight changes in place (its
version counter); weights of more than ``MAX_PACKED_ELEMENTS`` keep the BLAS path, so a large model on the CPU does
not hold a second copy of its big matrices (a weight takes one path for the whole run: its rows stay invariant).

A weight whose every value is a bfloat16 value (a bf16 checkpoint run in float32 or float64, the usual case) is packed
as bfloat16: the kernel widens each one exactly, so every output keeps its bits and a step reads half (float64: a
quarter) of the bytes; on one core a decode step is bound by how fast it streams the weights from cache.
"""

from collections.abc import Callable
from typing import NamedTuple

import torch

from truespec.cpu_kernels import build

MAX_PACKED_ELEMENTS = 1 << 24  # 64 MiB of fp32: every weight of the embedded models, a 0.8B model's but its lm_head
STORED_SAME, STORED_BF16 = 0, 1  # linear_core.c's storage kinds
NARROW = True  # pack bfloat16-valued weights as bfloat16 (False: always the rows' type; the same bits either way)


def can_run(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Rows [M, K] of a float32 / float64 model on the CPU (unit last stride) times a weight [N, K] of at most
    MAX_PACKED_ELEMENTS that tracks in-place changes (not an inference tensor: the packed copy follows its version
    counter), no autograd to record, and the library built."""
    return x.device.type == "cpu" and x.dim() == 2 and weight.dim() == 2 and x.dtype in build.SCALARS \
        and weight.dtype == x.dtype and x.stride(-1) == 1 and weight.numel() <= MAX_PACKED_ELEMENTS \
        and not weight.is_inference() and not build.tracks_grad(x, weight) and build.load() is not None


class _Packed(NamedTuple):
    key: tuple[int, int, bool]  # the weight's (data_ptr, version) when packed, and NARROW
    packed: torch.Tensor  # bytes: linear_core.c's header, then the panels
    stored: int  # STORED_SAME / STORED_BF16
    address: int  # packed.data_ptr()
    num_out: int
    num_in: int
    run: Callable  # the kernel for the weight's dtype, its argument types set


def _packed(weight: torch.Tensor) -> _Packed:
    """The weight's packed copy, kept on the weight (rebuilt after an in-place change: its version moves)."""
    key = (weight.data_ptr(), weight._version, NARROW)
    cached = getattr(weight, "_truespec_packed", None)
    if cached is not None and cached.key == key:
        return cached
    suffix, _ = build.SCALARS[weight.dtype]
    num_out, num_in = weight.shape
    source = weight.detach().contiguous()
    stored = STORED_BF16 if NARROW and is_bf16_valued(source) else STORED_SAME
    p, i = build.POINTER, build.INT
    num_bytes = build.function(f"packed_bytes_{suffix}", [i, i, i], i)(num_out, num_in, stored)
    packed = torch.empty(num_bytes, dtype=torch.uint8)
    build.function(f"pack_{suffix}", [p, i, i, i, p])(source.data_ptr(), num_out, num_in, stored, packed.data_ptr())
    run = build.function(f"linear_{suffix}", [p, i, p, p, i, i, i, p, i])
    weight._truespec_packed = _Packed(key, packed, stored, packed.data_ptr(), num_out, num_in, run)
    return weight._truespec_packed


def is_bf16_valued(weight: torch.Tensor) -> bool:
    """Whether every value of ``weight`` is a bfloat16 value (so its bfloat16 copy widens back to it exactly)."""
    return torch.equal(weight.to(torch.bfloat16).to(weight.dtype), weight)


def packed_copy(weight: torch.Tensor) -> torch.Tensor:
    """The weight's packed copy (the layer calls, gdn_layer.py / attention_layer.py / mlp_block.py, bind its address
    and hold it: the copy on the weight is replaced when the weight changes in place)."""
    return _packed(weight).packed


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """[M, N] in x's dtype. Check ``can_run`` first."""
    w = _packed(weight)
    num_rows, num_in = x.shape
    if num_in != w.num_in or (bias is not None and (bias.shape != (w.num_out,) or bias.dtype != x.dtype)):
        raise ValueError(f"linear: x {tuple(x.shape)}, weight {tuple(weight.shape)} and bias do not fit")
    out = torch.empty(num_rows, w.num_out, dtype=x.dtype)
    bias = None if bias is None else bias.contiguous()  # held until the call returns
    w.run(x.data_ptr(), x.stride(0), w.address, None if bias is None else bias.data_ptr(), num_rows, w.num_out,
          num_in, out.data_ptr(), w.num_out)  # fmt: skip
    return out
