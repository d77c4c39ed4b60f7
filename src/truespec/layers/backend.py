"""Which implementation a layer runs: the Triton kernels on CUDA, the torch reference elsewhere.

``TRUESPEC_BACKEND=torch`` forces the reference path on CUDA too (to compare the two on the same card).
The kernels package is imported only when first needed on CUDA, so CPU runs never import triton.
"""

import functools
import os
from types import ModuleType

import torch


def use_kernels(t: torch.Tensor) -> bool:
    return t.is_cuda and os.environ.get("TRUESPEC_BACKEND", "triton") == "triton"


@functools.cache
def kernels() -> ModuleType:
    """``truespec.kernels``, imported on first use: a CPU run never imports triton, and a test can switch on
    ``TRITON_INTERPRET`` before the kernels are defined."""
    import truespec.kernels

    return truespec.kernels


def cudagraph_unsupported_reason(device: torch.device) -> str | None:
    """Why the layers cannot run inside a captured CUDA graph on ``device`` (None: they can, any batch mix).

    The Triton kernels read every per-request value from device tensors and size their grids from tensor
    shapes only, so a padded step replays exactly. The torch reference layers loop over requests with host
    copies of the metadata (and read it back with ``.tolist()``): never captured.
    """
    if device.type != "cuda":
        return f"device {device} has no CUDA graphs"
    if os.environ.get("TRUESPEC_BACKEND", "triton") != "triton":
        return "TRUESPEC_BACKEND=torch: the reference layers sync with the host on every step"
    return None
