"""Attention for every query row of a step on CUDA: prompt rows by the prefill kernel, the others split-KV.

The routing rule (docs/ARCHITECTURE.md, "Attention rows"): a query row at absolute position p of request r goes to
the prefill kernel (kernels/prefill_attention.py) iff p < the request's prompt length. A request's prompt rows are
always a leading run of its query rows, so the step carries per request ``num_prompt_rows[r] =
clamp(prompt_len - first_position, 0, query_len)`` (worker/input_builder.py) on the device. The split-KV kernel and
its merge (kernels/paged_attention.py) skip exactly those rows and compute the rest: plain decodes, speculative
verifies and output positions recomputed after preemption keep the bits they have alone (invariant 4: a row's split
layout depends on its number of keys only, and the skip is a runtime argument of the same binary). The prefill
kernel computes exactly those rows, each prompt position with the same bits however the prompt is chunked (a 1-token
last chunk included). Both write the same ``out``; every row is written by one of them (padding rows: zeros, by the
split kernel).

``num_prompt_rows`` None: no row of the step is a prompt row; the split kernel computes every row and the prefill
kernel is not launched (a CUDA graph of a decode / verify step holds no prefill launch: worker/graph_runner.py).
Both kernels read the same cache encoding (model dtype or a packed format, kernels/kv_tiles.py) and the same q as
the kernels read it (rotated once for Lloyd-Max keys). The sparse-V tile skip is the split kernel's only.
No host read; grids and workspace come from shapes: safe inside a captured CUDA graph.
"""

import torch

from truespec.kernels.paged_attention import (
    BLOCK_N,
    MAX_SPLITS,
    MAX_WORKSPACE_BYTES,
    MIN_SPLIT_KEYS,
    split_attention,
)
from truespec.kernels.paged_attention_packed import KVFormat, cache_tiles
from truespec.kernels.prefill_attention import prefill_rows


def step_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    num_prompt_rows: torch.Tensor | None,
    fmt: KVFormat | None = None,
    out: torch.Tensor | None = None,
    sparse_v_threshold: float | None = None,
    sparse_v_min_keys: int = 0,
    max_workspace_bytes: int = MAX_WORKSPACE_BYTES,
    is_prompt_only: bool = False,
) -> torch.Tensor:
    """Causal attention of q [T, num_heads, head_dim] over the paged ``kv_cache`` (model dtype, or packed in
    ``fmt``): request r's first ``num_prompt_rows[r]`` (device, [R]) query rows by the prefill kernel, its other
    rows by the split-KV kernel with the sparse-V arguments of ``paged_attention``. Rows past
    ``query_start_loc[-1]`` (padding) come back as zeros. ``is_prompt_only`` (the host knows it: an eager step, or a
    piecewise graph's variant, whose every real row is a prompt row; padding rows are then left unwritten, which
    only row-wise ops read after it, worker/piecewise_graphs.py): the split-KV kernel,
    which would only skip every row, is not launched (at 64 splits its workspace holds ~250 rows, so an 8K-token
    prefill chunk was 33 empty launches a layer, 9% of its GPU time). Returns ``out`` (allocated if None) in q's
    dtype."""
    q_in, tiles = cache_tiles(q, kv_cache, fmt)
    out = torch.empty_like(q) if out is None else out
    if is_prompt_only and num_prompt_rows is not None:
        return prefill_rows(q_in, tiles, query_start_loc, seq_lens, block_tables, num_prompt_rows, scale, out)
    split_attention(q_in, tiles, query_start_loc, seq_lens, block_tables, scale, out, BLOCK_N, MAX_SPLITS,
                    MIN_SPLIT_KEYS, tiles.num_warps, max_workspace_bytes, sparse_v_threshold, sparse_v_min_keys,
                    num_prompt_rows)  # fmt: skip
    if num_prompt_rows is not None:
        prefill_rows(q_in, tiles, query_start_loc, seq_lens, block_tables, num_prompt_rows, scale, out)
    return out
