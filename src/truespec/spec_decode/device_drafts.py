"""Drafts that never leave the device: a greedy verify's accepted counts and a hidden-state head's next drafts,
queued right behind the target's forward (docs/ARCHITECTURE.md, "Speculative steps queued ahead").

A step's greedy requests each verify ``d_r`` drafts in query rows ``qsl[r] .. qsl[r] + d_r``: draft j is
accepted while it equals the target's argmax of the row before it, so the accepted count is the length of the
leading run of matches, and the request's next token is the argmax of the row after its last accepted draft.
These are the same rules as ``layers/rejection_sampler.greedy_verify`` (the host's reading of the same values).
"""

from dataclasses import dataclass

import torch

from truespec.layers.backend import kernels, use_kernels
from truespec.ops.spec_step import greedy_accepted_ref


@dataclass
class DeviceDrafts:
    """What a step leaves on the device for the next one, per request of the step (in its order)."""

    num_accepted: torch.Tensor  # [R] int64: drafts the step accepted (how far the next step's positions move)
    next_ids: torch.Tensor  # [R, 1 + d] int64: the request's next token, then the d drafts after it (d = k or 0)

    @property
    def num_drafts(self) -> int:
        return self.next_ids.shape[1] - 1


def greedy_accepted(argmax: torch.Tensor, input_ids: torch.Tensor, query_start_loc: torch.Tensor,
                    max_drafts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per request: accepted drafts [R] and next token [R], from the step's argmax [T] and input ids [T] (drafts
    in each request's query after its first token) and ``query_start_loc`` [R + 1] (on the device)."""
    accepted = kernels().greedy_accepted if use_kernels(argmax) else greedy_accepted_ref
    return accepted(argmax, input_ids, query_start_loc, max_drafts)
