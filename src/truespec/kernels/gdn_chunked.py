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

Numerics: fla gets q, k, v in the model's dtype (as transformers and vLLM call it; g, beta and states in fp32) and
computes in another order than the token loop, with bf16 products for bf16 inputs: one 8K-token sequence at Qwen3.5's
GDN shape takes 0.455 ms instead of 0.973 ms with the inputs widened to fp32 (TF32 products; 32K: 1.36 vs 3.80 ms),
at 4.5e-3 instead of 1.5e-3 relative error in the outputs and 3.5e-3 instead of 8e-4 in the final state against a
float64 recurrence (benchmarks/fla_input_dtype.py, H200, BENCHMARKS.md session 26; one bf16 rounding is up to 3.9e-3).
Requests left to ``gdn_recurrent`` are bit-identical to a plain ``gdn_recurrent`` call. fla keeps its state in fp32
only, so float64 states (float64 models, the exactness tests) always take the token loop.

Speed (benchmarks/gdn_prefill.py, H200, bf16 model, measured when fla still took fp32 inputs): one call costs
~1.4 ms whatever its size, then ~0.13 us per token; the token loop costs ~1.7 us per token of the longest request
(until the GPU is full: 128x512 tokens take 8.4 ms either way). So one 4096-token chunk is 4.6x faster, one 512-token
chunk 2x slower: hence the default ``MIN_CHUNK_LEN``. (A step of <= 512 tokens is also one the CUDA graphs replay,
where only the token loop can run.)
"""

import functools
from collections.abc import Callable

import torch

from truespec.kernels import fla_configs
from truespec.kernels.gdn_chunked_plan import ChunkedPlan, split_requests
from truespec.kernels.gdn_recurrent import gdn_recurrent
from truespec.ops.state_slots import StateSlots

MIN_CHUNK_LEN = 1024  # break-even ~800 tokens (bf16) / ~1100 (fp32) with fp32 fla inputs; never below 64
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


def step_plan(
    ssm_state: torch.Tensor, head_k_dim: int, query_start_loc: torch.Tensor, state_src: torch.Tensor,
    state_dst: torch.Tensor, state_write_start: torch.Tensor, *, query_start_loc_cpu: list[int] | None = None,
    state_src_cpu: list[int] | None = None, state_dst_cpu: list[int] | None = None,
    state_write_start_cpu: list[int] | None = None, min_chunk_len: int = MIN_CHUNK_LEN,
    is_chunked_cpu: list[bool] | None = None, plan_cache: dict | None = None,
) -> ChunkedPlan:
    """The step's ``ChunkedPlan`` (``gdn_chunked``'s arguments): kept in ``plan_cache`` for the step's other layers,
    and there before the first layer's conv, which normalises the chunk kernel's q / k (``chunked_flags``)."""
    usable = _chunk_kernel() is not None and ssm_state.dtype == torch.float32 and head_k_dim <= MAX_HEAD_K_DIM
    threshold = min_chunk_len if usable else float("inf")
    key = f"gdn_chunked_plan_{threshold}"
    plan = None if plan_cache is None else plan_cache.get(key)
    if plan is None:
        slots = StateSlots(*(t.tolist() if cpu is None else cpu for t, cpu in (
            (query_start_loc, query_start_loc_cpu), (state_src, state_src_cpu), (state_dst, state_dst_cpu),
            (state_write_start, state_write_start_cpu))))  # fmt: skip
        split = split_requests(slots.query_start_loc, slots.state_dst, slots.state_write_start, threshold,
                               is_chunked_cpu)
        plan = ChunkedPlan.of(slots, split, ssm_state.device)
        if plan_cache is not None:
            plan_cache[key] = plan
    return plan


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
    qk_normalized: bool = False,
) -> torch.Tensor:
    """``gdn_recurrent`` given g, beta tensors (same arguments, same effect on ``ssm_state``, o [T, HV, DV])
    with long prefill chunks (or the requests ``is_chunked_cpu`` names) through fla's chunk kernel. The ``*_cpu``
    lists are host copies of the metadata (read back with one sync when omitted). ``plan_cache``: a dict that lives
    for one step (the layers' shared host cache), where the step's ``ChunkedPlan`` is kept for the next layer (see
    ``step_plan``). All initial states are read before any slot is written. q, k, v in the model's dtype, each
    contiguous (fla takes the chunked rows without a copy when they are one run of the step); o in v's dtype.
    ``qk_normalized``: the chunk kernel's rows of q and k come L2-normalised already (the conv's ``l2norm_rows`` with
    the plan's ``chunked_flags``), so fla does not normalise them again.
    """
    meta = (query_start_loc, state_src, state_dst, state_write_start)
    if ssm_state.is_cuda and torch.cuda.is_current_stream_capturing():  # host reads cannot be captured
        return gdn_recurrent(q, k, v, g, beta, ssm_state, *meta, scale, use_qk_l2norm)
    plan = step_plan(ssm_state, q.shape[-1], *meta, query_start_loc_cpu=query_start_loc_cpu,
                     state_src_cpu=state_src_cpu, state_dst_cpu=state_dst_cpu,
                     state_write_start_cpu=state_write_start_cpu, min_chunk_len=min_chunk_len,
                     is_chunked_cpu=is_chunked_cpu, plan_cache=plan_cache)  # fmt: skip
    if not plan.split.chunked:
        return gdn_recurrent(q, k, v, g, beta, ssm_state, *meta, scale, use_qk_l2norm)
    initial = plan.initial(ssm_state)  # reads before any write
    recurrent = None
    if plan.recurrent_rows is not None:
        rows = plan.recurrent_rows
        recurrent = gdn_recurrent(q[rows], k[rows], v[rows], g[rows], beta[rows], ssm_state, *plan.recurrent_meta,
                                  scale, use_qk_l2norm)  # fmt: skip
    rows = plan.chunked_rows
    cdt = ssm_state.dtype  # gates in fp32, as the token loop's
    o, final = _chunk_kernel()(
        *(x[rows][None] for x in (q, k, v)), *(x[rows][None].to(cdt) for x in (g, beta)),
        scale=q.shape[-1] ** -0.5 if scale is None else scale, initial_state=initial, output_final_state=True,
        use_qk_l2norm_in_kernel=use_qk_l2norm and not qk_normalized,
        cu_seqlens=plan.cu_seqlens, cu_seqlens_cpu=plan.cu_seqlens_cpu, chunk_indices=plan.chunk_indices,
    )  # fmt: skip
    o = o[0]
    if recurrent is None and isinstance(rows, slice) and rows == slice(0, q.shape[0]):  # the chunk fills the step
        out = o
    else:
        out = torch.zeros(q.shape[0], v.shape[1], v.shape[2], dtype=v.dtype, device=v.device)
        out[rows] = o
        if recurrent is not None:
            out[plan.recurrent_rows] = recurrent
    if plan.kept is not None:  # final[i]: chunked request i's state after its last token, kept where the protocol says
        ssm_state[plan.kept_slots] = final[plan.kept].to(ssm_state.dtype)
    return out
