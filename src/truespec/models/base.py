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
State dicts name weights exactly as HF checkpoints do (``model.layers.0.self_attn.q_proj.weight``, ...),
although projections that read the same input are one merged parameter (``self_attn.qkv_proj.weight``,
``mlp.gate_up_proj.weight``: one GEMM each); ``state_dict()`` gives each checkpoint tensor as a view of its
rows (layers/linear.py), which is how the loader fills them.

Decoder layers follow the residual-stream protocol of ``run_decoder_layers``: a layer takes the previous
layer's output and the residual stream *before* it was added, and adds it inside its first norm
(``RMSNorm.add_norm``: one kernel on CUDA instead of an add and a norm).
"""

import torch
from torch import nn

from truespec.layers.attention import PagedAttention
from truespec.layers.gdn import GatedDeltaNet
from truespec.layers.linear import linear
from truespec.layers.norm import RMSNorm
from truespec.layers.rotary import RotaryEmbedding


def run_decoder_layers(
    layers: nn.ModuleList, norm: RMSNorm, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """h [T, H] -> norm(h after every layer). Layer i gets (its input's last summand, the residual stream
    before that summand; None for the first layer, whose input is h itself) and returns the same pair
    for layer i + 1; the last pair's sum is added inside the final norm. Same sums, in the same order,
    as ``h = h + block(norm(h))`` per block."""
    residual = None
    for layer in layers:
        h, residual = layer(h, residual, cos, sin)
    return norm.add_norm(h, residual)[0]


def embedding(num_embeddings: int, embedding_dim: int) -> nn.Embedding:
    """``nn.Embedding``, without its random init on the meta device (where the loader builds every model before
    filling it from a checkpoint): ``normal_`` on a meta tensor imports torch._dynamo (~2 s of ``LLM()``)."""
    weight = torch.empty(num_embeddings, embedding_dim)
    if not weight.is_meta:
        nn.init.normal_(weight)  # nn.Embedding's own init, for a model built on a real device
    return nn.Embedding(num_embeddings, embedding_dim, _weight=weight)


class DecoderModel(nn.Module):
    """The decoder stack: embeddings -> layers (each given the step's RoPE cos/sin) -> final norm.
    Subclasses build ``embed_tokens``, ``layers``, ``norm`` and ``rotary_emb``."""

    embed_tokens: nn.Embedding
    layers: nn.ModuleList
    norm: RMSNorm
    rotary_emb: RotaryEmbedding

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden [T, hidden_size] after the final norm
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, h.dtype)
        return self.run_layers(h, cos, sin)

    def run_layers(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """h [T, H] -> the hidden states after every layer and the final norm (``run_decoder_layers``)."""
        return run_decoder_layers(self.layers, self.norm, h, cos, sin)


class CausalLM(nn.Module):
    """Base: subclasses set ``self.model`` (with ``embed_tokens``) and ``self.lm_head`` (None when tied)."""

    model: nn.Module
    lm_head: nn.Linear | None
    batch_invariant = True  # the logits' projection (layers/linear.py set_batch_invariant)

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
        return linear(hidden, weight, batch_invariant=self.batch_invariant)

    def attention_layers(self) -> list[PagedAttention]:
        return [m for m in self.modules() if isinstance(m, PagedAttention)]

    def gdn_layers(self) -> list[GatedDeltaNet]:
        return [m for m in self.modules() if isinstance(m, GatedDeltaNet)]

    def init_buffers(self, device: torch.device) -> None:
        """Re-create non-checkpoint buffers (RoPE tables) after materialising from the meta device."""
        for m in self.modules():
            if isinstance(m, RotaryEmbedding):
                m.init_buffers(device)
