"""How the attention kernels (kernels/paged_attention.py, kernels/prefill_attention.py) read one tile of keys or
values from their cache, and the online-softmax step they share.

A tile is BLOCK_N cache slots of one KV head, given as their offsets [BLOCK_N] from the head's base pointer.
The encoding of keys and of values is a compile-time constant, so each cache dtype compiles to its own loop:

- ``MODEL``: the model-dtype cache; a slot's K is HEAD_DIM elements, its V sits ``value_offset`` elements on (the
  K / V plane stride). Scores are ``q . k`` in the model dtype on the tensor cores (fp32 accumulation), exactly as
  before the packed formats shared this loop.
- ``FP8`` keys / values: HEAD_DIM float8_e4m3fn bytes, widened exactly (scale 1.0, as the reference).
- ``LLOYD_MAX`` keys (``turboquant_*_nc``): the wrapper rotates q once (q @ H); the tile's codes are unpacked from
  the little-endian bit stream (kernels/packed_codes.py ``tile_codes``), each code's centroid looked up
  (kernels/code_operands.py: byte permutes on the GPU, a select tree elsewhere), and the score is
  ``<q_rot, c> * scale``, the key's stored scale (||k|| / ||c||: the norm correction, applied when the key was
  stored): keys are never rotated back.
- ``UNIFORM`` values: codes unpacked the same way, ``v = code * scale + zero`` (fp16 scale / zero).

``KEY_DIM_CHUNK`` (compile-time, Lloyd-Max keys only; paged_attention_packed.py ``key_dim_chunk``): the default,
HEAD_DIM_PAD, decodes and scores a key tile's whole head at once (int32 codes and centroids, [BLOCK_N, HEAD_DIM_PAD],
live together); a smaller power of two >= 16 walks the head dims in chunks of
that many, re-reading the rotated q's columns from memory each time, to bound the registers a tile needs (issue 14:
the suspected cause of the Lloyd-Max presets' slowness at head_dim 256). ``KEY_DIM_UNROLL`` picks the chunk loop's
form: unrolled (``tl.static_range``: the compiler may still hoist later chunks' loads) or a runtime loop (one chunk
at a time; ptxas for sm_90 also reports 2-6x less shared memory than unrolled). The chunked sum runs in another
order, so it gives other bits; like BLOCK_N and the warps both are per-model constants, never chosen by the batch
(invariant 4), and untuned (benchmarks/packed_attention_tune.py sweeps them).

Packed slots are read field by field by kernels/packed_codes.py; decoded tiles are never written back. For 16-bit
models (DOT_DTYPE bf16 / fp16) every product runs on the tensor cores with operands that are exact in 16 bits (fp8
bytes, value codes, Lloyd-Max centroids) or split in two 16-bit halves (the rotated q); fp32 and fp64 models
decode tiles in the accumulator dtype and multiply in IEEE fp32 / fp64 (``DOT_DTYPE`` is then the accumulator
dtype).
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from truespec.kernels.code_operands import centroid_operands, centroid_values, code_floats, value_code_operands
from truespec.kernels.packed_codes import load_fp8, load_fp16, tile_codes
from truespec.kernels.triton_utils import mma, reduce_max, reduce_sum

MODEL, FP8, LLOYD_MAX, UNIFORM = 0, 1, 2, 3  # tile encodings (KEY_ENC / VALUE_ENC), as the host passes them
# the same, readable inside @triton.jit code (compiled kernels may read only constexpr globals)
ENC_MODEL, ENC_FP8, ENC_LLOYD_MAX = tl.constexpr(MODEL), tl.constexpr(FP8), tl.constexpr(LLOYD_MAX)
ENC_UNIFORM = tl.constexpr(UNIFORM)


class CacheTiles(NamedTuple):
    """How the kernel reads a cache: the tensor, its geometry (in elements; bytes for a packed uint8 cache) and
    the tile encodings of kernels/kv_tiles.py."""

    cache: torch.Tensor
    block_size: int
    num_kv_heads: int
    strides: tuple[int, int, int]  # block, slot, kv head
    value_offset: int  # from a slot's key to its value: the K / V plane stride, or a packed slot's key bytes
    centroids: torch.Tensor  # Lloyd-Max centroid table in the accumulator dtype (unread for other keys)
    encoding: dict[str, int]  # KEY_ENC, KEY_BITS, KEY_CODE_BYTES, KEY_DIM_CHUNK, KEY_DIM_UNROLL, VALUE_ENC,
    # VALUE_BITS, VALUE_CODE_BYTES, FP16_ALIGNED
    num_warps: int  # the split kernel's warps for this cache: a per-format constant (it fixes a row's bits)


@triton.jit
def tile_slots(block_tables_ptr, r, stride_bt_req, n, n_mask, d, stride_cache_block, stride_cache_slot,
               BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):  # fmt: skip
    """Where request ``r``'s keys ``n`` [BLOCK_N] sit in the paged cache: their slot offsets [BLOCK_N] from a kv
    head's base (elements; bytes for a packed cache) and the [BLOCK_N, HEAD_DIM_PAD] mask of the tile's live
    elements (keys in ``n_mask``, dims below HEAD_DIM)."""
    blocks = tl.load(block_tables_ptr + r * stride_bt_req + n // BLOCK_SIZE, mask=n_mask, other=0)
    slot_off = blocks * stride_cache_block + (n % BLOCK_SIZE) * stride_cache_slot  # int64
    return slot_off, n_mask[:, None] & (d[None, :] < HEAD_DIM)


@triton.jit
def online_softmax_step(m, l, s):
    """One tile of the online softmax: scaled scores ``s`` [rows, BLOCK_N] (-inf where masked; every row holds a
    finite one somewhere before or in this tile) against the running max ``m`` and sum ``l`` [rows]. Returns the
    new max, ``alpha`` = exp(m - m_new) that rescales what was accumulated, the weights p = exp(s - m_new) and the
    new sum."""
    m_new = tl.maximum(m, reduce_max(s, 1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    return m_new, alpha, p, l * alpha + reduce_sum(p, 1)


@triton.jit
def split_hi_lo(x, DOT_DTYPE: tl.constexpr):
    """fp32 x as hi + lo, both in the 16-bit DOT_DTYPE (hi = x rounded, lo = the rest rounded): two 16-bit MMA
    operands that carry ~16 (bf16) or ~22 (fp16) significant bits of x together."""
    hi = x.to(DOT_DTYPE)
    return hi, (x - hi.to(tl.float32)).to(DOT_DTYPE)


@triton.jit
def tile_queries(q, KEY_ENC: tl.constexpr, ACC_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """The query tile as ``tile_scores`` reads it, as (main, lo): the model dtype for MODEL and FP8 keys on the
    tensor cores (lo unused); for LLOYD_MAX keys on the tensor cores the fp32 rotated q split by ``split_hi_lo``;
    without tensor cores (DOT_DTYPE is the accumulator dtype) q in the accumulator dtype (lo unused)."""
    if KEY_ENC == ENC_MODEL:
        return q, q
    elif DOT_DTYPE == ACC_DTYPE:
        q = q.to(ACC_DTYPE)
        return q, q
    elif KEY_ENC == ENC_FP8:
        q = q.to(DOT_DTYPE)
        return q, q
    else:
        return split_hi_lo(q.to(tl.float32), DOT_DTYPE)


@triton.jit
def tile_scores(q, q_lo, q_rows, q_row_mask, head_ptr, slot_off, d, n_mask, kv_mask, centroids_ptr,
                KEY_ENC: tl.constexpr, KEY_BITS: tl.constexpr, KEY_CODE_BYTES: tl.constexpr,
                KEY_DIM_CHUNK: tl.constexpr, KEY_DIM_UNROLL: tl.constexpr, HEAD_DIM: tl.constexpr,
                FP16_ALIGNED: tl.constexpr, ACC_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr,
                UPCAST: tl.constexpr):  # fmt: skip
    """Unscaled scores [GROUP_PAD, BLOCK_N] of (q, q_lo) [GROUP_PAD, HEAD_DIM_PAD] (``tile_queries``) against the
    keys of the tile's slots, which start ``slot_off`` [BLOCK_N] elements (bytes for a packed cache) past
    ``head_ptr``. On the tensor cores (DOT_DTYPE 16-bit): fp8 keys widen exactly to DOT_DTYPE; Lloyd-Max centroids
    are exact 16-bit operands (``lloyd_max_products``). Lloyd-Max keys with KEY_DIM_CHUNK below HEAD_DIM_PAD take
    ``chunked_lloyd_max_scores``, which reads the query rows from memory (``q_rows``: each row's pointer to its
    dim 0, live where ``q_row_mask``)."""
    if KEY_ENC == ENC_MODEL:
        k = tl.load(head_ptr + (slot_off[:, None] + d[None, :]), mask=kv_mask, other=0.0)  # [BLOCK_N, HEAD_DIM_PAD]
        s = mma(q, tl.trans(k), UPCAST)
    elif KEY_ENC == ENC_FP8:
        k = load_fp8(head_ptr + (slot_off[:, None] + d[None, :]), kv_mask).to(q.dtype)
        s = mma(q, tl.trans(k), UPCAST)
    elif d.shape[0] > KEY_DIM_CHUNK:  # Lloyd-Max keys, a chunk of the head dims at a time
        s = chunked_lloyd_max_scores(q_rows, q_row_mask, head_ptr + slot_off, n_mask, centroids_ptr, KEY_BITS,
                                     KEY_CODE_BYTES, KEY_DIM_CHUNK, KEY_DIM_UNROLL, HEAD_DIM, FP16_ALIGNED, ACC_DTYPE,
                                     DOT_DTYPE, UPCAST)  # fmt: skip
    else:  # Lloyd-Max keys, the whole head at once
        slot_ptr = head_ptr + slot_off  # [BLOCK_N]
        codes = tile_codes(slot_ptr, n_mask, d, kv_mask, KEY_BITS, KEY_CODE_BYTES, HEAD_DIM)
        # masked keys and padded dims read code 0 (a nonzero centroid): their score is replaced by -inf (the
        # caller's key mask), and q is 0 on padded dims
        c = lloyd_max_centroids(codes, centroids_ptr, KEY_BITS, ACC_DTYPE, DOT_DTYPE)  # [BLOCK_N, HEAD_DIM_PAD]
        s = lloyd_max_products(q, q_lo, c, None, ACC_DTYPE, DOT_DTYPE, UPCAST)
        s = s * key_scales(slot_ptr, n_mask, KEY_CODE_BYTES, FP16_ALIGNED, ACC_DTYPE)[None, :]
    return s


@triton.jit
def key_scales(slot_ptr, n_mask, KEY_CODE_BYTES: tl.constexpr, FP16_ALIGNED: tl.constexpr, ACC_DTYPE: tl.constexpr):
    """The stored scale [BLOCK_N] of Lloyd-Max keys (||k|| / ||c||: the fp16 after each slot's KEY_CODE_BYTES code
    bytes) in the accumulator dtype; masked keys: 0."""
    return load_fp16(slot_ptr + KEY_CODE_BYTES, n_mask, FP16_ALIGNED).to(ACC_DTYPE)


@triton.jit
def lloyd_max_centroids(codes, centroids_ptr, BITS: tl.constexpr, ACC_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """The centroids of ``codes`` as ``lloyd_max_products`` multiplies them: 16-bit tensor-core operands
    (kernels/code_operands.py ``centroid_operands``) when DOT_DTYPE is 16-bit, else in the accumulator dtype."""
    if DOT_DTYPE == ACC_DTYPE:
        return centroid_values(codes, centroids_ptr, BITS)
    return centroid_operands(codes, centroids_ptr, BITS, DOT_DTYPE)


@triton.jit
def lloyd_max_products(q, q_lo, c, acc, ACC_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, UPCAST: tl.constexpr):
    """``acc`` (None: 0) + q_rot @ c^T for centroids c [BLOCK_N, dims] (``lloyd_max_centroids``). On the tensor cores
    c is an exact 16-bit operand (the codebook's values are bf16 numbers, ops/lloyd_max.py) and q_rot its two 16-bit
    halves q + q_lo (``split_hi_lo``): two MMAs; without tensor cores q is q_rot (q_lo unused) and one product in the
    accumulator dtype."""
    if DOT_DTYPE == ACC_DTYPE:
        return mma(q, tl.trans(c), False, acc)
    c16 = tl.trans(c)
    return mma(q_lo, c16, UPCAST, mma(q, c16, UPCAST, acc))


@triton.jit
def chunked_lloyd_max_scores(q_rows, q_row_mask, slot_ptr, n_mask, centroids_ptr, KEY_BITS: tl.constexpr,
                             KEY_CODE_BYTES: tl.constexpr, KEY_DIM_CHUNK: tl.constexpr, KEY_DIM_UNROLL: tl.constexpr,
                             HEAD_DIM: tl.constexpr, FP16_ALIGNED: tl.constexpr, ACC_DTYPE: tl.constexpr,
                             DOT_DTYPE: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    """``tile_scores`` of Lloyd-Max keys whose bit streams start at ``slot_ptr`` [BLOCK_N], the head dims taken
    KEY_DIM_CHUNK at a time (``lloyd_max_chunk``): unrolled (KEY_DIM_UNROLL: the compiler may overlap the chunks'
    loads) or a runtime loop (only one chunk's codes and centroids can be live). The products of every chunk
    accumulate in chunk order: the same sum as the whole-head path, in another order, so other bits."""
    s = tl.full([q_rows.shape[0], n_mask.shape[0]], 0, ACC_DTYPE)
    if KEY_DIM_UNROLL:
        for dim_start in tl.static_range(0, HEAD_DIM, KEY_DIM_CHUNK):
            s = lloyd_max_chunk(s, dim_start, q_rows, q_row_mask, slot_ptr, n_mask, centroids_ptr, KEY_BITS,
                                KEY_CODE_BYTES, KEY_DIM_CHUNK, HEAD_DIM, ACC_DTYPE, DOT_DTYPE, UPCAST)  # fmt: skip
    else:
        for dim_start in range(0, HEAD_DIM, KEY_DIM_CHUNK):
            s = lloyd_max_chunk(s, dim_start, q_rows, q_row_mask, slot_ptr, n_mask, centroids_ptr, KEY_BITS,
                                KEY_CODE_BYTES, KEY_DIM_CHUNK, HEAD_DIM, ACC_DTYPE, DOT_DTYPE, UPCAST)  # fmt: skip
    return s * key_scales(slot_ptr, n_mask, KEY_CODE_BYTES, FP16_ALIGNED, ACC_DTYPE)[None, :]


@triton.jit
def lloyd_max_chunk(s, dim_start, q_rows, q_row_mask, slot_ptr, n_mask, centroids_ptr, KEY_BITS: tl.constexpr,
                    KEY_CODE_BYTES: tl.constexpr, KEY_DIM_CHUNK: tl.constexpr, HEAD_DIM: tl.constexpr,
                    ACC_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    """s plus head dims dim_start .. + KEY_DIM_CHUNK: the query columns loaded from ``q_rows`` (a few KiB,
    cache-resident) and split as ``tile_queries`` does, the keys' centroids [BLOCK_N, KEY_DIM_CHUNK] decoded and
    multiplied by ``lloyd_max_products``."""
    d = dim_start + tl.arange(0, KEY_DIM_CHUNK)
    q = tl.load(q_rows[:, None] + d[None, :], mask=q_row_mask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    q, q_lo = tile_queries(q, ENC_LLOYD_MAX, ACC_DTYPE, DOT_DTYPE)
    kv_mask = n_mask[:, None] & (d[None, :] < HEAD_DIM)
    codes = tile_codes(slot_ptr, n_mask, d, kv_mask, KEY_BITS, KEY_CODE_BYTES, HEAD_DIM, dim_start)
    return lloyd_max_products(q, q_lo, lloyd_max_centroids(codes, centroids_ptr, KEY_BITS, ACC_DTYPE, DOT_DTYPE), s,
                              ACC_DTYPE, DOT_DTYPE, UPCAST)  # fmt: skip


@triton.jit
def tile_pv(p, value_ptr, slot_off, d, n_mask, kv_mask, VALUE_ENC: tl.constexpr, VALUE_BITS: tl.constexpr,
            VALUE_CODE_BYTES: tl.constexpr, HEAD_DIM: tl.constexpr, FP16_ALIGNED: tl.constexpr,
            ACC_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, UPCAST: tl.constexpr,
            PLANES: tl.constexpr = False):  # fmt: skip
    """p [GROUP_PAD, BLOCK_N] (accumulator dtype) @ the values [BLOCK_N, HEAD_DIM_PAD] of the tile's slots, whose
    value parts start ``slot_off`` [BLOCK_N] past ``value_ptr``; with PLANES (4-bit uniform values, HEAD_DIM a power
    of two) as [GROUP_PAD, HEAD_DIM / 2, 2], even and odd head dims (``uniform_planes_pv``). MODEL and FP8 values: p
    cast to the values' dtype (fp8 widened exactly to DOT_DTYPE) and one MMA. UNIFORM values ``code * scale + zero``
    per slot: on the tensor cores ``(p * scale) @ codes + (p . zero)`` (codes are exact in 16 bits), else decoded in
    the accumulator dtype (masked lanes 0)."""
    v_ptrs = value_ptr + (slot_off[:, None] + d[None, :])
    if VALUE_ENC == ENC_MODEL:
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        return mma(p.to(v.dtype), v, UPCAST)
    elif VALUE_ENC == ENC_FP8:
        v = load_fp8(v_ptrs, kv_mask).to(DOT_DTYPE)
        return mma(p.to(DOT_DTYPE), v, UPCAST)
    else:
        slot_ptr = value_ptr + slot_off  # [BLOCK_N]
        v_scale = load_fp16(slot_ptr + VALUE_CODE_BYTES, n_mask, FP16_ALIGNED).to(ACC_DTYPE)
        v_zero = load_fp16(slot_ptr + VALUE_CODE_BYTES + 2, n_mask, FP16_ALIGNED).to(ACC_DTYPE)
        if PLANES:
            pv = uniform_planes_pv(p, slot_ptr, n_mask, v_scale, v_zero, d.shape[0] // 2, ACC_DTYPE, DOT_DTYPE,
                                   UPCAST)  # fmt: skip
        else:
            codes = tile_codes(slot_ptr, n_mask, d, kv_mask, VALUE_BITS, VALUE_CODE_BYTES, HEAD_DIM)
            if DOT_DTYPE == ACC_DTYPE:
                v = code_floats(codes).to(ACC_DTYPE) * v_scale[:, None] + v_zero[:, None]
                pv = mma(p, tl.where(kv_mask, v, 0.0), False)
            else:
                scaled = (p * v_scale[None, :]).to(DOT_DTYPE)
                pv = mma(scaled, value_code_operands(codes, DOT_DTYPE), UPCAST) + reduce_sum(p * v_zero[None, :],
                                                                                             1)[:, None]  # fmt: skip
        return pv


@triton.jit
def uniform_planes_pv(p, slot_ptr, n_mask, v_scale, v_zero, HALF: tl.constexpr, ACC_DTYPE: tl.constexpr,
                      DOT_DTYPE: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    """``tile_pv`` of 4-bit uniform values as [GROUP_PAD, HALF, 2] (element (g, i, c): head dim 2 i + c): each
    code byte [BLOCK_N, HALF] is loaded once and its low nibbles (even dims) and high nibbles (odd dims) are
    multiplied apart, so the codes are never interleaved back into head-dim order (benchmarks/uniform_values_probe.py:
    that interleave was ~half of the value tile). Each output element is the same sum over the tile's keys as
    ``tile_pv``'s."""
    byte = tl.load(slot_ptr[:, None] + tl.arange(0, HALF)[None, :], mask=n_mask[:, None], other=0)  # [BLOCK_N, HALF]
    if DOT_DTYPE == ACC_DTYPE:
        even = code_floats(byte & 15).to(ACC_DTYPE) * v_scale[:, None] + v_zero[:, None]
        odd = code_floats(byte >> 4).to(ACC_DTYPE) * v_scale[:, None] + v_zero[:, None]
        pv = tl.join(mma(p, tl.where(n_mask[:, None], even, 0.0), False),
                     mma(p, tl.where(n_mask[:, None], odd, 0.0), False))  # fmt: skip
    else:
        scaled = (p * v_scale[None, :]).to(DOT_DTYPE)
        zero = reduce_sum(p * v_zero[None, :], 1)[:, None]
        pv = tl.join(mma(scaled, value_code_operands(byte & 15, DOT_DTYPE), UPCAST) + zero,
                     mma(scaled, value_code_operands(byte >> 4, DOT_DTYPE), UPCAST) + zero)  # fmt: skip
    return pv
