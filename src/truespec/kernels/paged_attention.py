"""Paged causal attention for every query row of a step (decode, verify and chunked prefill alike), split-KV.

Programs are (query token, kv head, split): each serves its kv head's GQA group of query heads (padded to 16
rows for ``tl.dot``) over one contiguous range of the row's keys, with online softmax in fp32 (fp64 for fp64),
and emits (m, l, acc). A second kernel (kernels/split_merge.py) merges a row's splits:
``m = max m_i; l = sum l_i e^(m_i - m); out = sum acc_i e^(m_i - m) / l``, acc summed over groups of MERGE_SPLITS
split slots in slot order, each group one fixed reduction tree. The same two kernels serve the model-dtype cache
(``paged_attention``) and the packed caches (kernels/paged_attention_packed.py): how a K / V tile is loaded or
decoded is a compile-time encoding (kernels/kv_tiles.py); the model-dtype loop compiles as before the packed
formats shared it (the same loads and ``tl.dot`` operand dtypes).

Split layout (kernels/split_merge.py): a row with ``num_keys`` keys (position + 1) uses ``split_size =
round_up(max(MIN_SPLIT_KEYS, cdiv(num_keys, MAX_SPLITS)), BLOCK_N)`` keys per split and ``num_splits =
cdiv(num_keys, split_size)`` (<= MAX_SPLITS) splits; that layout, the tiles each split walks
(BLOCK_N-aligned from its start) and the merge are functions of ``num_keys`` and the compile-time constants only,
never of the batch, T, the request's query length, the chunk or the other rows (docs/ARCHITECTURE.md invariant
4); the integers that do vary (num_reqs, the chunk's first row, the workspace stride) are not specialised on, so
every call runs one binary. A row thus gives bitwise the same output as a plain decode, as a row of a 1+k verify,
and inside a prefill chunk or a big mixed batch, as long as a model's calls keep one (block_n, max_splits,
min_split_keys, num_warps) and dtype (and the merge tile constants). A row with one split (``num_keys <=
MIN_SPLIT_KEYS``; every row with ``max_splits=1``) runs the unsplit loop (tiles 0, BLOCK_N, ... up to its
position) and writes ``acc / l`` itself; the merge skips it. Padding rows (token >= query_start_loc[num_reqs])
have 0 keys, one empty split, and write zeros.
Given ``num_prompt_rows`` (kernels/step_attention.py) both kernels skip request r's first ``num_prompt_rows[r]``
rows (its prompt rows, which the prefill kernel computes into the same output) and leave them untouched; the skip is
a runtime argument, not specialised, so every other row runs the same binary and loop with or without it (the
sm_90 PTX's floating-point instructions, MMAs included, are in the same order as before the skip existed).

Graph safety and bounded workspace: grids are (rows, kv heads, grid_splits) and (rows, heads, head_dim /
MERGE_DIM), where ``grid_splits = min(MAX_SPLITS, cdiv(block_tables.shape[1] * block_size,
round_up(MIN_SPLIT_KEYS, BLOCK_N)))`` bounds the splits any row can have from shapes alone (a graph's table has
its fixed width); programs past their row's ``num_splits`` exit at once. The workspace (m, l [rows, heads,
grid_splits] and acc [rows, heads, grid_splits, head_dim] in the accumulator dtype) holds
``max_workspace_bytes // bytes_per_row`` rows: the wrapper runs both kernels over fixed chunks of that many
tokens (chunking by the static T only), reusing one workspace in stream order. At T=8192, 64 heads of 128, 16
splits: 520 KiB a row, chunks of 252 rows, 128 MiB; at 64 splits 2 MiB a row, chunks of 63 rows.

Why split: measured on an H200 (bf16, block size 16, CUDA graph replay, Qwen3.5-0.8B shape: 8 q / 2 kv heads
of 256), us per call, this kernel with MAX_SPLITS 16 vs an unsplit one (one program per (token, kv head), 8
warps): BS=1 decode at 512 keys 7.7 vs 28, at 2048 keys 11 vs 106, at 8192 keys 28 vs 421; BS=1 1+3 verify at
512 keys ~7.5 vs 28; BS=32 decode at 512 keys 18 vs 30; BS=32 1+3 verify at 800 keys 70 vs 66 (enough rows
already: splitting only adds the merge and the partial writes); 64 keys (one split) 5.4 vs 5.4; a 2048-token
prefill 1064 vs 1192. A one-request 8192-token prefill with 64 heads of 128 takes 29.4 vs 24.2 ms (its fp32
partials, 0.5 MiB a row, are written and read back). max_splits 32 halved the 8192-key decode (17.5 us) for
+1 us at 512 keys (then from a merge tile as wide as the cap, now a loop that stops at the row's splits). At 2 kv
heads BS=1 fills only 2 * num_splits SMs: the gain comes from the shorter chain of dependent tiles per program,
which is what bounds the unsplit kernel, and the packed formats (unpacking and centroid gathers per element) need
the extra programs most: with 16 splits a 32K-key row reached 4-10% of copy bandwidth in bf16, and the TurboQuant
formats 0.13-0.67x of bf16's speed (issue 14). Defaults: BLOCK_N 32, MIN_SPLIT_KEYS 64 (splits of >= 2 tiles), 4
warps, and MAX_SPLITS 64 (a 32K-key row: 64 splits of 512 keys; rows up to 1,024 keys split as with 16): the cap's
timings at 64 and 128 are still to be measured (benchmarks/kv_decode_speed.py ``--max-splits 16 64 128``).

Sparse-V tile skip (``sparse_v_threshold``; vLLM PR #41422, /work/shared/DESIGN.md): after a tile's
``p = exp(s - m_new)`` and ``l = l * alpha + sum(p)``, a tile whose largest weight ``p / l`` over every query head
of the program is ``< threshold`` only rescales ``acc`` by ``alpha``: its V tile is neither loaded nor decoded;
``m`` and ``l`` are always updated, so the softmax denominator stays exact. The decision depends on the row's
own keys and the constants only, so a decode row and the same row inside a verify skip the same tiles
(invariant 4). ``SPARSE_V`` is a compile-time switch: off (``None``) compiles the loop without it; threshold 0
never skips (the comparison is strict) and gives the bits of off. The torch reference of this order is
``ops.attention.tiled_attention``.

Not done here (speed only, correctness does not need them):
- packing several query tokens of one request into a program's rows: the prefill kernel does it for prompt rows
  (kernels/step_attention.py); output positions re-prefilled after preemption still come here one row each.
- no GPU timing of the sparse-V skip yet, and no "auto" mode (on from a context length): the caller decides.
"""

