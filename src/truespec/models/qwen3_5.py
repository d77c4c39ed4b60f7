"""Qwen3.5 text model (``qwen3_5_text``; also the language model of multimodal ``qwen3_5``).

Hybrid: ``layer_types`` mixes Gated DeltaNet layers (``linear_attention``) and gated full attention
(``full_attention``); dense SwiGLU MLP; every RMSNorm except the GDN output norm scales by (1 + w).
"""

from typing import Any

import torch
from torch import nn

from truespec.layers.activation import sigmoid_gate
from truespec.layers.attention import PagedAttention
from truespec.layers.gdn import GatedDeltaNet
from truespec.layers.linear import Linear, MergedLinear, use_checkpoint_names
from truespec.layers.mlp import GatedMLP
from truespec.layers.norm import RMSNorm
from truespec.layers.rotary import apply_qk_norm_rotary, rope_from_config
from truespec.models import qwen3_5_cpu
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
        self.cpu_calls = qwen3_5_cpu.KeptCalls()  # the layer's compiled CPU calls (models/qwen3_5_cpu.py)

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual-stream protocol of ``base.run_decoder_layers``: returns (MLP output, residual)."""
        is_linear, is_cpu = self.layer_type == "linear_attention", h.device.type == "cpu"
        if is_linear and is_cpu and (whole := qwen3_5_cpu.gdn_layer(self, h, residual)) is not None:
            return whole
        if not is_linear and is_cpu and (whole := qwen3_5_cpu.attention_layer(self, h, residual, cos, sin)) is not None:
            return whole
        x, residual = self.input_layernorm.add_norm(h, residual)
        h = self.linear_attn(x) if is_linear else self.self_attn(x, cos, sin)
        if is_cpu and (rest := qwen3_5_cpu.mlp_block(self, h, residual)) is not None:
            return rest
        x, residual = self.post_attention_layernorm.add_norm(h, residual)
        return self.mlp(x), residual


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
        self.cpu_stack = qwen3_5_cpu.KeptStack()  # every layer of a CPU step in one call (models/qwen3_5_cpu.py)

    def run_layers(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if h.device.type == "cpu" and (hidden := qwen3_5_cpu.decoder_stack(self, h, cos, sin)) is not None:
            return hidden
        return super().run_layers(h, cos, sin)


class Qwen3_5ForCausalLM(CausalLM):
    def __init__(self, config: Any, tie_word_embeddings: bool | None = None) -> None:
        super().__init__()
        self.model = Qwen3_5TextModel(config)
        # Multimodal checkpoints decide tying in the outer config (as transformers does): the loader passes it.
        tied = config.tie_word_embeddings if tie_word_embeddings is None else tie_word_embeddings
        self.lm_head = None if tied else Linear(config.hidden_size, config.vocab_size, bias=False)
