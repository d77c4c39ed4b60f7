"""The host side of a step through fla's chunk kernel (kernels/gdn_chunked.py): which requests take it, and the
index tensors their GDN layers share (``ChunkedPlan``), copied to the device once a step, asynchronously."""

from dataclasses import dataclass

import torch

from truespec.ops.host_copy import columns_to_device
from truespec.ops.state_slots import SlotGather, StateSlots

FLA_CHUNK_SIZE = 64  # fla's chunk length (chunk_gated_delta_rule's default chunk_size)


@dataclass(frozen=True)
class RequestSplit:
    chunked: list[int]  # requests for the chunk kernel: long queries keeping only their final state
    recurrent: list[int]  # every other request with a non-empty query (empty ones do nothing anywhere)


def split_requests(
    query_start_loc: list[int], state_dst: list[int], state_write_start: list[int], min_chunk_len: float,
    is_chunked: list[bool] | None = None,
) -> RequestSplit:
    """Which requests the chunk kernel runs: those ``is_chunked`` names (when given; else query_len >=
    min_chunk_len) that keep no state but the last. ``min_chunk_len`` inf: none (the kernel cannot run)."""
    chunked, recurrent = [], []
    for r, (dst, write_start) in enumerate(zip(state_dst, state_write_start, strict=True)):
        query_len = query_start_loc[r + 1] - query_start_loc[r]
        if query_len == 0:
            continue
        keeps_final_only = dst < 0 or write_start >= query_len - 1
        wanted = query_len >= min_chunk_len if is_chunked is None else is_chunked[r] and min_chunk_len < float("inf")
        (chunked if wanted and keeps_final_only else recurrent).append(r)
    return RequestSplit(chunked, recurrent)


def _token_rows(qsl: list[int], reqs: list[int]) -> slice | list[int]:
    """Token rows of ``reqs`` in order: a slice when they are one contiguous run (a view, no copy), else a list."""
    if all(qsl[a + 1] == qsl[b] for a, b in zip(reqs, reqs[1:], strict=False)):
        return slice(qsl[reqs[0]], qsl[reqs[-1] + 1])
    return [t for r in reqs for t in range(qsl[r], qsl[r + 1])]


def _sub_start_loc(qsl: list[int], reqs: list[int]) -> list[int]:
    """query_start_loc of ``reqs`` packed one after another (their token rows from ``_token_rows``)."""
    starts = [0]
    for r in reqs:
        starts.append(starts[-1] + qsl[r + 1] - qsl[r])
    return starts


def chunk_indices(cu_seqlens: list[int], chunk_size: int = FLA_CHUNK_SIZE) -> list[int]:
    """fla's ``chunk_indices`` flattened: (sequence, chunk of it) for each ``chunk_size``-token chunk, in order (what
    ``fla.ops.utils.index.prepare_chunk_indices`` computes, and copies to the device, when not given them)."""
    return [x for i, (a, b) in enumerate(zip(cu_seqlens, cu_seqlens[1:], strict=False))
            for j in range(-(-(b - a) // chunk_size)) for x in (i, j)]  # fmt: skip


@dataclass(frozen=True)
class ChunkedPlan:
    """What ``gdn_chunked`` derives from a step's host metadata, as device tensors built once, in one asynchronous
    copy (``ops.host_copy.columns_to_device``). Every GDN layer of a step has the same metadata, so the layer keeps one
    plan per step (``plan_cache``): from the second layer on nothing is copied from the host. fla gets its chunk
    indices from the plan too (else it would build and copy them itself, waiting for the GPU)."""

    split: RequestSplit
    recurrent_rows: slice | torch.Tensor | None  # the token loop's rows and packed metadata (None: no such request)
    recurrent_meta: list[torch.Tensor] | None
    chunked_rows: slice | torch.Tensor | None  # the chunk kernel's rows (None: no such request)
    cu_seqlens: torch.Tensor | None  # [C + 1] on the device, and its host twin
    cu_seqlens_cpu: torch.Tensor | None
    chunk_indices: torch.Tensor | None  # [num_chunks, 2] on the device: fla's (sequence, chunk) of each chunk
    chunked_flags: torch.Tensor | None  # [R] on the device: 1 for the chunk kernel's requests
    initial: SlotGather | None  # the chunked requests' starting states
    kept: torch.Tensor | None  # [N] indices into the chunk kernel's final states that are kept ...
    kept_slots: torch.Tensor | None  # ... and the slots that keep them (None: none kept)

    @classmethod
    def of(cls, slots: StateSlots, split: RequestSplit, device: torch.device) -> "ChunkedPlan":
        qsl, chunked, recurrent = slots.query_start_loc, split.chunked, split.recurrent
        if not chunked:
            return cls(split, *[None] * 10)
        columns: dict[str, list[int]] = {}  # what goes to the device, by name
        rows = {"chunked_rows": _token_rows(qsl, chunked)}
        if recurrent:
            rows["recurrent_rows"] = _token_rows(qsl, recurrent)
            meta = [_sub_start_loc(qsl, recurrent)] + [[x[r] for r in recurrent] for x in (
                slots.state_src, slots.state_dst, slots.state_write_start)]  # fmt: skip
            columns |= {f"meta{i}": column for i, column in enumerate(meta)}
        columns |= {name: r for name, r in rows.items() if isinstance(r, list)}
        cu_seqlens = _sub_start_loc(qsl, chunked)
        columns |= {"cu_seqlens": cu_seqlens, "chunk_indices": chunk_indices(cu_seqlens)}
        columns["chunked_flags"] = [0] * slots.num_reqs
        for r in chunked:
            columns["chunked_flags"][r] = 1
        src = [slots.state_src[r] for r in chunked]
        if any(s >= 0 for s in src):
            columns["index"] = [max(s, 0) for s in src]
            if min(src) < 0:
                columns["is_zero"] = [s < 0 for s in src]
        last_slots = [slots.kept_slot(r, slots.query_len(r) - 1) for r in chunked]
        kept = [i for i, slot in enumerate(last_slots) if slot is not None]
        if kept:
            columns |= {"kept": kept, "kept_slots": [last_slots[i] for i in kept]}
        dev = dict(zip(columns, columns_to_device(list(columns.values()), device), strict=True))
        rows = {name: dev.get(name, r) for name, r in rows.items()}
        is_zero = dev["is_zero"].bool() if "is_zero" in dev else None
        return cls(split, rows.get("recurrent_rows"), [dev[f"meta{i}"] for i in range(4)] if recurrent else None,
                   rows["chunked_rows"], dev["cu_seqlens"], torch.tensor(cu_seqlens, dtype=torch.int64),
                   dev["chunk_indices"].view(-1, 2), dev["chunked_flags"], SlotGather(dev.get("index"), is_zero,
                                                                                       len(chunked)),
                   dev.get("kept"), dev.get("kept_slots"))  # fmt: skip
