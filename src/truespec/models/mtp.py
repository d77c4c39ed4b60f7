"""Qwen3.5's multi-token-prediction head (checkpoint weights ``mtp.*``, ignored by transformers).

For position t, with the target's final-normed hidden state h_t and the next token x_{t+1}:
e = pre_fc_norm_embedding(embed(x_{t+1})), h = pre_fc_norm_hidden(h_t), x = fc(cat[e, h]); one gated
full-attention decoder layer (its own KV cache, RoPE position t); ``mtp.norm``; the target's lm_head gives
x_{t+2}. For k > 1 drafts the same layer runs again on its own normed output and the drafted token.
"""

from typing import Any

import torch
from torch import nn

from truespec.layers.linear import Linear
from truespec.layers.norm import RMSNorm
from truespec.layers.rotary import rope_from_config
from truespec.models.base import CausalLM
from truespec.models.draft_head import HiddenStateDraftHead
from truespec.models.qwen3_5 import Qwen3_5DecoderLayer


class MTPHead(HiddenStateDraftHead):
    def __init__(self, config: Any, target: CausalLM | None) -> None:
        super().__init__(target)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.pre_fc_norm_embedding = RMSNorm(h, eps, unit_offset=True)
        self.pre_fc_norm_hidden = RMSNorm(h, eps, unit_offset=True)
        self.fc = Linear(2 * h, h, bias=False)
        num_layers = getattr(config, "mtp_num_hidden_layers", 1) or 1
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(config, "full_attention") for _ in range(num_layers)])
        self.norm = RMSNorm(h, eps, unit_offset=True)
        self.rotary_emb = rope_from_config(config, config.head_dim)

    def fuse(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))


def check_mtp_checkpoint(config: Any, tensor_names: list[str]) -> None:
    """A target can draft with MTP: a qwen3_5 model whose checkpoint holds ``mtp.*`` weights."""
    if not any(name.startswith("mtp.") for name in tensor_names):
        raise ValueError("speculative method 'mtp' needs mtp.* weights, and this checkpoint has none")
    if getattr(config, "model_type", "") not in ("qwen3_5_text", "qwen3_5"):
        raise ValueError(f"speculative method 'mtp' supports qwen3_5 models, not {config.model_type!r}")


def load_mtp_head(config: Any, target: CausalLM, mtp_weights: dict[str, torch.Tensor]) -> MTPHead:
    """Build the head and load ``mtp.*`` weights (from ``LoadedModel.mtp_weights``)."""
    check_mtp_checkpoint(config, list(mtp_weights))
    any_weight = next(iter(mtp_weights.values()))
    with torch.device("meta"):
        head = MTPHead(config, target)
    head = head.to(target.dtype).to_empty(device=any_weight.device)
    load_state(head, {k.removeprefix("mtp."): v for k, v in mtp_weights.items()}, "mtp.")
    head.rotary_emb.init_buffers(any_weight.device)
    return head.eval().requires_grad_(False)


@torch.no_grad()
def load_state(module: nn.Module, weights: dict[str, torch.Tensor], prefix: str) -> None:
    """Copy ``weights`` into ``module``'s parameters, naming any missing / unexpected / misshapen tensor."""
    params = module.state_dict()
    missing = sorted(set(params) - set(weights))
    unexpected = sorted(set(weights) - set(params))
    if missing or unexpected:
        raise ValueError(
            f"{prefix}* weights do not match the head: missing {[prefix + m for m in missing]}, "
            f"unexpected {[prefix + u for u in unexpected]}"
        )
    for name, tensor in weights.items():
        if tensor.shape != params[name].shape:
            raise ValueError(f"{prefix}{name} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}")
        params[name].copy_(tensor)
