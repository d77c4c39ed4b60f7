"""EAGLE-style draft head: target hidden state + token embedding -> one decoder layer -> target lm_head.

For position t with the target's final-normed hidden h_t and the next token x_{t+1}:
x = fc(cat[embed(x_{t+1}), h_t]) (embedding shared with the target), one Qwen3-style decoder layer with
its own KV cache (RoPE position t), ``norm``, the target's lm_head -> x_{t+2}; for k > 1 the head runs
again on its own output. A head is a directory: ``config.json`` (``model_type: truespec_eagle`` and the
decoder layer's Qwen3 config under ``layer_config``) and ``model.safetensors`` (``fc.*``, ``layers.0.*``,
``norm.*``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from truespec.layers.linear import Linear
from truespec.layers.norm import RMSNorm
from truespec.layers.rotary import rope_from_config
from truespec.models.base import CausalLM
from truespec.models.draft_head import HiddenStateDraftHead
from truespec.models.llama import LlamaDecoderLayer, head_dim_of
from truespec.models.mtp import load_state

if TYPE_CHECKING:
    from transformers import Qwen3Config

MODEL_TYPE = "truespec_eagle"


class EagleHead(HiddenStateDraftHead):
    def __init__(self, config: Any, target: CausalLM | None) -> None:
        super().__init__(target)
        h = config.hidden_size
        self.config = config
        self.fc = Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, qk_norm=True)])
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.rotary_emb = rope_from_config(config, head_dim_of(config))

    def fuse(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([embeds, hidden], dim=-1))


def save_eagle_head(
    directory: str | Path,
    layer_config: Qwen3Config,
    state_dict: dict[str, torch.Tensor],
    dtype: torch.dtype = torch.bfloat16,
) -> None:
    """Write a head directory from the decoder layer's config and weights named as ``EagleHead``'s."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = {"model_type": MODEL_TYPE, "architectures": ["EagleHead"], "layer_config": layer_config.to_dict()}
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str))
    save_file(
        {k: v.detach().to(dtype).contiguous().cpu() for k, v in state_dict.items()}, str(out / "model.safetensors")
    )


def read_eagle_config(directory: str | Path, hidden_size: int) -> Qwen3Config:
    """The head's layer config, checked against the target's ``hidden_size`` (no weight loaded)."""
    root = Path(directory)
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"EAGLE head directory has no config.json: {root}")
    try:
        raw = json.loads((root / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot parse {root / 'config.json'}: {e}") from e
    if not isinstance(raw, dict) or raw.get("model_type") != MODEL_TYPE or "layer_config" not in raw:
        raise ValueError(f"{root / 'config.json'} is not an EAGLE head (model_type must be {MODEL_TYPE!r})")
    from transformers import Qwen3Config  # imported when a head is read, not with truespec

    config = Qwen3Config(**raw["layer_config"])
    if config.hidden_size != hidden_size:
        raise ValueError(f"EAGLE head hidden_size {config.hidden_size} != the target's {hidden_size}")
    if not (root / "model.safetensors").is_file():
        raise FileNotFoundError(f"EAGLE head directory has no model.safetensors: {root}")
    return config


def load_eagle_head(directory: str | Path, target: CausalLM, hidden_size: int) -> EagleHead:
    root = Path(directory)
    config = read_eagle_config(root, hidden_size)
    try:
        weights = load_file(str(root / "model.safetensors"))
    except (SafetensorError, OSError, FileNotFoundError) as e:
        raise ValueError(f"cannot read {root / 'model.safetensors'}: {e}") from e
    device = target.embed_tokens.weight.device
    with torch.device("meta"):
        head = EagleHead(config, target)
    head = head.to(target.dtype).to_empty(device=device)
    load_state(head, {k: v.to(device=device, dtype=target.dtype) for k, v in weights.items()}, "")
    head.rotary_emb.init_buffers(device)
    return head.eval().requires_grad_(False)
