"""What every truespec model is, and how the model runner binds its caches.

A model is ``CausalLM``: ``model(input_ids [T], positions [T]) -> hidden [T, H]`` (after the final norm),
the tokens of several requests packed one after another, per-step metadata read by the layers from
``get_forward_context()``; ``model.compute_logits(hidden [N, H]) -> [N, vocab]`` in the model dtype.

Cache binding (the runner allocates; the layers define shapes and dtypes):
  * ``model.attention_layers()`` -> the ``PagedAttention`` modules in layer order. Bind
    ``layer.kv_cache`` = tensor of ``layer.kv_cache_shape(num_blocks, block_size)``
    ([2, num_blocks, block_size, num_kv_heads, head_dim]) in the model dtype.
  * ``model.gdn_layers()`` -> the ``GatedDeltaNet`` modules in layer order. ``layer.state_shapes()``
    gives the per-slot (conv, ssm) shapes and ``layer.state_dtypes()`` their dtypes; bind
    ``layer.conv_state`` [num_slots, *conv_shape] and ``layer.ssm_state`` [num_slots, *ssm_shape].
Weights are named exactly as in HF checkpoints (``model.layers.0.self_attn.q_proj.weight``, ...).
"""

import torch
import torch.nn.functional as F
from torch import nn

from truespec.layers.attention import PagedAttention
from truespec.layers.gdn import GatedDeltaNet
from truespec.layers.rotary import RotaryEmbedding


class DecoderModel(nn.Module):
    """The decoder stack: embeddings -> layers (each given the step's RoPE cos/sin) -> final norm.
    Subclasses build ``embed_tokens``, ``layers``, ``norm`` and ``rotary_emb``."""

    embed_tokens: nn.Embedding
    layers: nn.ModuleList
    norm: nn.Module
    rotary_emb: RotaryEmbedding

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden [T, hidden_size] after the final norm
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.norm(h)


class CausalLM(nn.Module):
    """Base: subclasses set ``self.model`` (with ``embed_tokens``) and ``self.lm_head`` (None when tied)."""

    model: nn.Module
    lm_head: nn.Linear | None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [T] int64 -> hidden [T, hidden_size] after the final norm.
        return self.model(input_ids, positions)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.embed_tokens

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden_size] -> logits [N, vocab_size] in the model dtype (tied: the embedding matrix).
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight)

    def attention_layers(self) -> list[PagedAttention]:
        return [m for m in self.modules() if isinstance(m, PagedAttention)]

    def gdn_layers(self) -> list[GatedDeltaNet]:
        return [m for m in self.modules() if isinstance(m, GatedDeltaNet)]

    def init_buffers(self, device: torch.device) -> None:
        """Re-create non-checkpoint buffers (RoPE tables) after materialising from the meta device."""
        for m in self.modules():
            if isinstance(m, RotaryEmbedding):
                m.init_buffers(device)
