"""Drafts that never leave the device: a greedy verify's accepted counts and a model drafter's next drafts, queued
right behind the target's forward (docs/ARCHITECTURE.md, "Speculative steps queued ahead"), one launch per forward
(``draft_by_launches``; spec_decode/draft_chain.py does the same work in one graph replay).

A step's greedy requests each verify ``d_r`` drafts in query rows ``qsl[r] .. qsl[r] + d_r``: draft j is
accepted while it equals the target's argmax of the row before it, so the accepted count is the length of the
leading run of matches, and the request's next token is the argmax of the row after its last accepted draft.
These are the same rules as ``layers/rejection_sampler.greedy_verify`` (the host's reading of the same values).
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from truespec.layers.backend import kernels, use_kernels
from truespec.ops.spec_step import greedy_accepted_ref
from truespec.worker.input_builder import ContextRow, to_device_async

if TYPE_CHECKING:
    from truespec.worker.graph_runner import GraphRunner
    from truespec.worker.model_runner import LaunchedStep


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


def draft_by_launches(head: torch.nn.Module, graphs: "GraphRunner", step: "LaunchedStep", num_drafts: int,
                      reads_tokens: bool) -> DeviceDrafts:
    """A greedy step's acceptance, the drafter's catch-up and ``num_drafts`` drafts per request, one launch per forward.

    ``step.rows`` / ``positions``: the target step's, as the host built them (``shift``: how far the device moved
    them); its hidden states, ``argmax`` [T] and ``inputs`` (ids, moved positions, metadata): on the device. The
    catch-up covers every query row, each fed the target's argmax of the row before it: up to the last accepted draft
    that is the draft, then the next token; rows after it write KV that the drafts or the next catch-up overwrite
    before anything reads it. A head (MTP, EAGLE) pairs row t's hidden state with the argmax of row t, and its first
    draft comes from the last accepted row. A draft model (``reads_tokens``) also covers the position after the query,
    fed the step's first input token and then each row's argmax (up to the new token, what ``propose`` feeds), and its
    first draft comes from the new token's row. Draft j (j >= 1) is fed at the position after the first draft's + j."""
    rows, argmax, inputs, shift = step.rows, step.argmax, step.inputs, step.shift
    num_tokens, num_reqs = len(step.positions), len(rows)
    query_start_loc = inputs.ctx.query_start_loc[:num_reqs + 1]
    num_accepted, next_token = greedy_accepted(argmax[:num_tokens], inputs.input_ids[:num_tokens], query_start_loc,
                                               max(row.query_len for row in rows) - 1)
    offset = int(reads_tokens)  # the first draft's row past the last accepted one
    if reads_tokens:
        index, starts, first = [], [], 0  # into [input ids | argmax]; each request's first catch-up row
        for row in rows:
            starts.append(first + len(starts))
            index += [first, *range(num_tokens + first, num_tokens + first + row.query_len)]
            first += row.query_len
        ids = torch.cat([inputs.input_ids[:num_tokens], argmax[:num_tokens]]).index_select(
            0, to_device_async(index, argmax.device))
        catch_up = [ContextRow(row.block_ids, row.start, row.query_len + 1, -1, -1, 0, 0) for row in rows]
        positions = [p for row in rows for p in range(row.start, row.start + row.query_len + 1)]
        out, _ = graphs.run(catch_up, [0] * len(index), positions, decode_only=True, input_ids_from=ids, shift=shift)
        first_rows = to_device_async(starts, argmax.device)
    else:
        out, _ = graphs.run(rows, [0] * num_tokens, step.positions, step.output.hidden_states[:num_tokens],
                            decode_only=True, input_ids_from=argmax, shift=shift)
        first_rows = query_start_loc[:-1]
    hidden = out[first_rows + num_accepted + offset]  # [R, H]: the row the first draft is predicted from
    moved = num_accepted if shift is None else shift + num_accepted
    drafts: list[torch.Tensor] = []
    for j in range(num_drafts):
        if j > 0:  # draft j at the first draft's position + j (host: before the move)
            at = [row.start + offset + j for row in rows]
            step_rows = [ContextRow(row.block_ids, p, 1, -1, -1, 0, 0) for row, p in zip(rows, at, strict=True)]
            hidden, _ = graphs.run(step_rows, [0] * num_reqs, at, None if reads_tokens else hidden, decode_only=True,
                                   input_ids_from=drafts[-1], shift=moved)
        logits = head.compute_logits(hidden)
        drafts.append((logits if logits.dtype == torch.float64 else logits.float()).argmax(dim=-1))
    return DeviceDrafts(num_accepted, torch.stack([next_token, *drafts], dim=1))
