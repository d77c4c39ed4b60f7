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
    import truespec.kernels

    return truespec.kernels