import torch
import triton
import triton.language as tl

from truespec.kernels.kv_tiles import (
    ENC_UNIFORM,
    MODEL,
    CacheTiles,
    online_softmax_step,
    tile_pv,
    tile_queries,
    tile_scores,
    tile_slots,
)
from truespec.kernels.split_merge import combine_splits_kernel, merge_grid_and_tile, prompt_row, row_layout
from truespec.kernels.triton_utils import needs_dot_upcast, pad_pow2, reduce_max, tl_compute_dtype
from truespec.ops.attention import BLOCK_N, MAX_SPLITS, MIN_SPLIT_KEYS

NUM_WARPS = 4  # BLOCK_N, MAX_SPLITS, MIN_SPLIT_KEYS: ops/attention.py (module docstring: what was tuned, what not)
MAX_WORKSPACE_BYTES = 128 << 20
# The merge kernel's tile: split slots per step of its loop x output dims per program (and its warps). Like
# NUM_WARPS they fix a row's bits (its reduction tree), so they are constants; not yet tuned on a GPU.
MERGE_SPLITS, MERGE_DIM, MERGE_WARPS = 16, 64, 4
_TL_16BIT = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


# One binary for every batch, chunk and (eager) block-table width: integer arguments that vary are not specialised.
@triton.jit(do_not_specialize=["num_reqs", "row_offset", "ws_splits", "stride_bt_req", "sparse_v_min_keys",
                               "skip_prompt_rows"])
