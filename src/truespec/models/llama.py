"""Llama dense decoder (also the body of Qwen3, which adds per-head q/k RMSNorm)."""

from typing import Any

import torch
from torch import nn

from truespec.layers.attention import PagedAttention
from truespec.layers.linear import Linear, MergedLinear, use_checkpoint_names
from truespec.layers.mlp import GatedMLP
from truespec.layers.norm import RMSNorm
from truespec.layers.rotary import apply_qk_norm_rotary, rope_from_config
from truespec.models.base import CausalLM, DecoderModel, embedding


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    """q/k/v/o projections (optional bias), optional per-head q/k RMSNorm (Qwen3), full RoPE, GQA.
    q/k/v run as one GEMM (``qkv_proj``; the state dict keeps ``q_proj`` / ``k_proj`` / ``v_proj``)."""

    def __init__(self, config: Any, qk_norm: bool) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        bias = bool(getattr(config, "attention_bias", False))
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        sizes = {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size}
        self.qkv_proj = MergedLinear(config.hidden_size, sizes, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = qk_norm
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)
        use_checkpoint_names(self)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]; cos/sin: [T, rotary_dim]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))  # strided views of one [T, (H + 2 Hkv) D] output
        q = q.unflatten(-1, (self.num_heads, self.head_dim))  # [T, H, D]
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))  # [T, Hkv, D]
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        norms = (self.q_norm, self.k_norm) if self.qk_norm else (None, None)
        q, k = apply_qk_norm_rotary(q, k, cos, sin, *norms)
        return self.o_proj(self.attn(q, k, v).flatten(-2))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, qk_norm: bool) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, qk_norm)
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual-stream protocol of ``base.run_decoder_layers``: returns (MLP output, residual)."""
        x, residual = self.input_layernorm.add_norm(h, residual)
        x, residual = self.post_attention_layernorm.add_norm(self.self_attn(x, cos, sin), residual)
        return self.mlp(x), residual


class LlamaModel(DecoderModel):
    def __init__(self, config: Any, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, qk_norm) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = rope_from_config(config, head_dim_of(config))


class LlamaForCausalLM(CausalLM):
    qk_norm = False

    def __init__(self, config: Any, tie_word_embeddings: bool | None = None) -> None:
        super().__init__()
        self.model = LlamaModel(config, self.qk_norm)
        tied = bool(config.tie_word_embeddings if tie_word_embeddings is None else tie_word_embeddings)
        self.lm_head = None if tied else Linear(config.hidden_size, config.vocab_size, bias=False)
