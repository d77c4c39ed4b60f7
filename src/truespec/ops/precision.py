"""Which dtype the sensitive math runs in (norms, softmax, RoPE angles, GDN state)."""

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 models compute everything in float64; every other dtype computes in float32.

    float32 for half dtypes mirrors transformers. transformers also drops float64 models to
    float32 inside norms/RoPE/GDN; we do not, so a float64 truespec run is exact end to end
    (docs/ARCHITECTURE.md invariant 5) and differs from transformers only by transformers' own float32 error.
    """
    return torch.float64 if dtype == torch.float64 else torch.float32


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, without the call when x already has it (the CPU path's hot loops: a no-op ``to`` still
    costs a dispatch)."""
    return x if x.dtype == dtype else x.to(dtype)
