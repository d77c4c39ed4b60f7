"""Causal attention for prefill chunks, tiled over query tokens (FlashAttention-2 style) on the paged cache.

The split-KV kernel (kernels/paged_attention.py) runs one program per (query token, kv head, split): every query
row of a long prompt reloads the keys before it, so a chunk of L tokens over a context of S reads K / V L times.
Here one program takes BLOCK_M consecutive query tokens of one request and the GQA group of one kv head, as
``BLOCK_M * GROUP_PAD`` rows of one MMA operand (token-major: row i is token i // GROUP_PAD, query head
i % GROUP_PAD of the group), and walks the request's keys 0 .. its last row's position in tiles of BLOCK_N with
an online softmax: K / V are read once per BLOCK_M tokens, scores and P @ V are tensor-core MMAs for 16-bit models.
Keys of earlier chunks come from the paged cache (the chunk's own keys were stored before this runs), in any cache
dtype: each K / V tile is loaded or decoded by kernels/kv_tiles.py, as in the split-KV kernel.

What a row computes depends on its position and the compile-time constants only: its key tiles start at absolute
key 0 and step by BLOCK_N, and a tile past a row's position (reached because a later row of the program needs it)
is an exact no-op for that row (its scores are -inf: m and l unchanged, alpha = exp(0) = 1, P = 0 adds 0). So a
prompt position gives the same bits however the prompt is cut into chunks and whichever rows share its program.
It need not match the split-KV kernel's bits: decode and verify rows never come here (docs/ARCHITECTURE.md,
invariant 4 is about them). Tiles that end at or before the program's first row's position + 1 are seen whole by
all its rows, so they skip the causal mask (for those rows it changes nothing: the same bits); the rest keep it.

Which rows: request r's first ``num_rows[r]`` query rows (``prefill_attention``'s ``num_rows``; all its rows when
None). In the engine those are its prompt rows, positions < its prompt length, and the split-KV kernel computes the
others into the same output (kernels/step_attention.py, docs/ARCHITECTURE.md "Attention rows").

Programs: kv heads x ``cdiv(T, BLOCK_M) + min(R, T)`` (each request with rows adds at most one partial tile), from
the shapes of q and seq_lens only; the program for tile t finds its request by binary search over the per-request
tile offsets (cumulative ``cdiv(num_rows[r], BLOCK_M)``, computed on the device, no host read), programs past the
last tile exit. Tiles launch last first, the kv heads of a tile together: a request's later tiles walk more keys,
and started first they leave the short ones to fill the GPU's last wave.
Padding rows (past ``query_start_loc[-1]``) are never written. So it runs eagerly and inside CUDA graphs alike: a
graph captured at T = S tokens and R = S requests serves every step padded to S (worker/graph_runner.py captures it
only into the graphs of steps with prompt rows).

There is no sparse-V tile skip here (it is the split-KV kernel's option): a prompt row reads every value tile,
with or without ``sparse_v``.

Block sizes (``launch_config``), swept on an H100 at 8K tokens (benchmarks/prefill_attention_speed.py --tune,
BENCHMARKS.md "Session 11"): 16-bit models over a model-dtype cache BLOCK_M 32, BLOCK_N 64, 8 warps, 3 stages
(258 TFLOP/s vs 146 with the first guess, 16 / 64 / 4 / 3); over a packed cache the same tiles with 1 stage (the
decoded tiles live in registers; more stages ran out of shared memory). fp32 / fp64 keep small untuned tiles. A
model's calls always use one configuration, so a prompt position's bits stay independent of the chunking.
"""

import torch
import triton
import triton.language as tl

from truespec.kernels.kv_tiles import CacheTiles, online_softmax_step, tile_pv, tile_queries, tile_scores, tile_slots
from truespec.kernels.paged_attention import dot_dtype
from truespec.kernels.paged_attention_packed import KVFormat, cache_tiles
from truespec.kernels.triton_utils import (
    find_request,
    needs_dot_upcast,
    pad_pow2,
    tl_compute_dtype,
)

# (BLOCK_M, BLOCK_N, warps, stages) by (16-bit model, packed cache); see the module docstring
_CONFIGS = {(True, False): (32, 64, 8, 3), (True, True): (32, 64, 8, 1),
            (False, False): (16, 64, 4, 3), (False, True): (16, 32, 4, 1)}  # fmt: skip


