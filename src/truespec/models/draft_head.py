"""What the MTP and EAGLE heads share: fuse (token embedding, hidden state) -> decoder layer(s) -> norm,
with the target's embedding and lm_head (held by reference, not registered as submodules)."""

import torch
from torch import nn

from truespec.layers.attention import PagedAttention
from truespec.layers.norm import RMSNorm
from truespec.models.base import CausalLM, run_decoder_layers


class HiddenStateDraftHead(nn.Module):
    uses_target_hidden = True  # the drafter feeds it the target's final-normed hidden states
    fc: nn.Linear
    layers: nn.ModuleList
    norm: RMSNorm
    rotary_emb: nn.Module

    def __init__(self, target: CausalLM | None) -> None:
        super().__init__()
        self._target = [target]

    def fuse(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[T, H] embeddings of x_{t+1} and hidden states h_t -> [T, H] input of the decoder layer."""
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [T]; hidden: [T, H] the target's (or this head's previous) normed hidden
        x = self.fuse(self._target[0].embed_tokens(input_ids), hidden)
        cos, sin = self.rotary_emb(positions, x.dtype)
        return run_decoder_layers(self.layers, self.norm, x, cos, sin)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._target[0].compute_logits(hidden)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def attention_layers(self) -> list[PagedAttention]:
        return [m for m in self.modules() if isinstance(m, PagedAttention)]

    def gdn_layers(self) -> list[nn.Module]:
        return []  # one full-attention decoder layer: KV only
