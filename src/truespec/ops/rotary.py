"""Rotary position embedding (neox / rotate-half style, optionally partial) applied to q and k, with the
optional per-head q/k RMSNorm in front of it (Qwen3, Qwen3.5). cos and sin come from
``layers/rotary.py``'s ``RotaryEmbedding``, already in the model dtype, so each product and the sum round to
the model dtype as transformers' ops round them."""

import torch

from truespec.ops.norm import rms_norm_ref


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` dims of every head; x: [num_tokens, num_heads, head_dim]."""
    rotary_dim = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    x_rot = x_rot * cos + _rotate_half(x_rot) * sin
    return torch.cat([x_rot, x_pass], dim=-1)


def qk_norm_rope_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q [T, H, D] and k [T, HK, D] (skipped when the weights are None), then RoPE with
    cos, sin [T, rotary_dim]. Returns (q, k)."""
    if q_weight is not None and k_weight is not None:
        q, k = rms_norm_ref(q, q_weight, eps, unit_offset), rms_norm_ref(k, k_weight, eps, unit_offset)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
