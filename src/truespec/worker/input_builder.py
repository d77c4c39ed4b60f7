"""Builds a step's inputs and ForwardContext from per-request rows (shared by the target runner and the drafters).

All int64 step data (token ids, positions and every metadata tensor) is packed into one host buffer and reaches
the device in one copy. With ``pad_to`` (a CUDA graph's capture size) the layout is fixed for that size and the
rows past the real ones are inert: token id 0 at position 0, KV slot -1 (never written), zero-length requests
with state slots -1 (no state read or written), no prompt rows and no fla chunk, block tables -1.
"""

from dataclasses import dataclass

import numpy as np
import torch

from truespec.forward_context import ForwardContext
from truespec.kv_cache.layout import kv_slots
from truespec.layers.backend import kernels, use_kernels
from truespec.ops.host_copy import aligned_spans, to_device_async
from truespec.ops.spec_step import move_positions_ref


@dataclass(slots=True)
class ContextRow:
    block_ids: list[int]  # the request's KV blocks (attention layers)
    start: int  # position of the first query token (= tokens already cached)
    query_len: int
    state_src: int  # flat state slot before this step, -1 = zeros
    state_dst: int  # flat slot that receives the state after query token ``write_start``
    write_start: int  # query offset of the first token whose state is kept
    num_logits: int  # logits for the last ``num_logits`` query tokens
    # leading query tokens at prompt positions: clamp(prompt_len - start, 0, query_len) (ScheduledRequest); 0 for a
    # drafter's rows, which all run split-KV attention
    num_prompt_rows: int = 0
    # the GDN layers run this row's recurrence with fla's chunk kernel (True: a long prompt's chunk of prompt rows
    # only, core/gdn_prefill_rule.py) or the token loop (False); None: no rule, the layer decides by chunk length
    gdn_chunked: bool | None = None


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] (T = padded size with pad_to)
    positions: torch.Tensor  # [T]
    ctx: ForwardContext


def _layout(num_tokens: int, num_reqs: int, width: int) -> list[int]:
    """Lengths of a packed step's segments, in order: input ids, positions, slot mapping, logits indices
    (num_tokens each), query_start_loc (num_reqs + 1), seq_lens, state_src, state_dst, state_write_start,
    num_prompt_rows (num_reqs each), block tables (num_reqs x width)."""
    t, r = num_tokens, num_reqs
    return [t, t, t, t, r + 1, r, r, r, r, r, r * width]


def packed_size(num_tokens: int, num_reqs: int, width: int) -> int:
    """int64 elements of a packed step."""
    return sum(aligned_spans(_layout(num_tokens, num_reqs, width)))


def split_packed(buf: torch.Tensor, num_tokens: int, num_reqs: int, width: int) -> list[torch.Tensor]:
    """Views of a packed step's segments (``_layout`` order), the block tables as [num_reqs, width]. A graph's
    static buffer is split once per capture size and the views reused by every step (``build_step(views=)``)."""
    cuts = _layout(num_tokens, num_reqs, width)
    spans = aligned_spans(cuts)
    views = [view[:n] for view, n in zip(torch.split(buf[:sum(spans)], spans), cuts, strict=True)]
    views[10] = views[10].view(num_reqs, width)
    return views


