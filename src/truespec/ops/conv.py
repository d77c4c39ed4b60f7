"""Depthwise causal conv1d (no bias) + activation over each request's tokens, continuing its conv window: the
GDN layer's short convolution, in torch.

The window is the last K-1 conv *inputs* (model dtype), kept per slot by the protocol of state_slots.py: the
window after query token t is the K-1 inputs ending at t.
"""

import torch
import torch.nn.functional as F

from truespec.ops.activation import get_activation
from truespec.ops.state_slots import StateSlots, gather_states


def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_src: torch.Tensor,
    state_dst: torch.Tensor,
    state_write_start: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Conv + activation of x [T, C] with weight [C, K] (or nn.Conv1d's [C, 1, K]); updates ``conv_state``
    [num_slots, C, K-1] in place. Returns [T, C] in x's dtype (rows no request owns: zeros)."""
    slots = StateSlots.from_tensors(query_start_loc, state_src, state_dst, state_write_start)
    channels = x.shape[1]
    weight = weight.reshape(channels, 1, -1)
    act = get_activation(activation) if activation else (lambda y: y)
    out = torch.zeros_like(x)
    windows = gather_states(conv_state, slots.state_src)  # every source read before any slot is written
    for r in range(slots.num_reqs):
        rows = slots.rows(r)
        if rows.stop == rows.start:
            continue
        inputs = torch.cat([windows[r], x[rows].transpose(0, 1)], dim=-1)  # [C, K-1+L]
        out[rows] = act(F.conv1d(inputs[None], weight, groups=channels)[0]).transpose(0, 1)
        for t in range(rows.stop - rows.start):
            if (slot := slots.kept_slot(r, t)) is not None:
                conv_state[slot] = inputs[:, t + 1 : t + weight.shape[-1]]  # the K-1 inputs ending at t
    return out
