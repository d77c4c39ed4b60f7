"""Per-request updates of a queued speculative step, on the device (references for kernels/spec_step.py).

- ``move_positions_ref``: a step planned before the previous step's accepted counts were read moves request r's
  query ``shift[r]`` positions further: positions, context length and state source (when it has one) move by the
  shift, and each token's KV slot is looked up again in the block table (-1 past the request's blocks).
- ``greedy_accepted_ref``: a greedy verify accepts draft j while it equals the target's argmax of the row before
  it: the accepted count is the length of that leading run, and the next token is the argmax of the row after
  the last accepted draft (the rules of ``layers/rejection_sampler.greedy_verify``).
- ``chain_metadata_ref``: everything the forwards of a head's drafting chain read (spec_decode/draft_chain.py),
  from the verify's argmax, input ids, positions, query starts and block tables.
"""

from dataclasses import dataclass

import torch


def move_positions_ref(positions: torch.Tensor, seq_lens: torch.Tensor, state_src: torch.Tensor,
                       slot_mapping: torch.Tensor, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                       shift: torch.Tensor, num_tokens: int, block_size: int) -> None:
    """In place. positions / slot_mapping [>= T]; seq_lens / state_src [>= R]; block_tables [>= R, width];
    query_start_loc [R + 1]; shift [R]."""
    num_reqs = len(shift)
    request = torch.repeat_interleave(torch.arange(num_reqs, device=shift.device), query_start_loc.diff(),
                                      output_size=num_tokens)  # [T]: each query token's request
    moved = positions[:num_tokens]
    moved += shift[request]
    seq_lens[:num_reqs] += shift
    src = state_src[:num_reqs]
    src += torch.where(src >= 0, shift, 0)
    slot_mapping[:num_tokens] = kv_slots_on_device(block_tables[:num_reqs], request, moved, block_size)


def kv_slots_on_device(tables: torch.Tensor, request: torch.Tensor, positions: torch.Tensor, block_size: int,
                       is_real: torch.Tensor | None = None) -> torch.Tensor:
    """The flat KV slot of each token [T] at ``positions`` [T] of request ``request`` [T], looked up in the block
    ``tables`` [R, width]: -1 past a request's blocks (a column beyond the table or a -1 cell) and where
    ``is_real`` [T] is False."""
    column = positions // block_size
    block = tables[request, column.clamp(max=tables.shape[1] - 1)]
    is_held = (column < tables.shape[1]) & (block >= 0)
    if is_real is not None:
        is_held &= is_real
    return torch.where(is_held, block * block_size + positions % block_size, -1)


def greedy_accepted_ref(argmax: torch.Tensor, input_ids: torch.Tensor, query_start_loc: torch.Tensor,
                        max_drafts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per request r (query rows qsl[r] .. qsl[r + 1] - 1, drafts after the first): accepted drafts [R] and next
    token [R], from the step's argmax [T] and input ids [T]; ``max_drafts``: the most drafts of any request."""
    starts, lens = query_start_loc[:-1], query_start_loc.diff()
    j = torch.arange(max_drafts, device=argmax.device)
    rows = (starts[:, None] + j).clamp(max=max(len(argmax) - 2, 0))  # [R, k]: the row that checks draft j
    is_draft = j < (lens - 1)[:, None]
    has_drafts = max_drafts and len(argmax) > 1
    match = (argmax[rows] == input_ids[rows + 1]) & is_draft if has_drafts else is_draft
    num_accepted = match.long().cumprod(dim=1).sum(dim=1)
    return num_accepted, argmax[starts + num_accepted]


@dataclass
class ChainMetadata:
    """What the forwards of a hidden-state head's drafting chain read (spec_decode/draft_chain.py), as static
    buffers for up to ``top`` requests of ``q = 1 + k`` query rows; ``chain_metadata_ref`` fills their first
    ``size`` (request) or ``size * q`` (token) entries."""

    step_qsl: torch.Tensor  # [top + 1] the verify's query starts, requests past the real ones at the step's end
    chain_qsl: torch.Tensor  # [top + 1] a draft step's: one token per real request
    accepted: torch.Tensor  # [top] drafts the verify accepted
    next_token: torch.Tensor  # [top] the argmax of the row after the last accepted draft
    hidden_rows: torch.Tensor  # [top] that row: the catch-up row the first draft is predicted from
    seq_lens: torch.Tensor  # [top] the catch-up's context lengths (0: padding)
    slots: torch.Tensor  # [top * q] the catch-up's KV slots (-1: padding)
    draft_positions: torch.Tensor  # [max(k - 1, 1), top]: draft step j's (row j - 1) position per request
    draft_seq_lens: torch.Tensor  # [max(k - 1, 1), top]
    draft_slots: torch.Tensor  # [max(k - 1, 1), top]

    @classmethod
    def empty(cls, top: int, k: int, device: torch.device) -> "ChainMetadata":
        def new(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int64, device=device)
        steps = max(k - 1, 1)
        return cls(new(top + 1), new(top + 1), new(top), new(top), new(top), new(top), new(top * (1 + k)),
                   new(steps, top), new(steps, top), new(steps, top))


def chain_metadata_ref(argmax: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                       query_start_loc: torch.Tensor, tables: torch.Tensor, num_reqs: torch.Tensor, size: int,
                       k: int, block_size: int, out: ChainMetadata) -> None:
    """The chain's metadata for a step of ``num_reqs`` (a 0-d device tensor) <= ``size`` requests, each verifying
    at most k drafts in rows ``query_start_loc[r] ..`` (argmax, input ids, positions [>= size * (1 + k)], the
    verify's; tables [>= size, width]), written into ``out``:

    - the verify's acceptance (``greedy_accepted_ref``) and the catch-up over its rows: token t belongs to the
      request whose rows hold it, rows past the step's end are padding (slot -1); a request's context ends after
      its last verified row;
    - draft step j = 1 .. k - 1: one row per request at ``start + accepted + j`` (``start``: its verify's first
      position), context through that position; requests past ``num_reqs`` are padding (context 0, slot -1).
    """
    device, num_tokens = argmax.device, size * (1 + k)
    edge = torch.arange(size + 1, device=device)
    end = query_start_loc.gather(0, num_reqs.view(1))  # [1]: the step's token count
    step_qsl = torch.where(edge <= num_reqs, query_start_loc[:size + 1], end)
    first, num_drafts = step_qsl[:-1], (step_qsl.diff() - 1).clamp(min=0)
    accepted, next_token = greedy_accepted_ref(argmax, input_ids, step_qsl, k)
    start = positions[first]
    req = torch.arange(size, device=device)
    is_real = req < num_reqs
    token = torch.arange(num_tokens, device=device)
    owner = torch.searchsorted(step_qsl[1:], token, right=True).clamp(max=size - 1)
    out.step_qsl[:size + 1] = step_qsl
    out.chain_qsl[:size + 1] = torch.minimum(edge, num_reqs)
    out.accepted[:size] = accepted
    out.next_token[:size] = next_token
    out.hidden_rows[:size] = first + accepted
    out.seq_lens[:size] = torch.where(is_real, start + num_drafts + 1, 0)
    out.slots[:num_tokens] = kv_slots_on_device(tables[:size], owner, positions[:num_tokens], block_size,
                                                token < end)
    for j in range(1, k):
        at = start + accepted + j
        out.draft_positions[j - 1, :size] = at
        out.draft_seq_lens[j - 1, :size] = torch.where(is_real, at + 1, 0)
        out.draft_slots[j - 1, :size] = kv_slots_on_device(tables[:size], req, at, block_size, is_real)
