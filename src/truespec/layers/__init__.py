"""Building blocks of the models: norms, RoPE, paged attention, Gated DeltaNet, MLP.

Each layer runs the Triton kernels on CUDA (``truespec.kernels``) and the torch references of
``truespec.ops`` elsewhere; layers/backend.py decides which.
"""

from truespec.layers.attention import PagedAttention
from truespec.layers.gdn import GatedDeltaNet
from truespec.layers.mlp import GatedMLP
from truespec.layers.norm import GatedRMSNorm, RMSNorm
from truespec.layers.rotary import RotaryEmbedding, rope_from_config

__all__ = [
    "GatedDeltaNet",
    "GatedMLP",
    "GatedRMSNorm",
    "PagedAttention",
    "RMSNorm",
    "RotaryEmbedding",
    "rope_from_config",
]