def launch_config(dtype: torch.dtype, tiles: CacheTiles) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages) for a model of ``dtype`` over ``tiles``' cache."""
    return _CONFIGS[dtype in (torch.bfloat16, torch.float16), tiles.cache.dtype == torch.uint8]


@triton.jit(do_not_specialize=["num_reqs", "stride_bt_req"])
def _prefill_attention_kernel(
    out_ptr,  # [T, num_heads, head_dim]
    q_ptr,  # [T, num_heads, head_dim] (rotated, in the accumulator dtype, for Lloyd-Max keys)
    kv_cache_ptr,
    centroids_ptr,
    query_start_loc_ptr,  # [R + 1]
    seq_lens_ptr,  # [R]
    block_tables_ptr,  # [R, max_blocks]
    num_rows_ptr,  # [R] the request's leading query rows computed here (its prompt rows; <= query_len)
    tile_offsets_ptr,  # [R + 1] first BLOCK_M tile of each request (cumulative cdiv(num_rows, BLOCK_M))
    num_reqs,
    scale: tl.float64,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    value_offset,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_bt_req,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query tokens per program
    BLOCK_N: tl.constexpr,  # keys per tile
    ACC_DTYPE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    UPCAST: tl.constexpr,
    KEY_ENC: tl.constexpr,
    KEY_BITS: tl.constexpr,
    KEY_CODE_BYTES: tl.constexpr,
    KEY_DIM_CHUNK: tl.constexpr,
    KEY_DIM_UNROLL: tl.constexpr,
    VALUE_ENC: tl.constexpr,
    VALUE_BITS: tl.constexpr,
    VALUE_CODE_BYTES: tl.constexpr,
    FP16_ALIGNED: tl.constexpr,
):
    kv_head = tl.program_id(0)
    tile = tl.num_programs(1) - 1 - tl.program_id(1)  # the last (longest) tiles of each request launch first
    if tile >= tl.load(tile_offsets_ptr + num_reqs):
        return
    r = find_request(tile_offsets_ptr, num_reqs, tile)
    q_start = tl.load(query_start_loc_ptr + r)
    num_cached = tl.load(seq_lens_ptr + r) - (tl.load(query_start_loc_ptr + r + 1) - q_start)  # keys before the chunk
    q_end = q_start + tl.load(num_rows_ptr + r)  # past the request's last row computed here
    first = q_start + (tile - tl.load(tile_offsets_ptr + r)) * BLOCK_M  # the program's first token

    i = tl.arange(0, BLOCK_M * GROUP_PAD)
    token = first + i // GROUP_PAD
    g = i % GROUP_PAD
    is_row = (token < q_end) & (g < GROUP)
    position = tl.where(is_row, num_cached + token - q_start, 0)  # [ROWS]
    d = tl.arange(0, HEAD_DIM_PAD)
    q_mask = is_row[:, None] & (d[None, :] < HEAD_DIM)
    head = kv_head * GROUP + g
    q_rows = q_ptr + token * stride_q_tok + head * stride_q_head  # [ROWS]
    q = tl.load(q_rows[:, None] + d[None, :], mask=q_mask, other=0.0)
    q, q_lo = tile_queries(q, KEY_ENC, ACC_DTYPE, DOT_DTYPE)
    scale_acc = tl.full([], scale, ACC_DTYPE)

    m = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), ACC_DTYPE)
    l = tl.full([BLOCK_M * GROUP_PAD], 0, ACC_DTYPE)
    acc = tl.full([BLOCK_M * GROUP_PAD, HEAD_DIM_PAD], 0, ACC_DTYPE)
    cache_head_ptr = kv_cache_ptr + kv_head * stride_cache_head
    num_keys = num_cached + tl.minimum(first + BLOCK_M, q_end) - q_start  # the last row's position + 1
    # Tiles below the first row's position + 1 are seen whole by every row: no causal mask there (the same bits).
    num_full = (num_cached + first - q_start + 1) // BLOCK_N * BLOCK_N
    for tile_start in range(0, num_full, BLOCK_N):
        m, l, acc = _attend_tile(m, l, acc, tile_start, num_keys, position, q, q_lo, q_rows, is_row, d, r,
                                 block_tables_ptr, stride_bt_req, stride_cache_block, stride_cache_slot,
                                 cache_head_ptr, value_offset, centroids_ptr, scale_acc, False, BLOCK_N, BLOCK_SIZE,
                                 HEAD_DIM, KEY_ENC, KEY_BITS, KEY_CODE_BYTES, KEY_DIM_CHUNK, KEY_DIM_UNROLL,
                                 VALUE_ENC, VALUE_BITS, VALUE_CODE_BYTES, FP16_ALIGNED, ACC_DTYPE, DOT_DTYPE,
                                 UPCAST)  # fmt: skip
    for tile_start in range(num_full, num_keys, BLOCK_N):
        m, l, acc = _attend_tile(m, l, acc, tile_start, num_keys, position, q, q_lo, q_rows, is_row, d, r,
                                 block_tables_ptr, stride_bt_req, stride_cache_block, stride_cache_slot,
                                 cache_head_ptr, value_offset, centroids_ptr, scale_acc, True, BLOCK_N, BLOCK_SIZE,
                                 HEAD_DIM, KEY_ENC, KEY_BITS, KEY_CODE_BYTES, KEY_DIM_CHUNK, KEY_DIM_UNROLL,
                                 VALUE_ENC, VALUE_BITS, VALUE_CODE_BYTES, FP16_ALIGNED, ACC_DTYPE, DOT_DTYPE,
                                 UPCAST)  # fmt: skip
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    o_ptrs = out_ptr + token[:, None] * stride_o_tok + head[:, None] * stride_o_head + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _attend_tile(m, l, acc, tile_start, num_keys, position, q, q_lo, q_rows, is_row, d, r, block_tables_ptr,
                 stride_bt_req, stride_cache_block, stride_cache_slot, cache_head_ptr, value_offset, centroids_ptr,
                 scale_acc, MASKED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 HEAD_DIM: tl.constexpr, KEY_ENC: tl.constexpr, KEY_BITS: tl.constexpr, KEY_CODE_BYTES: tl.constexpr,
                 KEY_DIM_CHUNK: tl.constexpr, KEY_DIM_UNROLL: tl.constexpr, VALUE_ENC: tl.constexpr,
                 VALUE_BITS: tl.constexpr, VALUE_CODE_BYTES: tl.constexpr, FP16_ALIGNED: tl.constexpr,
                 ACC_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    """The online softmax over keys [tile_start, tile_start + BLOCK_N): (m, l, acc) after it. MASKED: the causal
    mask (a row sees keys up to its position); without it every row sees the whole tile (the caller's full tiles)."""
    n = tile_start + tl.arange(0, BLOCK_N)
    n_mask = n < num_keys
    slot_off, kv_mask = tile_slots(block_tables_ptr, r, stride_bt_req, n, n_mask, d, stride_cache_block,
                                   stride_cache_slot, BLOCK_SIZE, HEAD_DIM)  # fmt: skip
    s = tile_scores(q, q_lo, q_rows, is_row, cache_head_ptr, slot_off, d, n_mask, kv_mask, centroids_ptr,
                    KEY_ENC, KEY_BITS, KEY_CODE_BYTES, KEY_DIM_CHUNK, KEY_DIM_UNROLL, HEAD_DIM, FP16_ALIGNED,
                    ACC_DTYPE, DOT_DTYPE, UPCAST)  # fmt: skip
    if MASKED:  # noqa: SIM108 - a compile-time branch, as measured (BENCHMARKS.md, session 24)
        s = tl.where(n[None, :] <= position[:, None], s * scale_acc, float("-inf"))  # causal (and n < num_keys)
    else:
        s = s * scale_acc
    m_new, alpha, p, l = online_softmax_step(m, l, s)  # m_new finite: tile 0 holds key 0, which every row sees
    # one explicit fused multiply-add: left to the compiler, the masked and the unmasked build of this function could
    # contract it differently, and a key tile is masked or not by how the prompt was chunked (paged_attention.py)
    acc = tl.fma(acc, alpha[:, None], tile_pv(p, cache_head_ptr + value_offset, slot_off, d, n_mask, kv_mask,
                                              VALUE_ENC, VALUE_BITS, VALUE_CODE_BYTES, HEAD_DIM, FP16_ALIGNED,
                                              ACC_DTYPE, DOT_DTYPE, UPCAST))  # fmt: skip
    return m_new, l, acc


def prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    fmt: KVFormat | None = None,
    num_rows: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """Causal attention of q [T, num_heads, head_dim] over the paged ``kv_cache``, as ``paged_attention`` (or
    ``paged_attention_packed`` with ``fmt``, a packed kv_cache_dtype) computes it: query token i of request r
    sits at position ``seq_lens[r] - query_len + i``. ``num_rows`` [R] (device): only request r's first
    ``num_rows[r]`` query rows are computed (its prompt rows, kernels/step_attention.py); None: every row. Rows not
    computed, and rows past ``query_start_loc[-1]``, are left as they are in ``out`` (zeros if allocated here). No
    host read. Returns ``out``."""
    q_in, tiles = cache_tiles(q, kv_cache, fmt)
    out = torch.zeros_like(q) if out is None else out
    if num_rows is None:
        num_rows = query_start_loc[1:] - query_start_loc[:-1]
    return prefill_rows(q_in, tiles, query_start_loc, seq_lens, block_tables, num_rows, scale, out, config)


def prefill_rows(q: torch.Tensor, tiles: CacheTiles, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                 block_tables: torch.Tensor, num_rows: torch.Tensor, scale: float, out: torch.Tensor,
                 config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """The kernel over any cache (``prefill_attention`` and kernels/step_attention.py build ``tiles``): q as the
    kernel reads it (rotated for Lloyd-Max keys), ``out`` [T, num_heads, head_dim] in the model dtype; request r's
    first ``num_rows[r]`` rows are written, nothing else. The grid comes from shapes only (T, R): capturable in a
    CUDA graph, where programs past the step's tiles exit at once. ``config``: (BLOCK_M, BLOCK_N, warps, stages);
    None: ``launch_config``'s for this dtype and cache. Returns ``out``."""
    block_m, block_n, num_warps, num_stages = config or launch_config(out.dtype, tiles)
    if block_m < 1 or block_m & (block_m - 1) or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_m {block_m} and block_n {block_n} must be powers of two, block_n >= 16")
    num_tokens, num_heads, _ = q.shape
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return out
    group = num_heads // tiles.num_kv_heads
    if block_m * pad_pow2(group, 1) < 16:
        raise ValueError(f"block_m {block_m} x GQA group {group} must give >= 16 rows (tl.dot)")
    tiles_per_req = torch.div(num_rows + block_m - 1, block_m, rounding_mode="floor")
    tile_offsets = torch.cat([torch.zeros_like(tiles_per_req[:1]), torch.cumsum(tiles_per_req, 0)])
    # sum_r cdiv(num_rows[r], M) <= cdiv(T, M) + (requests with rows, at most min(R, T)): from shapes alone
    grid = (tiles.num_kv_heads, triton.cdiv(num_tokens, block_m) + min(num_reqs, num_tokens))
    _launch(grid, out, q, tiles, query_start_loc, seq_lens, block_tables, num_rows, tile_offsets, scale, group,
            block_m, block_n, num_warps, num_stages)  # fmt: skip
    return out


def _launch(grid: tuple[int, int], out: torch.Tensor, q: torch.Tensor, tiles: CacheTiles,
            query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
            num_rows: torch.Tensor, tile_offsets: torch.Tensor, scale: float, group: int, block_m: int, block_n: int,
            num_warps: int, num_stages: int) -> None:  # fmt: skip
    head_dim = q.shape[-1]
    _prefill_attention_kernel[grid](
        out, q, tiles.cache, tiles.centroids, query_start_loc, seq_lens, block_tables, num_rows, tile_offsets,
        seq_lens.shape[0], scale, q.stride(0), q.stride(1), out.stride(0), out.stride(1), tiles.value_offset,
        *tiles.strides, block_tables.stride(0),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=pad_pow2(head_dim), GROUP=group, GROUP_PAD=pad_pow2(group, 1),
        BLOCK_SIZE=tiles.block_size, BLOCK_M=block_m, BLOCK_N=block_n, ACC_DTYPE=tl_compute_dtype(out.dtype),
        DOT_DTYPE=dot_dtype(out.dtype), UPCAST=needs_dot_upcast(out.dtype), num_warps=num_warps, num_stages=num_stages,
        **tiles.encoding,
    )  # fmt: skip
