"""Triton kernels of the GPU fast path. Each kernel's torch reference (``*_ref``, same signature and result)
lives in ``truespec.ops`` and is re-exported here beside it, for the tests that compare the two.

Importing this package needs triton. Set ``TRITON_INTERPRET=1`` *before* the first import to run the
kernels on CPU tensors (``@triton.jit`` picks compiled vs interpreted when the module is imported).
``gdn_chunked`` is the module of the optional fla chunked prefill (its threshold, availability and entry point).
"""

from truespec.kernels import gdn_chunked
from truespec.kernels.act_mul import act_mul
from truespec.kernels.add_rms_norm import add_rms_norm
from truespec.kernels.causal_conv1d import causal_conv1d
from truespec.kernels.gdn_gating import gating_buffer_size, gdn_gating
from truespec.kernels.gdn_recurrent import gdn_recurrent
from truespec.kernels.kv_store_packed import store_packed
from truespec.kernels.ngram_match import ngram_step
from truespec.kernels.paged_attention import paged_attention
from truespec.kernels.paged_attention_packed import paged_attention_packed
from truespec.kernels.qk_norm_rope import qk_norm_rope
from truespec.kernels.reshape_and_cache import reshape_and_cache
from truespec.kernels.rms_norm import rms_norm
from truespec.kernels.row_invariant_matmul import row_invariant_matmul
from truespec.kernels.skinny_matmul import skinny_matmul
from truespec.kernels.spec_step import chain_metadata, greedy_accepted, move_positions
from truespec.kernels.step_attention import step_attention
from truespec.ops.activation import act_mul_ref
from truespec.ops.attention import paged_attention_ref, reshape_and_cache_ref, store_packed_ref
from truespec.ops.conv import causal_conv1d_ref
from truespec.ops.gdn import GateInputs, gdn_gating_ref, gdn_recurrent_ref
from truespec.ops.linear import linear_ref
from truespec.ops.ngram_match import ngram_match_ref, ngram_step_ref
from truespec.ops.norm import add_rms_norm_ref, rms_norm_ref
from truespec.ops.rotary import qk_norm_rope_ref
from truespec.ops.spec_step import chain_metadata_ref, greedy_accepted_ref, move_positions_ref

__all__ = [
    "causal_conv1d",
    "causal_conv1d_ref",
    "gdn_chunked",
    "gdn_recurrent",
    "gdn_recurrent_ref",
    "paged_attention",
    "paged_attention_packed",
    "paged_attention_ref",
    "reshape_and_cache",
    "reshape_and_cache_ref",
    "store_packed",
    "store_packed_ref",
    "step_attention",
    "rms_norm",
    "rms_norm_ref",
    "act_mul",
    "act_mul_ref",
    "add_rms_norm",
    "add_rms_norm_ref",
    "GateInputs",
    "gating_buffer_size",
    "gdn_gating",
    "gdn_gating_ref",
    "qk_norm_rope",
    "qk_norm_rope_ref",
    "row_invariant_matmul",
    "skinny_matmul",
    "linear_ref",
    "chain_metadata",
    "chain_metadata_ref",
    "greedy_accepted",
    "greedy_accepted_ref",
    "move_positions",
    "move_positions_ref",
    "ngram_match_ref",
    "ngram_step",
    "ngram_step_ref",
]
