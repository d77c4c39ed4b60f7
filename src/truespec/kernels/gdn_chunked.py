"""Gated delta rule with long prefill chunks through fla-core's chunked kernel (optional, CUDA, eager only).

``gdn_recurrent`` runs a request's tokens one after another, so a 4096-token prefill chunk is 4096 dependent
steps. flash-linear-attention's ``chunk_gated_delta_rule`` (package ``fla-core``, not a dependency: truespec
imports and runs without it) computes the same recurrence 64 tokens at a time with matrix products (the WY /
UT-transform form). ``gdn_chunked`` sends it the requests where that is both fast and enough: a query of at
least ``MIN_CHUNK_LEN`` tokens that keeps only its final state (``state_write_start == query_len - 1``, or no
state at all: ``state_dst == -1``). Every other request (decodes, 1+k verifies that keep a state per position,
short chunks) runs through ``gdn_recurrent`` unchanged, so invariant 2 holds exactly as there.

With ``is_chunked_cpu`` (per request, from a GdnPrefillRule: core/gdn_prefill_rule.py) the caller names the
requests for the chunk kernel instead, whatever their length (each must still keep only its final state): a long
prompt's chunks all take fla, so its states do not depend on where its prompt was cut.

Eager only: the split is decided on the host from host copies of the metadata and the fla launch sizes depend
on it, so the caller uses ``gdn_recurrent`` in captured CUDA graphs (called during a capture, this function
does exactly that).

Numerics: fla computes in fp32 with TF32 tensor-core products (bf16 inputs reach it widened to fp32: 4x closer
states than feeding fla bf16, ~5% slower; the layer's conv writes them so, contiguous: ``model_dtype`` below), in a
different order than the token loop. Chunked requests match ``gdn_recurrent_ref`` to ~1.5e-3 (fp32 inputs) /
~2.8e-3 (bf16 inputs) relative error in outputs and ~8e-4 in final states (Frobenius, worst request; H200, Qwen3.5
shapes, chunks up to 700 tokens); requests left to ``gdn_recurrent`` are bit-identical to a plain ``gdn_recurrent``
call. fla keeps its state in fp32 only, so float64 states (float64 models, the exactness tests) always take the token
loop.

Speed (benchmarks/gdn_prefill.py, H200, bf16): one call costs ~1.4 ms whatever its size, then ~0.13 us per
token; the token loop costs ~1.7 us per token of the longest request (until the GPU is full: 128x512 tokens
take 8.4 ms either way). So one 4096-token chunk is 4.6x faster, one 512-token chunk 2x slower: hence the
default ``MIN_CHUNK_LEN``.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from truespec.kernels import fla_configs
from truespec.kernels.gdn_recurrent import gdn_recurrent
from truespec.ops.state_slots import SlotGather, StateSlots

MIN_CHUNK_LEN = 1024  # measured break-even ~800 tokens (bf16) / ~1100 (fp32); never below fla's chunk size, 64
FLA_CHUNK_SIZE = 64  # fla's chunk length (chunk_gated_delta_rule's default chunk_size)
MAX_HEAD_K_DIM = 256  # fla's state kernel (chunk_gated_delta_rule_fwd_h) asserts head_k_dim <= 256


@functools.cache
def _import_fla() -> Callable | None:
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # noqa: BLE001 - not installed, or does not import with this torch / triton
        return None
    if torch.cuda.is_available():
        fla_configs.pin()
    return chunk_gated_delta_rule


def _chunk_kernel() -> Callable | None:
    """fla's ``chunk_gated_delta_rule`` when it can run here (CUDA present and fla importable), else None."""
    return _import_fla() if torch.cuda.is_available() else None


def is_available() -> bool:
    """Whether ``gdn_chunked`` can use the chunked kernel (otherwise it is exactly ``gdn_recurrent``)."""
    return _chunk_kernel() is not None


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