def _paged_attention_kernel(
    out_ptr,  # [T, num_heads, head_dim]
    ws_m_ptr,  # [chunk, num_heads, ws_splits] running max per split
    ws_l_ptr,  # [chunk, num_heads, ws_splits] sum of exp(score - m) per split
    ws_acc_ptr,  # [chunk, num_heads, ws_splits, HEAD_DIM] unnormalised output per split
    q_ptr,  # [T, num_heads, head_dim] (rotated, in the accumulator dtype, for LLOYD_MAX keys)
    kv_cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim], or uint8 [num_blocks, ..., bytes]
    centroids_ptr,  # [2^KEY_BITS] Lloyd-Max centroids in the accumulator dtype (LLOYD_MAX keys only)
    query_start_loc_ptr,  # [R + 1]
    seq_lens_ptr,  # [R]
    block_tables_ptr,  # [R, max_blocks]
    num_prompt_rows_ptr,  # [R] leading rows of each request left to the prefill kernel (read with skip_prompt_rows)
    num_reqs,
    row_offset,  # first token of this chunk
    ws_splits,  # split slots per (row, head) in the workspace (the grid's third dim)
    skip_prompt_rows,  # 0 / 1, not specialised: one binary computes a row's bits either way
    scale: tl.float64,
    sparse_v_threshold: tl.float64,  # read with SPARSE_V only
    sparse_v_min_keys,  # SPARSE_V: only rows with at least this many keys skip (the "auto" mode's context gate)
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    value_offset,  # from a slot's key to its value (CacheTiles)
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_bt_req,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # KV cache block size (tokens per block)
    BLOCK_N: tl.constexpr,  # keys per tile
    MAX_SPLITS: tl.constexpr,
    MIN_SPLIT_KEYS: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # 16-bit models: the tensor cores' operand dtype for decoded tiles; else ACC_DTYPE
    UPCAST: tl.constexpr,
    KEY_ENC: tl.constexpr,  # kernels/kv_tiles.py encodings
    KEY_BITS: tl.constexpr,
    KEY_CODE_BYTES: tl.constexpr,
    KEY_DIM_CHUNK: tl.constexpr,  # Lloyd-Max keys: head dims decoded and scored at a time (HEAD_DIM_PAD: all)
    KEY_DIM_UNROLL: tl.constexpr,  # ... in an unrolled loop over the chunks, else a runtime one
    VALUE_ENC: tl.constexpr,
    VALUE_BITS: tl.constexpr,
    VALUE_CODE_BYTES: tl.constexpr,
    FP16_ALIGNED: tl.constexpr,  # every fp16 field of a packed slot at an even byte address
    SPARSE_V: tl.constexpr,  # skip the values of tiles whose weights are all < sparse_v_threshold
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    token = row_offset + row
    r, num_keys, split_size, num_splits = row_layout(query_start_loc_ptr, seq_lens_ptr, num_reqs, token, BLOCK_N,
                                                     MAX_SPLITS, MIN_SPLIT_KEYS)  # fmt: skip
    is_prompt_row = prompt_row(query_start_loc_ptr, num_prompt_rows_ptr, skip_prompt_rows, r, token)
    if (split >= num_splits) | is_prompt_row:  # past the row's splits, or the prefill kernel's row: nothing to do
        return
    key_start = split * split_size
    key_end = tl.minimum(key_start + split_size, num_keys)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * GROUP + g
    q_mask = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
    q_rows = q_ptr + token * stride_q_tok + heads * stride_q_head  # [GROUP_PAD]
    q = tl.load(q_rows[:, None] + d[None, :], mask=q_mask, other=0.0)
    q, q_lo = tile_queries(q, KEY_ENC, ACC_DTYPE, DOT_DTYPE)  # as tile_scores reads it
    scale_acc = tl.full([], scale, ACC_DTYPE)
    threshold = tl.full([], sparse_v_threshold, ACC_DTYPE)

    m = tl.full([GROUP_PAD], float("-inf"), ACC_DTYPE)  # running max of the scaled scores
    l = tl.full([GROUP_PAD], 0, ACC_DTYPE)  # running sum of exp(score - m)
    # 4-bit uniform values at power-of-two head dims: the output as its even and odd head dims [GROUP_PAD, D / 2, 2],
    # each a product of its own nibble plane (kv_tiles.tile_pv, PLANES): no interleave of codes per tile
    VALUE_PLANES: tl.constexpr = (VALUE_ENC == ENC_UNIFORM) & (VALUE_BITS == 4) & (HEAD_DIM == HEAD_DIM_PAD)
    if VALUE_PLANES:
        acc = tl.full([GROUP_PAD, HEAD_DIM_PAD // 2, 2], 0, ACC_DTYPE)
    else:
        acc = tl.full([GROUP_PAD, HEAD_DIM_PAD], 0, ACC_DTYPE)
    cache_head_ptr = kv_cache_ptr + kv_head * stride_cache_head
    for tile_start in range(key_start, key_end, BLOCK_N):
        n = tile_start + tl.arange(0, BLOCK_N)
        n_mask = n < key_end
        slot_off, kv_mask = tile_slots(block_tables_ptr, r, stride_bt_req, n, n_mask, d, stride_cache_block,
                                       stride_cache_slot, BLOCK_SIZE, HEAD_DIM)  # fmt: skip
        s = tile_scores(q, q_lo, q_rows, g < GROUP, cache_head_ptr, slot_off, d, n_mask, kv_mask, centroids_ptr,
                        KEY_ENC, KEY_BITS, KEY_CODE_BYTES, KEY_DIM_CHUNK, KEY_DIM_UNROLL, HEAD_DIM, FP16_ALIGNED,
                        ACC_DTYPE, DOT_DTYPE, UPCAST)  # fmt: skip
        s = s * scale_acc  # [GROUP_PAD, BLOCK_N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new, alpha, p, l = online_softmax_step(m, l, s)  # m_new finite: every tile holds a key of this split
        alpha_rows = alpha[:, None, None] if VALUE_PLANES else alpha[:, None]  # broadcast over acc's dims
        value_ptr = cache_head_ptr + value_offset
        # acc * alpha + pv as one explicit fused multiply-add in both variants: left to the compiler, the product
        # was contracted into the add without SPARSE_V but not with it (measured on an H200: threshold 0 differed
        # from off for 4-bit Lloyd-Max keys at 4 query rows)
        if SPARSE_V:
            # the tile's largest weight p / l over the program's query heads (the GQA padding rows excluded)
            weight = reduce_max(tl.where(g < GROUP, reduce_max(p, 1) / l, 0.0), 0)
            if (weight < threshold) & (num_keys >= sparse_v_min_keys):  # strict: threshold 0 never skips
                acc = acc * alpha_rows
            else:
                acc = tl.fma(acc, alpha_rows, tile_pv(p, value_ptr, slot_off, d, n_mask, kv_mask, VALUE_ENC,
                                                      VALUE_BITS, VALUE_CODE_BYTES, HEAD_DIM, FP16_ALIGNED,
                                                      ACC_DTYPE, DOT_DTYPE, UPCAST, VALUE_PLANES))  # fmt: skip
        else:
            acc = tl.fma(acc, alpha_rows, tile_pv(p, value_ptr, slot_off, d, n_mask, kv_mask, VALUE_ENC, VALUE_BITS,
                                                  VALUE_CODE_BYTES, HEAD_DIM, FP16_ALIGNED, ACC_DTYPE, DOT_DTYPE,
                                                  UPCAST, VALUE_PLANES))  # fmt: skip
        m = m_new

    if VALUE_PLANES:  # acc's [GROUP_PAD, D / 2, 2] element (g, i, c) is head dim 2 i + c
        dims = 2 * tl.arange(0, HEAD_DIM_PAD // 2)[None, :, None] + tl.arange(0, 2)[None, None, :]
        rows = g[:, None, None]
    else:
        dims = d[None, :]
        rows = g[:, None]
    out_mask = (rows < GROUP) & (dims < HEAD_DIM)
    if num_splits == 1:  # the unsplit loop: normalise and write the output here
        l_rows = l[:, None, None] if VALUE_PLANES else l[:, None]
        out = acc / tl.where(l_rows > 0, l_rows, 1.0)  # padding rows: acc = 0, l = 0 -> 0
        o_ptrs = out_ptr + token * stride_o_tok + (kv_head * GROUP + rows) * stride_o_head + dims
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        ws_row = (row * GROUP * tl.num_programs(1) + heads) * ws_splits + split  # [GROUP_PAD] into m / l
        tl.store(ws_m_ptr + ws_row, m, mask=g < GROUP)
        tl.store(ws_l_ptr + ws_row, l, mask=g < GROUP)
        ws_rows = ((row * GROUP * tl.num_programs(1) + kv_head * GROUP + rows) * ws_splits + split) * HEAD_DIM
        tl.store(ws_acc_ptr + ws_rows + dims, acc, mask=out_mask)


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    block_n: int = BLOCK_N,
    max_splits: int = MAX_SPLITS,
    min_split_keys: int = MIN_SPLIT_KEYS,
    num_warps: int = NUM_WARPS,
    max_workspace_bytes: int = MAX_WORKSPACE_BYTES,
    sparse_v_threshold: float | None = None,
    sparse_v_min_keys: int = 0,
) -> torch.Tensor:
    """Causal attention of q [T, num_heads, head_dim] over the paged ``kv_cache``
    [2, num_blocks, block_size, num_kv_heads, head_dim]; query token i of request r sits at position
    ``seq_lens[r] - query_len + i``. Rows past ``query_start_loc[-1]`` (padding) come back as zeros.
    No host sync and no shape derived from the batch content: safe inside a captured CUDA graph.
    ``block_n``, ``max_splits``, ``min_split_keys`` and ``num_warps`` fix each row's arithmetic: keep them the
    same for every call of a model (invariant 4); ``max_splits=1`` is the unsplit kernel. The workspace (and
    so the number of row chunks) follows ``max_workspace_bytes``, which never changes a row's result.
    ``sparse_v_threshold``: None runs without the sparse-V tile skip; a float in [0, 1] skips the values of a tile
    whose weights p / l are all below it (0 skips nothing and gives the same bits as None; see the module
    docstring); ``sparse_v_min_keys``: only rows with at least this many keys skip (sparse_v="auto").
    Returns ``out`` [T, num_heads, head_dim] (allocated if None)."""
    tiles = model_cache_tiles(q, kv_cache)
    out = torch.empty_like(q) if out is None else out
    return split_attention(q, tiles, query_start_loc, seq_lens, block_tables, scale, out, block_n, max_splits,
                           min_split_keys, num_warps, max_workspace_bytes, sparse_v_threshold,
                           sparse_v_min_keys)  # fmt: skip


def model_cache_tiles(q: torch.Tensor, kv_cache: torch.Tensor) -> CacheTiles:
    """How the kernels read a model-dtype ``kv_cache`` [2, num_blocks, block_size, num_kv_heads, head_dim] for q
    [T, num_heads, head_dim]; a ValueError if the two do not fit."""
    _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    if cache_head_dim != q.shape[-1] or q.shape[1] % num_kv_heads != 0 or q.stride(-1) != 1:
        raise ValueError(f"q {tuple(q.shape)} (unit last stride) does not fit kv_cache {tuple(kv_cache.shape)}")
    if kv_cache.stride(-1) != 1 or q.dtype != kv_cache.dtype:
        raise ValueError("kv_cache needs a unit last stride and q's dtype")
    return CacheTiles(kv_cache, block_size, num_kv_heads, (kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3)),
                      kv_cache.stride(0), kv_cache, dict(KEY_ENC=MODEL, KEY_BITS=0, KEY_CODE_BYTES=0,
                                                         KEY_DIM_CHUNK=pad_pow2(q.shape[-1]), KEY_DIM_UNROLL=True,
                                                         VALUE_ENC=MODEL, VALUE_BITS=0, VALUE_CODE_BYTES=0,
                                                         FP16_ALIGNED=False), NUM_WARPS)  # fmt: skip


def dot_dtype(out_dtype: torch.dtype) -> tl.dtype:
    """The MMA operand dtype of decoded tiles: the model dtype for 16-bit models (tensor cores), else the
    accumulator dtype (IEEE fp32 / fp64 products)."""
    return _TL_16BIT.get(out_dtype, tl_compute_dtype(out_dtype))


def split_attention(
    q: torch.Tensor,
    tiles: CacheTiles,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    block_n: int,
    max_splits: int,
    min_split_keys: int,
    num_warps: int,
    max_workspace_bytes: int,
    sparse_v_threshold: float | None,
    sparse_v_min_keys: int = 0,
    num_prompt_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Both kernels over any cache (``paged_attention`` and ``paged_attention_packed`` check their cache and build
    ``tiles``): q [T, num_heads, head_dim] as the kernel reads it, ``out`` in the model dtype (the accumulator
    dtype follows it). ``num_prompt_rows`` [R] (device): request r's first ``num_prompt_rows[r]`` rows are skipped,
    left as they are in ``out`` for the prefill kernel (kernels/step_attention.py); None computes every row.
    Returns ``out``."""
    num_tokens, num_heads, head_dim = q.shape
    if block_n < 16 or block_n & (block_n - 1) or max_splits < 1 or min_split_keys < 1:
        raise ValueError(f"block_n {block_n} must be a power of two >= 16; max_splits, min_split_keys >= 1")
    if not 0 < max_workspace_bytes < 2**31:
        raise ValueError(f"max_workspace_bytes {max_workspace_bytes} must be in (0, 2**31): int32 offsets")
    if sparse_v_threshold is not None and not 0.0 <= sparse_v_threshold <= 1.0:
        raise ValueError(f"sparse_v_threshold must be None or in [0, 1], got {sparse_v_threshold}")
    if out.shape != q.shape:
        raise ValueError(f"out {tuple(out.shape)} does not fit q {tuple(q.shape)}")
    if seq_lens.shape[0] == 0:
        return out.zero_()
    if num_tokens == 0:
        return out
    group = num_heads // tiles.num_kv_heads
    constants = dict(HEAD_DIM=head_dim, BLOCK_N=block_n, MAX_SPLITS=max_splits, MIN_SPLIT_KEYS=min_split_keys)
    # A row holds at most width * block_size keys (its table's cells) and a split at least
    # round_up(min_split_keys, block_n) of them: fewer split programs when the table is narrow, from shapes only.
    grid_splits = min(max_splits, max(1, triton.cdiv(block_tables.shape[1] * tiles.block_size,
                                                     triton.cdiv(min_split_keys, block_n) * block_n)))  # fmt: skip
    acc_dtype = torch.float64 if out.dtype == torch.float64 else torch.float32
    bytes_per_row = num_heads * grid_splits * (head_dim + 2) * acc_dtype.itemsize
    chunk = num_tokens if grid_splits == 1 else min(num_tokens, max(1, max_workspace_bytes // bytes_per_row))
    ws_rows = 1 if grid_splits == 1 else chunk  # one split: the first kernel writes out itself
    ws_m = torch.empty(ws_rows, num_heads, grid_splits, dtype=acc_dtype, device=q.device)
    ws_l = torch.empty_like(ws_m)
    ws_acc = torch.empty(ws_rows, num_heads, grid_splits, head_dim, dtype=acc_dtype, device=q.device)
    num_reqs = seq_lens.shape[0]
    threshold = 0.0 if sparse_v_threshold is None else sparse_v_threshold
    skip = int(num_prompt_rows is not None)
    prompt_rows = query_start_loc if num_prompt_rows is None else num_prompt_rows  # unread without skip
    for row_offset in range(0, num_tokens, chunk):  # by the static T only: graph-safe
        rows = min(chunk, num_tokens - row_offset)
        _paged_attention_kernel[(rows, tiles.num_kv_heads, grid_splits)](
            out, ws_m, ws_l, ws_acc, q, tiles.cache, tiles.centroids, query_start_loc, seq_lens, block_tables,
            prompt_rows, num_reqs, row_offset, grid_splits, skip, scale, threshold, sparse_v_min_keys, q.stride(0),
            q.stride(1), out.stride(0), out.stride(1), tiles.value_offset, *tiles.strides, block_tables.stride(0),
            GROUP=group, GROUP_PAD=pad_pow2(group), BLOCK_SIZE=tiles.block_size, ACC_DTYPE=tl_compute_dtype(out.dtype),
            DOT_DTYPE=dot_dtype(out.dtype), UPCAST=needs_dot_upcast(out.dtype), SPARSE_V=sparse_v_threshold is not None,
            HEAD_DIM_PAD=pad_pow2(head_dim), num_warps=num_warps,
            **tiles.encoding, **constants,
        )  # fmt: skip
        if grid_splits > 1:
            grid, tile = merge_grid_and_tile(rows, num_heads, head_dim, max_splits, MERGE_SPLITS, MERGE_DIM)
            combine_splits_kernel[grid](
                out, ws_m, ws_l, ws_acc, query_start_loc, seq_lens, prompt_rows, num_reqs, row_offset, grid_splits,
                skip, out.stride(0), out.stride(1), num_warps=MERGE_WARPS, **tile, **constants,
            )  # fmt: skip
    return out
