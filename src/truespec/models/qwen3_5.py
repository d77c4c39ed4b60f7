"""Qwen3.5 text model (``qwen3_5_text``; also the language model of multimodal ``qwen3_5``).

Hybrid: ``layer_types`` mixes Gated DeltaNet layers (``linear_attention``) and gated full attention
(``full_attention``); dense SwiGLU MLP; every RMSNorm except the GDN output norm scales by (1 + w).
"""

from typing import Any

import torch
from torch import nn

from truespec.cpu_kernels import build
from truespec.cpu_kernels import gdn_layer as cpu_gdn_layer
from truespec.forward_context import get_forward_context
from truespec.layers.activation import sigmoid_gate
from truespec.layers.attention import PagedAttention
from truespec.layers.gdn import GatedDeltaNet
from truespec.layers.linear import Linear, MergedLinear, use_checkpoint_names
from truespec.layers.mlp import GatedMLP
from truespec.layers.norm import RMSNorm
from truespec.layers.rotary import apply_qk_norm_rotary, rope_from_config
from truespec.models.base import CausalLM, DecoderModel, embedding

_LAYER_TYPES = ("linear_attention", "full_attention")


class Qwen3_5Attention(nn.Module):
    """Gated attention: q_proj gives [q_h | gate_h] per head; (1+w) q/k norm; partial RoPE; GQA;
    output * sigmoid(gate) -> o_proj. q_proj, k_proj, v_proj run as one GEMM (``qkv_proj``; the state
    dict keeps the three checkpoint names); on CUDA q/k norm + RoPE is one kernel, the gate another."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, bias = config.hidden_size, bool(config.attention_bias)
        kv_size = self.num_kv_heads * self.head_dim
        sizes = {"q_proj": 2 * self.num_heads * self.head_dim, "k_proj": kv_size, "v_proj": kv_size}
        self.qkv_proj = MergedLinear(hidden, sizes, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, unit_offset=True)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, unit_offset=True)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)
        use_checkpoint_names(self)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]; cos/sin: [T, rotary_dim]. q, gate, k, v: strided views of one GEMM output.
        q_gate, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q, gate = q_gate.unflatten(-1, (self.num_heads, 2 * self.head_dim)).chunk(2, dim=-1)  # [T, H, D] each
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        q, k = apply_qk_norm_rotary(q, k, cos, sin, self.q_norm, self.k_norm)
        out = sigmoid_gate(self.attn(q, k, v), gate)  # [T, H, D]
        return self.o_proj(out.flatten(-2))


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(
                config.hidden_size,
                config.linear_num_key_heads,
                config.linear_num_value_heads,
                config.linear_key_head_dim,
                config.linear_value_head_dim,
                config.linear_conv_kernel_dim,
                config.rms_norm_eps,
                config.hidden_act,
            )
        else:
            self.self_attn = Qwen3_5Attention(config)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=True)
        # a GDN layer's compiled CPU call and the key of the tensors it was built from (``_cpu_gdn_layer``)
        self._cpu_sources: list[tuple[dict, str]] | None = None
        self._cpu_call: tuple[tuple, cpu_gdn_layer.GdnLayerCall | None] | None = None

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual-stream protocol of ``base.run_decoder_layers``: returns (MLP output, residual)."""
        if self.layer_type == "linear_attention" and h.device.type == "cpu":
            whole = self._cpu_gdn_layer(h, residual)
            if whole is not None:
                return whole
        x, residual = self.input_layernorm.add_norm(h, residual)
        is_linear = self.layer_type == "linear_attention"
        h = self.linear_attn(x) if is_linear else self.self_attn(x, cos, sin)
        x, residual = self.post_attention_layernorm.add_norm(h, residual)
        return self.mlp(x), residual

    def _cpu_gdn_layer(self, h: torch.Tensor,
                       residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The whole GDN layer in one compiled call (cpu_kernels/gdn_layer.py) where its kernels take every stage (a
        property of the layer's weights and dtype, not of the step); None: the stage-by-stage path. The call is built
        once and kept while the layer's tensors stay the same (``gdn_layer.tensor_key``)."""
        gdn = self.linear_attn
        states = [gdn.conv_state, gdn.ssm_state]
        if not cpu_gdn_layer.ENABLED or states[0] is None or states[1] is None or h.dim() != 2 \
                or (residual is not None and (residual.shape != h.shape or residual.dtype != h.dtype)) \
                or gdn.takes_kernels(h):
            return None
        if self._cpu_sources is None:  # where each weight the kernel reads lives (read per call without __getattr__)
            self._cpu_sources = [(m._parameters, name) for m, name in self._cpu_weight_owners()]
        key = cpu_gdn_layer.tensor_key([params[name] for params, name in self._cpu_sources], states)
        if key is None:
            return None
        if self._cpu_call is None or self._cpu_call[0] != key:
            self._cpu_call = (key, self._build_cpu_call(h, states))
        call = self._cpu_call[1]
        if call is None or h.dtype != call.dtype or build.tracks_grad(h, *call.tensors):
            return None
        ctx = get_forward_context()
        return call(h, residual, (ctx.query_start_loc, ctx.state_src, ctx.state_dst, ctx.state_write_start))

    def _cpu_weight_owners(self) -> list[tuple[nn.Module, str]]:
        """(module, parameter name) of the weights ``GdnLayerCall`` binds, in its key's order."""
        gdn, mlp = self.linear_attn, self.mlp
        vectors = [(self.input_layernorm, "weight"), (self.post_attention_layernorm, "weight"), (gdn.conv1d, "weight"),
                   (gdn, "A_log"), (gdn, "dt_bias"), (gdn.norm, "weight")]  # fmt: skip
        return vectors + [(m, "weight") for m in (gdn.in_proj, gdn.out_proj, mlp.gate_up_proj, mlp.down_proj)]

    def _build_cpu_call(self, h: torch.Tensor, states: list[torch.Tensor]) -> "cpu_gdn_layer.GdnLayerCall | None":
        gdn, mlp = self.linear_attn, self.mlp
        projections = (gdn.in_proj, gdn.out_proj, mlp.gate_up_proj, mlp.down_proj)
        if gdn.hidden_act != "silu" or mlp.hidden_act != "silu" or any(m.bias is not None for m in projections):
            return None
        norm, post = self.input_layernorm, self.post_attention_layernorm
        w = cpu_gdn_layer.GdnLayerWeights(
            norm.weight, norm.eps, norm.unit_offset, post.weight, post.eps, post.unit_offset,
            *(m.weight for m in projections), gdn.conv1d.weight, gdn.A_log, gdn.dt_bias, gdn.norm.weight, gdn.norm.eps,
            (gdn.num_k_heads, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim))  # fmt: skip
        with torch.no_grad():  # whether the weights can take it; autograd is asked per call
            if not cpu_gdn_layer.can_run(h, w, *states):
                return None
        return cpu_gdn_layer.GdnLayerCall(w, *states)


class Qwen3_5TextModel(DecoderModel):
    def __init__(self, config: Any) -> None:
        super().__init__()
        unknown = sorted(set(config.layer_types) - set(_LAYER_TYPES))
        if unknown:
            raise ValueError(f"qwen3_5: unsupported layer_types {unknown}; supported: {list(_LAYER_TYPES)}")
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size)
        layer_types = config.layer_types[: config.num_hidden_layers]
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(config, t) for t in layer_types])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=True)
        self.rotary_emb = rope_from_config(config, config.head_dim)


class Qwen3_5ForCausalLM(CausalLM):
    def __init__(self, config: Any, tie_word_embeddings: bool | None = None) -> None:
        super().__init__()
        self.model = Qwen3_5TextModel(config)
        # Multimodal checkpoints decide tying in the outer config (as transformers does): the loader passes it.
        tied = config.tie_word_embeddings if tie_word_embeddings is None else tie_word_embeddings
        self.lm_head = None if tied else Linear(config.hidden_size, config.vocab_size, bias=False)
