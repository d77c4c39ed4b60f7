"""Per-step batch metadata: one typed object, set around a model forward, read by the layers.

A step packs the tokens of several requests one after another (prefill chunks, decodes and,
later, speculative verifies of different lengths). Every layer treats request ``r`` by its own
per-request values below; nothing branches on the batch composition (docs/ARCHITECTURE.md invariant 1).

Recurrent (GDN) state lives in flat "state slots". A request owns a group of ``1 + k_max``
consecutive slots starting at ``state_dst[r]``. It reads its state before the step from
``state_src[r]`` (-1: start from zeros, i.e. a fresh prefill) and writes the state after each
query token ``t >= state_write_start[r]`` (token offset inside its query) into slot
``state_dst[r] + t - state_write_start[r]``. A plain decode or prefill chunk writes only its last
token's state (``state_write_start = query_len - 1``); a verify of ``1 + d`` tokens writes all
``1 + d`` (``state_write_start = 0``), so the state after any accepted prefix is kept
(invariant 2). Rows with ``state_dst == -1`` and tokens with ``slot_mapping == -1`` are padding:
they never write KV or state (invariant 3).
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ForwardContext:
    query_start_loc: torch.Tensor  # [num_reqs + 1] int64: request r owns tokens [qsl[r], qsl[r+1])
    seq_lens: torch.Tensor  # [num_reqs] int64: context length after this step (cached + this step)
    slot_mapping: torch.Tensor  # [num_tokens] int64: flat KV slot (block * block_size + offset), -1 = skip
    block_tables: torch.Tensor  # [num_reqs, max_blocks_per_req] int64, -1 padded
    state_src: torch.Tensor  # [num_reqs] int64: flat state slot to start from, -1 = zero state
    state_dst: torch.Tensor  # [num_reqs] int64: first flat state slot of the request's group, -1 = inert
    state_write_start: torch.Tensor  # [num_reqs] int64: first query offset whose state is written
    logits_indices: torch.Tensor  # [num_logits] int64: token rows whose logits the sampler needs
    # Host copies for the torch reference paths (never read inside a captured CUDA graph).
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int] | None  # None once the device moved the positions (input_builder.shift_positions)
    # (state_src, state_dst, state_write_start) of the real requests on the host, where the builder has them
    # (eager paths that pick a kernel per request, e.g. GDN chunked prefill); None: not known on the host.
    state_cpu: tuple[list[int], list[int], list[int]] | None = None
    # [num_reqs] int64: request r's leading query rows at prompt positions (position < its prompt length), which the
    # CUDA attention computes with the prefill kernel (kernels/step_attention.py); padding requests 0. None: no row of
    # the step is a prompt row (decodes, verifies, drafters' steps), so no prefill kernel runs.
    num_prompt_rows: torch.Tensor | None = None
    # [num_reqs] on the host, padding False: request r's GDN recurrence runs fla's chunk kernel (a long prompt's
    # chunk under a GdnPrefillRule, core/gdn_prefill_rule.py) or the token loop; None: no rule, the layer sends
    # chunks of at least kernels/gdn_chunked.MIN_CHUNK_LEN tokens to fla
    gdn_chunked_cpu: list[bool] | None = None
    # every row of this (eager, unpadded) step is a prompt row: the split-KV kernel need not launch at all
    is_prompt_only: bool = False
    # worker/piecewise_graphs.PieceRecorder while a step with fla's chunk kernel is captured in pieces (or dry-run
    # before that): the GDN layers end a piece before fla's call and start the next after it. None otherwise.
    pieces: Any = None
    # What layers derive from the metadata once per forward and share (the CPU path's ops/gdn_batched.StepRows and
    # ops/attention_rows.StepAttentionRows, an eager GPU prefill's kernels/gdn_chunked_plan.ChunkedPlan);
    # emptied whenever the context is set, since a reused context's tensors may have moved in place.
    host_cache: dict[str, Any] = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return len(self.query_start_loc_cpu) - 1

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]

    @property
    def max_query_len(self) -> int:
        qsl = self.query_start_loc_cpu
        return max((qsl[r + 1] - qsl[r] for r in range(len(qsl) - 1)), default=0)


_current: ForwardContext | None = None


@contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[None]:
    """Make ``ctx`` the metadata of the forward running inside the block (no nesting)."""
    global _current
    if _current is not None:
        raise RuntimeError("set_forward_context does not nest: a forward is already running")
    ctx.host_cache.clear()
    _current = ctx
    try:
        yield
    finally:
        _current = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("no forward context: run the model inside set_forward_context(...)")
    return _current
