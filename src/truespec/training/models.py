"""Model configs (target: hybrid Qwen3.5 text; draft: dense Qwen3) and the MTP head as Qwen3.5 stores it."""

import copy
from dataclasses import dataclass

import torch
from torch import nn
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

from .tokenizer import ENDOFTEXT, IM_END, PAD, SPECIAL_TOKENS


@dataclass(frozen=True)
class ModelSizes:
    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_head_dim: int = 0


# hidden, layers, MLP, q heads, kv heads, head_dim; GDN: key heads, value heads, head dim
# The shipped pair (MODEL.md "Sizes, and why"): 12 target layers = 3 attention layers, which copy (edit tasks)
# far better than 2 at the same byte budget; the narrower MLPs pay for them.
TARGET_SIZES = ModelSizes(256, 12, 256, 4, 2, 64, 2, 4, 64)
DRAFT_SIZES = ModelSizes(128, 5, 320, 4, 2, 32)
SMOKE_TARGET_SIZES = ModelSizes(32, 4, 64, 2, 1, 16, 1, 2, 16)
SMOKE_DRAFT_SIZES = ModelSizes(32, 1, 64, 2, 1, 16)
MAX_POSITIONS = 32768
ROPE_THETA = 1_000_000.0


def _token_ids() -> dict[str, int | list[int]]:
    ids = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    return {"eos_token_id": [ids[ENDOFTEXT], ids[IM_END]], "pad_token_id": ids[PAD], "bos_token_id": None}


def target_config(vocab_size: int, sizes: ModelSizes) -> Qwen3_5TextConfig:
    """Hybrid: [GDN, GDN, GDN, full attention] x (num_layers / 4), tied embeddings, one MTP layer."""
    return Qwen3_5TextConfig(
        vocab_size=vocab_size,
        hidden_size=sizes.hidden_size,
        intermediate_size=sizes.intermediate_size,
        num_hidden_layers=sizes.num_layers,
        num_attention_heads=sizes.num_heads,
        num_key_value_heads=sizes.num_kv_heads,
        head_dim=sizes.head_dim,
        linear_num_key_heads=sizes.linear_num_key_heads,
        linear_num_value_heads=sizes.linear_num_value_heads,
        linear_key_head_dim=sizes.linear_head_dim,
        linear_value_head_dim=sizes.linear_head_dim,
        linear_conv_kernel_dim=4,
        max_position_embeddings=MAX_POSITIONS,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA, "partial_rotary_factor": 0.25},
        tie_word_embeddings=True,
        mtp_num_hidden_layers=1,
        dtype="bfloat16",
        **_token_ids(),
    )


def draft_config(vocab_size: int, sizes: ModelSizes) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=sizes.hidden_size,
        intermediate_size=sizes.intermediate_size,
        num_hidden_layers=sizes.num_layers,
        num_attention_heads=sizes.num_heads,
        num_key_value_heads=sizes.num_kv_heads,
        head_dim=sizes.head_dim,
        max_position_embeddings=MAX_POSITIONS,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        tie_word_embeddings=True,
        dtype="bfloat16",
        **_token_ids(),
    )


class MTPHead(nn.Module):
    """Qwen3.5's multi-token-prediction layer; state_dict keys match a checkpoint's `mtp.*` minus the prefix.

    For position t with the target's final-normed hidden h_t and the next token x_{t+1}:
    x = fc(cat[pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t)]), one full-attention decoder
    layer (causal over the MTP sequence, RoPE position t), norm, then the shared lm_head predicts x_{t+2}.
    """

    def __init__(self, config: Qwen3_5TextConfig) -> None:
        super().__init__()
        h = config.hidden_size
        layer_config = copy.copy(config)
        layer_config.layer_types = ["full_attention"]
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(h, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(h, eps=config.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(layer_config, layer_idx=0)])
        self.norm = Qwen3_5RMSNorm(h, eps=config.rms_norm_eps)

    def forward(
        self,
        next_embeds: torch.Tensor,  # [batch, seq, hidden]: embed(x_{t+1})
        hidden: torch.Tensor,  # [batch, seq, hidden]: target's final-normed h_t
        position_embeddings: tuple[torch.Tensor, torch.Tensor],  # RoPE cos/sin for positions t
    ) -> torch.Tensor:  # [batch, seq, hidden]: feed to the shared lm_head
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        for layer in self.layers:
            x = layer(x, position_embeddings=position_embeddings, attention_mask=None)
        return self.norm(x)


def build_target(config: Qwen3_5TextConfig) -> tuple[Qwen3_5ForCausalLM, MTPHead]:
    model = Qwen3_5ForCausalLM(config)
    mtp = MTPHead(model.config)  # model.config carries the chosen attention implementation
    mtp.apply(model._init_weights)
    return model, mtp


def build_draft(config: Qwen3Config) -> Qwen3ForCausalLM:
    return Qwen3ForCausalLM(config)


def add_dropout(module: nn.Module, p: float) -> None:
    """Dropout on every token mixer's and MLP's output (training only; the checkpoint is unchanged).

    The corpus is small (~3M tokens), so without it the model memorises the training files within a few
    epochs. transformers' Qwen3.5/Qwen3 have no hidden dropout, hence forward hooks.
    """

    def hook(sub: nn.Module, args: tuple, out: torch.Tensor | tuple) -> torch.Tensor | tuple:
        if isinstance(out, tuple):
            return (nn.functional.dropout(out[0], p, sub.training), *out[1:])
        return nn.functional.dropout(out, p, sub.training)

    for name, sub in module.named_modules():
        if name.endswith(("self_attn", "linear_attn", "mlp")):
            sub.register_forward_hook(hook)


def num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
