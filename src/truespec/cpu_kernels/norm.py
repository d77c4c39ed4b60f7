"""RMSNorm (and the residual add in front of it) of float32 / float64 rows in one compiled call: the CPU path of
layers/norm.py where build.py could build norm_core.c (otherwise ops/norm.py's torch ops, ~7 a norm)."""

import ctypes

import torch

from truespec.cpu_kernels import build


def can_run(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Rows [M, D] of a float32 / float64 model on the CPU (unit last stride), no autograd to record, and the
    library built."""
    return x.device.type == "cpu" and x.dim() == 2 and x.dtype in build.SCALARS and weight.dtype == x.dtype \
        and x.stride(-1) == 1 and not build.tracks_grad(x, weight) and build.load() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(norm(s), s) for s = residual + x (or x itself without ``residual``), as ops/norm.py's ``add_rms_norm_ref`` /
    ``rms_norm_ref``. Check ``can_run`` first (and that ``residual`` is like ``x``)."""
    num_rows, dim = x.shape
    if weight.shape != (dim,) or (residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1)):
        raise ValueError(f"rms_norm: x {tuple(x.shape)}, weight {tuple(weight.shape)} and residual do not fit")
    suffix, scalar = build.SCALARS[x.dtype]
    out = torch.empty(num_rows, dim, dtype=x.dtype)
    total = x if residual is None else torch.empty(num_rows, dim, dtype=x.dtype)
    weight = weight.detach().contiguous()
    p, i = build.POINTER, build.INT
    argtypes = [p, i, p, i, p, i, i, scalar, ctypes.c_int, p, i, p, i]
    build.function(f"rms_norm_{suffix}", argtypes)(
        x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0), weight.data_ptr(), num_rows, dim, eps, int(unit_offset),
        out.data_ptr(), out.stride(0), None if residual is None else total.data_ptr(), dim,
    )  # fmt: skip
    return out, total

