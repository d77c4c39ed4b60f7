"""Tensors the CPU path derives from a parameter (RMSNorm's ``1 + w``, GDN's ``-exp(A_log)``, a conv weight laid out
tap-major), computed once instead of in every step: each is an op of a few microseconds that a step would otherwise
repeat in every layer. Recomputed when the parameter changes (another tensor, or written in place: the loader
fills parameters with ``copy_``, which bumps their version counter). The values are the same ops on the same
inputs as before, so every bit is. (A write through ``.data`` bypasses the counter and is not seen.)"""

from collections.abc import Callable

import torch
from torch import nn


def derived(module: nn.Module, name: str, source: torch.Tensor,
            compute: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:  # fmt: skip
    """``compute(source)``, kept on ``module`` under ``name`` until ``source`` changes (computed afresh where autograd
    records it, so a gradient still reaches the parameter, and for an inference tensor, which keeps no version)."""
    if source.is_inference() or (torch.is_grad_enabled() and source.requires_grad):
        return compute(source)
    key = (source.data_ptr(), source._version, source.dtype)
    cache: dict[str, tuple[tuple, torch.Tensor]] = module.__dict__.setdefault("_derived_weights", {})
    hit = cache.get(name)
    if hit is not None and hit[0] == key:
        return hit[1]
    with torch.inference_mode(False), torch.no_grad():  # a plain tensor: usable outside inference mode too
        value = compute(source.detach())
    cache[name] = (key, value)
    return value
