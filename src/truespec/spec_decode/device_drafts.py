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
from truespec.ops.host_copy import to_device_async
from truespec.ops.spec_step import greedy_accepted_ref
from truespec.worker.input_builder import ContextRow

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
                      reads_tokens: bool, after_chunks: list[int] = ()) -> DeviceDrafts:
    """A greedy step's acceptance, the drafter's catch-up and ``num_drafts`` drafts per request, one launch per forward.

    ``step.rows`` / ``positions``: the target step's, as the host built them (``shift``: how far the device moved
    them); its hidden states, ``argmax`` [logits rows] and ``inputs`` (ids, moved positions, metadata): on the device.
    A request's query is ``p`` prompt rows (the rest of its last prompt chunk: a request joining the batch, or a
    re-prefill after preemption; 0 for a decode / verify), then its logits rows: its last prompt row or decode row and
    its drafts. The catch-up covers every query row, each fed the token after it: a prompt row the next prompt token,
    a logits row the target's argmax of it (up to the last accepted draft that is the draft, then the new token);
    rows after it write KV that the drafts or the next catch-up overwrite before anything reads it. A head (MTP,
    EAGLE) pairs row t's hidden state with that token, and its first draft comes from the last accepted row. A draft
    model (``reads_tokens``) reads each row's own token and also covers the position after the query: fed the
    query's input tokens through its first logits row, then each logits row's argmax (up to the new token, what
    ``propose`` feeds), and its first draft comes from the new token's row. Draft j (j >= 1) is fed at the position
    after the first draft's + j.

    A request computing an earlier chunk of its prompt has no logits row: every query row is a prompt row, and its
    last is fed the prompt token after the chunk (``after_chunks``, one per such request in step order), which the
    step's ids do not hold. It accepts nothing, and its drafts, predicted from its last catch-up row, are discarded:
    they write KV up to ``k - 1`` (a head) or ``k`` (a draft model) positions past the chunk, which its blocks hold
    (``ChunkPlanner.tokens_to_hold``) and which the catch-ups of its next chunks overwrite before anything reads
    them, as they do a last chunk's rejected drafts."""
    rows, argmax, inputs, shift = step.rows, step.argmax, step.inputs, step.shift
    num_tokens, num_reqs, device = len(step.positions), len(rows), argmax.device
    query_start_loc = inputs.ctx.query_start_loc[:num_reqs + 1]
    # per request: its first query row (the host's copy of the query starts), its prompt rows (before its logits
    # rows), its first row in ``argmax``; logits_starts[-1]: the step's logits rows
    starts, prompt_rows, logits_starts = step.output.query_start_loc[:num_reqs], [], [0]
    for row in rows:
        prompt_rows.append(row.query_len - row.num_logits)
        logits_starts.append(logits_starts[-1] + row.num_logits)
    has_prompts, num_logits = any(prompt_rows), logits_starts[-1]
    max_drafts = max(row.num_logits for row in rows) - 1
    # an earlier chunk's request (no logits row): the row after its query is not its own; the index of the token
    # after its chunk in ``fed``'s source
    chunks = [i for i, row in enumerate(rows) if not row.num_logits]
    after = {i: num_tokens + num_logits + j for j, i in enumerate(chunks)}
    if has_prompts:  # acceptance over the logits rows only: their input ids gathered
        # (an earlier chunk's empty run of logits rows reads one row past the others': a row of padding)
        logits_rows = [t for s, p, row in zip(starts, prompt_rows, rows, strict=True)
                       for t in range(s + p, s + row.query_len)] + [0] * bool(after)
        logits_argmax = argmax[:num_logits] if not after else torch.cat([argmax[:num_logits], argmax[:1]])
        num_accepted, next_token = greedy_accepted(logits_argmax, inputs.input_ids.index_select(
            0, to_device_async(logits_rows, device)), to_device_async(logits_starts, device), max_drafts)
    else:  # a decode / verify step: argmax row t is query row t
        num_accepted, next_token = greedy_accepted(argmax[:num_tokens], inputs.input_ids[:num_tokens],
                                                   query_start_loc, max_drafts)

    def fed(index: list[int]) -> torch.Tensor:
        """The catch-up's input ids: ``index`` into [the step's input ids | its argmax | the tokens after chunks]."""
        parts = [inputs.input_ids[:num_tokens], argmax[:num_logits]]
        return torch.cat(parts + [to_device_async(list(after_chunks), device)] if after else parts).index_select(
            0, to_device_async(index, device))

    offset = int(reads_tokens)  # the first draft's row past the last accepted one
    if reads_tokens:  # rows: the query's, then the position after it; ids: the query's through its first logits row
        index, first_rows = [], []  # the catch-up row of each request's first logits row (an earlier chunk: its last)
        for i, (s, p, ls, row) in enumerate(zip(starts, prompt_rows, logits_starts, rows, strict=False)):
            first_rows.append(s + i + p - (i in after))
            index += [*range(s, s + p + (i not in after)), *([after[i]] if i in after else []),
                      *range(num_tokens + ls, num_tokens + ls + row.num_logits)]
        catch_up = [ContextRow(row.block_ids, row.start, row.query_len + 1, -1, -1, 0, 0) for row in rows]
        positions = [p for row in rows for p in range(row.start, row.start + row.query_len + 1)]
        out, _ = graphs.run(catch_up, [0] * len(index), positions, decode_only=not has_prompts,
                            input_ids_from=fed(index), shift=shift)
        first_logits = to_device_async(first_rows, device)
    else:  # row t: the next prompt token (a prompt row), else its argmax (every row of a decode / verify step)
        ids = argmax
        if has_prompts:
            ids = fed([t + 1 if t < s + p - (i in after) else after[i] if i in after else num_tokens + ls + t - s - p
                       for i, (s, p, ls, row) in enumerate(zip(starts, prompt_rows, logits_starts, rows, strict=False))
                       for t in range(s, s + row.query_len)])
        out, _ = graphs.run(rows, [0] * num_tokens, step.positions, step.output.hidden_states[:num_tokens],
                            decode_only=not has_prompts, input_ids_from=ids, shift=shift)
        first_logits = query_start_loc[:-1] if not has_prompts else to_device_async(
            [s + p - (i in after) for i, (s, p) in enumerate(zip(starts, prompt_rows, strict=True))], device)
    hidden = out[first_logits + num_accepted + offset]  # [R, H]: the row the first draft is predicted from
    moved = num_accepted if shift is None else shift + num_accepted
    drafts: list[torch.Tensor] = []
    for j in range(num_drafts):
        if j > 0:  # draft j at the first draft's position + j (host: before the move)
            at = [row.start + p + offset + j for row, p in zip(rows, prompt_rows, strict=True)]
            step_rows = [ContextRow(row.block_ids, p, 1, -1, -1, 0, 0) for row, p in zip(rows, at, strict=True)]
            hidden, _ = graphs.run(step_rows, [0] * num_reqs, at, None if reads_tokens else hidden, decode_only=True,
                                   input_ids_from=drafts[-1], shift=moved)
        logits = head.compute_logits(hidden)
        drafts.append((logits if logits.dtype == torch.float64 else logits.float()).argmax(dim=-1))
    return DeviceDrafts(num_accepted, torch.stack([next_token, *drafts], dim=1))
