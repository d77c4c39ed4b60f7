"""Per-head q / k RMSNorm and RoPE of float32 / float64 rows in one compiled call: the CPU path of
layers/rotary.apply_qk_norm_rotary where build.py could build rotary_core.c (otherwise ops/rotary.py's torch ops,
~25 for a pair of tensors)."""

import ctypes

import torch

from truespec.cpu_kernels import build

MAX_HEAD_DIM = 1024  # rotary_core.c's per-head scratch


def can_run(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, *weights: torch.Tensor | None) -> bool:
    """q [T, H, D], k [T, H_kv, D] of a float32 / float64 model on the CPU (unit last strides), cos / sin of their
    dtype, no autograd to record, and the library built."""
    return q.device.type == "cpu" and q.dim() == 3 and q.dtype in build.SCALARS and k.dtype == cos.dtype == q.dtype \
        and q.stride(-1) == 1 and k.stride(-1) == 1 and q.shape[-1] <= MAX_HEAD_DIM \
        and not build.tracks_grad(q, k, *(w for w in weights if w is not None)) and build.load() is not None


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                 unit_offset: bool) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``qk_norm_rope_ref``'s (q, k), new contiguous tensors. Check ``can_run`` first."""
    num_tokens, num_heads, head_dim = q.shape
    rot = cos.shape[-1]
    fits = k.shape[0] == num_tokens and k.shape[-1] == head_dim and cos.shape == (num_tokens, rot) == sin.shape
    if not fits or rot % 2 or rot > head_dim:
        raise ValueError(f"qk_norm_rope: q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)} do not fit")
    suffix, scalar = build.SCALARS[q.dtype]
    cos, sin = cos.contiguous(), sin.contiguous()
    weights = [None if w is None else w.detach().contiguous() for w in (q_weight, k_weight)]
    addresses = [None if w is None else w.data_ptr() for w in weights]
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype), torch.empty(k.shape, dtype=k.dtype)
    p, i = build.POINTER, build.INT
    argtypes = [p, i, i, i, p, i, i, i, i, i, p, p, i, p, p, scalar, ctypes.c_int, p, p]
    build.function(f"qk_norm_rope_{suffix}", argtypes)(
        q.data_ptr(), q.stride(0), q.stride(1), num_heads, k.data_ptr(), k.stride(0), k.stride(1), k.shape[1],
        num_tokens, head_dim, cos.data_ptr(), sin.data_ptr(), rot, *addresses,
        eps, int(unit_offset), q_out.data_ptr(), k_out.data_ptr(),
    )  # fmt: skip
    return q_out, k_out
