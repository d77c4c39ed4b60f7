"""Building blocks of the models: norms, RoPE, paged attention, Gated DeltaNet, MLP (torch reference paths)."""

from truespec.layers.attention import PagedAttention
from truespec.layers.gdn import GatedDeltaNet
from truespec.layers.mlp import GatedMLP
from truespec.layers.norm import GatedRMSNorm, RMSNorm
from truespec.layers.precision import compute_dtype
from truespec.layers.rotary import RotaryEmbedding, apply_rotary, rope_from_config

__all__ = [
    "GatedDeltaNet",
    "GatedMLP",
    "GatedRMSNorm",
    "PagedAttention",
    "RMSNorm",
    "RotaryEmbedding",
    "apply_rotary",
    "compute_dtype",
    "rope_from_config",
]
