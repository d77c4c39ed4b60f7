"""Gated MLP (SwiGLU for ``hidden_act="silu"``): down(act(gate(x)) * up(x))."""

import torch
from torch import nn

from truespec.layers.activation import get_activation


class GatedMLP(nn.Module):
    """Separate gate/up projections, named as in HF checkpoints (no weight renaming at load)."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = get_activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden_size]
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