def build_step(rows: list[ContextRow], input_ids: list[int], positions: list[int], block_size: int,
               device: torch.device, pad_to: int | None = None, width: int | None = None,
               out: torch.Tensor | None = None, staging: torch.Tensor | None = None,
               views: list[torch.Tensor] | None = None, pad_reqs_to: int | None = None) -> StepInputs:
    """The step's device tensors. ``pad_to``: the token count (and request count, unless ``pad_reqs_to``) to pad
    to; ``width``: block table columns (default: the longest row's); ``out``: a device buffer to write into (a graph's
    static inputs, at least ``packed_size`` long; of its block table only the real rows' used columns are written);
    ``staging``: a pinned host buffer of the same length for the copy; ``views``: ``split_packed(out, pad_to,
    pad_reqs_to or pad_to, width)``, if the caller keeps it (saves re-splitting the static buffer every step)."""
    num_tokens, num_reqs = len(input_ids), len(rows)
    size_t = num_tokens if pad_to is None else pad_to
    size_r = num_reqs if pad_to is None else pad_reqs_to or pad_to
    if num_tokens > size_t or num_reqs > size_r:
        raise ValueError(f"a step of {num_tokens} tokens / {num_reqs} requests does not fit pad_to={pad_to} / "
                         f"pad_reqs_to={pad_reqs_to}")
    width = max((len(row.block_ids) for row in rows), default=0) if width is None else width
    query_start_loc, seq_lens, slot_mapping, logits_indices = [0], [], [], []
    row_end = 0  # the running query_start_loc
    for row in rows:
        start, query_len = row.start, row.query_len
        end, row_end = start + query_len, row_end + query_len
        if query_len == 1:  # a decode: kv_slots' one slot, without the call (this loop is the host's hot path)
            slot_mapping.append(row.block_ids[start // block_size] * block_size + start % block_size)
        else:
            slot_mapping += kv_slots(row.block_ids, start, end, block_size)
        query_start_loc.append(row_end)
        seq_lens.append(end)
        logits_indices += range(row_end - row.num_logits, row_end)
    t, r = size_t, size_r
    cuts = _layout(t, r, width)
    spans = aligned_spans(cuts)
    meta_len = sum(spans[:10])
    used = max((len(row.block_ids) for row in rows), default=0)  # block-table columns real rows use
    if used > width:
        raise ValueError(f"a request holds {used} KV blocks, more than the {width} a step allows")
    full = out is None  # a fresh buffer gets the whole table; a graph's static one only the cells in use
    segments = (input_ids, positions, slot_mapping, logits_indices, query_start_loc, seq_lens,
                [row.state_src for row in rows], [row.state_dst for row in rows], [row.write_start for row in rows],
                [row.num_prompt_rows for row in rows])
    pads = (0, 0, -1, 0, num_tokens, 0, -1, -1, 0, 0)  # inert padding, see the module docstring
    values: list[int] = []  # the packed step, built as one list and converted once (the host's hot path)
    for seg, pad, span in zip(segments, pads, spans, strict=False):
        values += seg
        values += [pad] * (span - len(seg))
    columns = width if full else used
    for row in rows:
        values += row.block_ids
        values += [-1] * (columns - len(row.block_ids))
    if full:
        values += [-1] * ((r - num_reqs) * width + spans[10] - cuts[10])
        buf = to_device_async(torch.from_numpy(np.array(values, dtype=np.int64)), device)
    else:
        # Kernels read a row's table only below its seq_len (and padded rows not at all), so the cells past
        # the real rows and past the used columns may keep whatever an earlier step left there.
        host = torch.from_numpy(np.array(values, dtype=np.int64))  # numpy converts a list ~3x faster than torch
        if staging is not None:
            host = staging[:len(values)].copy_(host)
        views = split_packed(out, t, r, width) if views is None else views
        out[:meta_len].copy_(host[:meta_len], non_blocking=staging is not None)
        if num_reqs and used:
            views[10][:num_reqs, :used].copy_(host[meta_len:].view(num_reqs, used), non_blocking=staging is not None)
    (ids, pos, slots, logits_idx, qsl, lens, src, dst, wstart, prompt_rows, bt) = (
        split_packed(buf, t, r, width) if full else views)
    ctx = ForwardContext(
        query_start_loc=qsl, seq_lens=lens, slot_mapping=slots, block_tables=bt,
        state_src=src, state_dst=dst, state_write_start=wstart, logits_indices=logits_idx[:len(logits_indices)],
        query_start_loc_cpu=query_start_loc, seq_lens_cpu=seq_lens, state_cpu=tuple(segments[6:9]),
        num_prompt_rows=prompt_rows if any(row.num_prompt_rows for row in rows) else None,
        gdn_chunked_cpu=_gdn_chunked(rows, r))
    return StepInputs(ids, pos, ctx)


def _gdn_chunked(rows: list[ContextRow], num_reqs: int) -> list[bool] | None:
    """Per request (padding False), whether its GDN recurrence runs fla's chunk kernel; None when no row says."""
    if all(row.gdn_chunked is None for row in rows):
        return None
    return [bool(row.gdn_chunked) for row in rows] + [False] * (num_reqs - len(rows))


def build_forward_context(rows: list[ContextRow], block_size: int, device: torch.device) -> ForwardContext:
    """Only the metadata of an unpadded step (token ids and positions left at 0)."""
    num_tokens = sum(row.query_len for row in rows)
    return build_step(rows, [0] * num_tokens, [0] * num_tokens, block_size, device).ctx



def device_inputs(inputs: StepInputs, num_tokens: int, num_reqs: int, block_size: int,
                  input_ids_from: torch.Tensor | None, shift: torch.Tensor | None) -> None:
    """What a step takes from the device after its host-built inputs, in stream order: its first ``num_tokens`` input
    ids from ``input_ids_from`` (a step queued ahead: the previous step's argmax and drafts), then its move by
    ``shift`` (``shift_positions``); each only when given."""
    if input_ids_from is not None:
        inputs.input_ids[:num_tokens].copy_(input_ids_from[:num_tokens])
    if shift is not None:
        shift_positions(inputs, shift, num_tokens, num_reqs, block_size)


def shift_positions(inputs: StepInputs, shift: torch.Tensor, num_tokens: int, num_reqs: int, block_size: int) -> None:
    """Move request r's query ``shift[r]`` positions further, in place and on the device (a step planned before
    the previous one's accepted counts were read: docs/ARCHITECTURE.md, "Speculative steps queued ahead").

    Positions, context lengths and state sources move by the shift; the KV slots are looked up again in the block
    tables (a position past a request's blocks gets slot -1 and is not written). Queued in stream order: no host
    read, so the host goes on while the device computes ``shift``."""
    ctx = inputs.ctx
    move = kernels().move_positions if use_kernels(shift) else move_positions_ref
    move(inputs.positions, ctx.seq_lens, ctx.state_src, ctx.slot_mapping, ctx.block_tables,
         ctx.query_start_loc[:num_reqs + 1], shift, num_tokens, block_size)
    ctx.seq_lens_cpu = ctx.state_cpu = None  # the host copies no longer hold
