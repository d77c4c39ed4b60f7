"""Triton kernels of the GPU fast path, each beside the torch reference it must match (``*_ref``).

Importing this package needs triton. Set ``TRITON_INTERPRET=1`` *before* the first import to run the
kernels on CPU tensors (``@triton.jit`` picks compiled vs interpreted when the module is imported).
"""

from truespec.kernels.act_mul import act_mul, act_mul_ref
from truespec.kernels.add_rms_norm import add_rms_norm, add_rms_norm_ref
from truespec.kernels.causal_conv1d import causal_conv1d, causal_conv1d_ref
from truespec.kernels.gdn_gating import GateInputs, gdn_gating, gdn_gating_ref
from truespec.kernels.gdn_recurrent import gdn_recurrent, gdn_recurrent_ref
from truespec.kernels.paged_attention import paged_attention, paged_attention_ref
from truespec.kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_ref
from truespec.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref
from truespec.kernels.rms_norm import rms_norm, rms_norm_ref
from truespec.kernels.skinny_matmul import skinny_matmul, skinny_matmul_ref

__all__ = [
    "causal_conv1d",
    "causal_conv1d_ref",
    "gdn_recurrent",
    "gdn_recurrent_ref",
    "paged_attention",
    "paged_attention_ref",
    "reshape_and_cache",
    "reshape_and_cache_ref",
    "rms_norm",
    "rms_norm_ref",
    "act_mul",
    "act_mul_ref",
    "add_rms_norm",
    "add_rms_norm_ref",
    "GateInputs",
    "gdn_gating",
    "gdn_gating_ref",
    "qk_norm_rope",
    "qk_norm_rope_ref",
    "skinny_matmul",
    "skinny_matmul_ref",
]