def _to_device(columns: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """int64 ``columns`` on ``device`` in one copy; on CUDA from pinned memory, asynchronously: a copy from pageable
    host memory waits for everything queued on the GPU before it (one such wait in an 8K prefill kept the host from
    queueing it behind the previous step)."""
    host = torch.tensor([x for column in columns for x in column], dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory()
    return list(host.to(device, non_blocking=True).split([len(c) for c in columns]))


@dataclass(frozen=True)
class ChunkedPlan:
    """What ``gdn_chunked`` derives from a step's host metadata, as device tensors built once, in one asynchronous
    copy (``_to_device``). Every GDN layer of a step has the same metadata, so the layer keeps one plan per step
    (``plan_cache``): from the second layer on nothing is copied from the host. fla gets its chunk indices from the
    plan too (else it would build and copy them itself, waiting for the GPU)."""

    split: RequestSplit
    recurrent_rows: slice | torch.Tensor | None  # the token loop's rows and packed metadata (None: no such request)
    recurrent_meta: list[torch.Tensor] | None
    chunked_rows: slice | torch.Tensor | None  # the chunk kernel's rows (None: no such request)
    cu_seqlens: torch.Tensor | None  # [C + 1] on the device, and its host twin
    cu_seqlens_cpu: torch.Tensor | None
    chunk_indices: torch.Tensor | None  # [num_chunks, 2] on the device: fla's (sequence, chunk) of each chunk
    initial: SlotGather | None  # the chunked requests' starting states
    kept: torch.Tensor | None  # [N] indices into the chunk kernel's final states that are kept ...
    kept_slots: torch.Tensor | None  # ... and the slots that keep them (None: none kept)

    @classmethod
    def of(cls, slots: StateSlots, split: RequestSplit, device: torch.device) -> "ChunkedPlan":
        qsl, chunked, recurrent = slots.query_start_loc, split.chunked, split.recurrent
        if not chunked:
            return cls(split, *[None] * 9)
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
        src = [slots.state_src[r] for r in chunked]
        if any(s >= 0 for s in src):
            columns["index"] = [max(s, 0) for s in src]
            if min(src) < 0:
                columns["is_zero"] = [s < 0 for s in src]
        last_slots = [slots.kept_slot(r, slots.query_len(r) - 1) for r in chunked]
        kept = [i for i, slot in enumerate(last_slots) if slot is not None]
        if kept:
            columns |= {"kept": kept, "kept_slots": [last_slots[i] for i in kept]}
        dev = dict(zip(columns, _to_device(list(columns.values()), device), strict=True))
        rows = {name: dev.get(name, r) for name, r in rows.items()}
        is_zero = dev["is_zero"].bool() if "is_zero" in dev else None
        return cls(split, rows.get("recurrent_rows"), [dev[f"meta{i}"] for i in range(4)] if recurrent else None,
                   rows["chunked_rows"], dev["cu_seqlens"], torch.tensor(cu_seqlens, dtype=torch.int64),
                   dev["chunk_indices"].view(-1, 2), SlotGather(dev.get("index"), is_zero, len(chunked)),
                   dev.get("kept"), dev.get("kept_slots"))  # fmt: skip


@torch.no_grad()
def gdn_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_src: torch.Tensor,
    state_dst: torch.Tensor,
    state_write_start: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    *,
    query_start_loc_cpu: list[int] | None = None,
    state_src_cpu: list[int] | None = None,
    state_dst_cpu: list[int] | None = None,
    state_write_start_cpu: list[int] | None = None,
    min_chunk_len: int = MIN_CHUNK_LEN,
    is_chunked_cpu: list[bool] | None = None,
    plan_cache: dict | None = None,
    model_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``gdn_recurrent`` given g, beta tensors (same arguments, same effect on ``ssm_state``, o [T, HV, DV])
    with long prefill chunks (or the requests ``is_chunked_cpu`` names) through fla's chunk kernel. The ``*_cpu``
    lists are host copies of the metadata (read back with one sync when omitted). All initial states are read
    before any slot is written. ``plan_cache``: a dict that lives for one step (the layers' shared host cache),
    where the step's ``ChunkedPlan`` is kept for the next layer. ``model_dtype``: q, k, v come widened (fp32,
    contiguous: fla takes them so without a copy) but hold values of this dtype, which the token loop's rows are
    given back in (bit for bit its usual inputs) and o is returned in (default v's dtype).
    """
    meta = (query_start_loc, state_src, state_dst, state_write_start)
    model_dtype = model_dtype or v.dtype
    if ssm_state.is_cuda and torch.cuda.is_current_stream_capturing():  # host reads cannot be captured
        return gdn_recurrent(*_narrowed(model_dtype, q, k, v), g, beta, ssm_state, *meta, scale, use_qk_l2norm)
    kernel = _chunk_kernel()
    usable = kernel is not None and ssm_state.dtype == torch.float32 and q.shape[-1] <= MAX_HEAD_K_DIM
    threshold = min_chunk_len if usable else float("inf")
    key = f"gdn_chunked_plan_{threshold}"
    plan = None if plan_cache is None else plan_cache.get(key)
    if plan is None:
        slots = StateSlots(*(t.tolist() if cpu is None else cpu for t, cpu in (
            (query_start_loc, query_start_loc_cpu), (state_src, state_src_cpu), (state_dst, state_dst_cpu),
            (state_write_start, state_write_start_cpu))))  # fmt: skip
        split = split_requests(slots.query_start_loc, slots.state_dst, slots.state_write_start, threshold,
                               is_chunked_cpu)
        plan = ChunkedPlan.of(slots, split, q.device)
        if plan_cache is not None:
            plan_cache[key] = plan
    if not plan.split.chunked:
        return gdn_recurrent(*_narrowed(model_dtype, q, k, v), g, beta, ssm_state, *meta, scale, use_qk_l2norm)
    initial = plan.initial(ssm_state)  # reads before any write
    out = torch.zeros(q.shape[0], v.shape[1], v.shape[2], dtype=model_dtype, device=v.device)
    if plan.recurrent_rows is not None:
        rows = plan.recurrent_rows
        out[rows] = gdn_recurrent(*_narrowed(model_dtype, *(x[rows] for x in (q, k, v))), g[rows], beta[rows],
                                  ssm_state, *plan.recurrent_meta, scale, use_qk_l2norm)  # fmt: skip
    rows = plan.chunked_rows
    cdt = ssm_state.dtype  # fla's products in fp32 (TF32) even for bf16 inputs, as gdn_recurrent's math
    o, final = kernel(
        *(x[rows][None].to(cdt) for x in (q, k, v, g, beta)), scale=q.shape[-1] ** -0.5 if scale is None else scale,
        initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm,
        cu_seqlens=plan.cu_seqlens, cu_seqlens_cpu=plan.cu_seqlens_cpu, chunk_indices=plan.chunk_indices,
    )  # fmt: skip
    out[rows] = o[0].to(out.dtype)
    if plan.kept is not None:  # final[i]: chunked request i's state after its last token, kept where the protocol says
        ssm_state[plan.kept_slots] = final[plan.kept].to(ssm_state.dtype)
    return out


def _narrowed(dtype: torch.dtype, *xs: torch.Tensor) -> list[torch.Tensor]:
    """``xs`` in ``dtype`` (exact: they hold values of it); unchanged where they already are."""
    return [x if x.dtype == dtype else x.to(dtype) for x in xs]
