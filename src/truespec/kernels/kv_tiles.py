"""How the attention kernels (kernels/paged_attention.py, kernels/prefill_attention.py) read one tile of keys or
values from their cache, and the online-softmax step they share.

A tile is BLOCK_N cache slots of one KV head, given as their offsets [BLOCK_N] from the head's base pointer.
The encoding of keys and of values is a compile-time constant, so each cache dtype compiles to its own loop:

- ``MODEL``: the model-dtype cache; a slot's K is HEAD_DIM elements, its V sits ``value_offset`` elements on (the
  K / V plane stride). Scores are ``q . k`` in the model dtype on the tensor cores (fp32 accumulation), exactly as
  before the packed formats shared this loop.
- ``FP8`` keys / values: HEAD_DIM float8_e4m3fn bytes, widened exactly (scale 1.0, as the reference).
- ``LLOYD_MAX`` keys (``turboquant_*_nc``): the wrapper rotates q once (q @ H); the tile's codes are unpacked from
  the little-endian bit stream (``tile_codes``), each centroid looked up in a small table, and the score is
  ``<q_rot, c> * norm / ||c||`` (norm correction): keys are never rotated back.
- ``UNIFORM`` values: codes unpacked the same way, ``v = code * scale + zero`` (fp16 scale / zero).

Unpacking loads each code byte of the tile once, from contiguous addresses, and expands the codes in registers:
4-bit codes as [BLOCK_N, HEAD_DIM_PAD / 2] bytes split into nibbles, 3-bit codes as three byte planes
[BLOCK_N, HEAD_DIM_PAD / 8] forming 24-bit words of 8 codes, both interleaved back to [BLOCK_N, HEAD_DIM_PAD] with
``tl.join`` + ``tl.reshape`` (head dims whose codes do not fill whole bytes / words take a per-code path). An fp16
norm / scale / zero is one 16-bit load where the host proved every such address even (``FP16_ALIGNED``,
paged_attention_packed.py ``is_fp16_aligned``: each preset's contiguous cache at power-of-two head dims >= 16), else
two byte loads. Only how bytes are loaded differs between these paths: the decoded values are the same bits.

Packed slots (kv_cache/formats.py) hold the key part then the value part, multi-byte fields little-endian; decoded
tiles are never written back. For 16-bit models (DOT_DTYPE bf16 / fp16) every product runs on the tensor cores
with operands that are exact in 16 bits (fp8 bytes, value codes) or split in two 16-bit halves (the rotated q and
the Lloyd-Max centroids); fp32 and fp64 models decode tiles in the accumulator dtype and multiply in IEEE fp32 /
fp64 (``DOT_DTYPE`` is then the accumulator dtype).
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from truespec.kernels.triton_utils import mma, reduce_max, reduce_sum

MODEL, FP8, LLOYD_MAX, UNIFORM = 0, 1, 2, 3  # tile encodings (KEY_ENC / VALUE_ENC), as the host passes them
# the same, readable inside @triton.jit code (compiled kernels may read only constexpr globals)
ENC_MODEL, ENC_FP8 = tl.constexpr(MODEL), tl.constexpr(FP8)


class CacheTiles(NamedTuple):
    """How the kernel reads a cache: the tensor, its geometry (in elements; bytes for a packed uint8 cache) and
    the tile encodings of kernels/kv_tiles.py."""

    cache: torch.Tensor
    block_size: int
    num_kv_heads: int
    strides: tuple[int, int, int]  # block, slot, kv head
    value_offset: int  # from a slot's key to its value: the K / V plane stride, or a packed slot's key bytes
    centroids: torch.Tensor  # Lloyd-Max centroid table in the accumulator dtype (unread for other keys)
    encoding: dict[str, int]  # KEY_ENC, KEY_BITS, KEY_CODE_BYTES, VALUE_ENC, VALUE_BITS, VALUE_CODE_BYTES,
    # FP16_ALIGNED


@triton.jit
def tile_codes(slot_ptr, n_mask, d, kv_mask, BITS: tl.constexpr, NUM_BYTES: tl.constexpr, HEAD_DIM: tl.constexpr,
               EXPAND_NIBBLES: tl.constexpr = True):  # fmt: skip
    """The codes [BLOCK_N, HEAD_DIM_PAD] (int32, 0 where ``kv_mask`` is off) of the slots whose packed bit streams
    (NUM_BYTES bytes each) start at ``slot_ptr`` [BLOCK_N]. Each code byte is loaded once, from contiguous addresses,
    and expanded in registers: 4-bit codes as [BLOCK_N, HEAD_DIM_PAD / 2] bytes, code 2i the low nibble of byte i
    and 2i + 1 the high one; 3-bit codes as three byte planes [BLOCK_N, HEAD_DIM_PAD / 8] (bytes 3g, 3g + 1, 3g + 2
    hold codes 8g .. 8g + 7 as one 24-bit little-endian word). Both interleave with ``tl.join`` + ``tl.reshape``.
    Head dims these cannot cover (odd for 4-bit, not a multiple of 8 for 3-bit) take ``unpack_codes``, and so do
    4-bit codes with EXPAND_NIBBLES off: Lloyd-Max keys, whose centroid gather ran 1.4x slower after the nibble
    interleave than after per-element loads (H200, BENCHMARKS.md session 12), unlike uniform values (1.2-1.3x
    faster)."""
    BLOCK_N: tl.constexpr = n_mask.shape[0]
    HEAD_DIM_PAD: tl.constexpr = d.shape[0]
    if (BITS == 4) & (HEAD_DIM % 2 == 0) & EXPAND_NIBBLES:
        b = tl.arange(0, HEAD_DIM_PAD // 2)
        byte_mask = n_mask[:, None] & (b[None, :] < HEAD_DIM // 2)
        byte = tl.load(slot_ptr[:, None] + b[None, :], mask=byte_mask, other=0).to(tl.int32)
        return tl.reshape(tl.join(byte & 15, byte >> 4), [BLOCK_N, HEAD_DIM_PAD])
    elif (BITS == 3) & (HEAD_DIM % 8 == 0):
        g = tl.arange(0, HEAD_DIM_PAD // 8)
        group_mask = n_mask[:, None] & (g[None, :] < HEAD_DIM // 8)
        group_ptr = slot_ptr[:, None] + 3 * g[None, :]
        word = tl.load(group_ptr, mask=group_mask, other=0).to(tl.int32)
        word |= tl.load(group_ptr + 1, mask=group_mask, other=0).to(tl.int32) << 8
        word |= tl.load(group_ptr + 2, mask=group_mask, other=0).to(tl.int32) << 16
        # code 4a + 2b + c of a group (bits [3 (4a + 2b + c), +3) of the word) at [..., a, b, c]: join stacks on a
        # new last axis, so the outermost join picks c, the innermost a
        even = tl.join(tl.join(word & 7, (word >> 12) & 7), tl.join((word >> 6) & 7, (word >> 18) & 7))
        odd = tl.join(tl.join((word >> 3) & 7, (word >> 15) & 7), tl.join((word >> 9) & 7, (word >> 21) & 7))
        return tl.reshape(tl.join(even, odd), [BLOCK_N, HEAD_DIM_PAD])
    else:
        return unpack_codes(slot_ptr[:, None], d[None, :], kv_mask, BITS, NUM_BYTES)


@triton.jit
def unpack_codes(base_ptr, idx, mask, BITS: tl.constexpr, NUM_BYTES: tl.constexpr):
    """Codes ``idx`` (any int tensor) of a packed little-endian bit stream at ``base_ptr`` (NUM_BYTES bytes),
    as int32, one or two byte loads per code (``tile_codes``' fallback): code j is bits [j * BITS, (j + 1) * BITS);
    a 3-bit code may straddle two bytes."""
    bit = idx * BITS
    byte = bit // 8
    lo = tl.load(base_ptr + byte, mask=mask, other=0).to(tl.int32)
    if 8 % BITS == 0:  # 4- and 8-bit codes never straddle a byte: one load
        return (lo >> (bit % 8)) & ((1 << BITS) - 1)
    hi = tl.load(base_ptr + byte + 1, mask=mask & (byte + 1 < NUM_BYTES), other=0).to(tl.int32)
    return ((lo | (hi << 8)) >> (bit % 8)) & ((1 << BITS) - 1)


@triton.jit
def load_fp16(ptr, mask, IS_EVEN: tl.constexpr):
    """A little-endian fp16 at byte address ``ptr``, widened to fp32: one 16-bit load where every address is even
    (``IS_EVEN``), else two byte loads."""
    if IS_EVEN:
        bits = tl.load(ptr.to(tl.pointer_type(tl.uint16)), mask=mask, other=0)
    else:
        lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
        bits = lo | (tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16) << 8)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def load_fp8(ptr, mask):
    """float8_e4m3fn bytes at ``ptr``, widened exactly to fp32 (masked lanes read 0)."""
    return tl.load(ptr, mask=mask, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)


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
def tile_scores(q, q_lo, head_ptr, slot_off, d, n_mask, kv_mask, centroids_ptr, KEY_ENC: tl.constexpr,
                KEY_BITS: tl.constexpr, KEY_CODE_BYTES: tl.constexpr, HEAD_DIM: tl.constexpr,
                FP16_ALIGNED: tl.constexpr, ACC_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr,
                UPCAST: tl.constexpr):  # fmt: skip
    """Unscaled scores [GROUP_PAD, BLOCK_N] of (q, q_lo) [GROUP_PAD, HEAD_DIM_PAD] (``tile_queries``) against the
    keys of the tile's slots, which start ``slot_off`` [BLOCK_N] elements (bytes for a packed cache) past
    ``head_ptr``. On the tensor cores (DOT_DTYPE 16-bit): fp8 keys widen exactly to DOT_DTYPE; Lloyd-Max centroids
    (fp32) are split like q and scored as hi.hi + hi.lo + lo.hi (the lo.lo term is below fp32's last bits)."""
    if KEY_ENC == ENC_MODEL:
        k = tl.load(head_ptr + (slot_off[:, None] + d[None, :]), mask=kv_mask, other=0.0)  # [BLOCK_N, HEAD_DIM_PAD]
        s = mma(q, tl.trans(k), UPCAST)
    elif KEY_ENC == ENC_FP8:
        k = load_fp8(head_ptr + (slot_off[:, None] + d[None, :]), kv_mask).to(q.dtype)
        s = mma(q, tl.trans(k), UPCAST)
    else:
        slot_ptr = head_ptr + slot_off  # [BLOCK_N]
        codes = tile_codes(slot_ptr, n_mask, d, kv_mask, KEY_BITS, KEY_CODE_BYTES, HEAD_DIM, False)
        c = tl.load(centroids_ptr + codes, mask=kv_mask, other=0.0)  # [BLOCK_N, HEAD_DIM_PAD]
        c_norm = tl.sqrt(reduce_sum(c * c, 1))
        norm = load_fp16(slot_ptr + KEY_CODE_BYTES, n_mask, FP16_ALIGNED).to(ACC_DTYPE)
        weight = norm / tl.where(c_norm > 0, c_norm, 1.0)  # ||k|| / ||c||; masked keys: 0
        if DOT_DTYPE == ACC_DTYPE:
            s = mma(q, tl.trans(c), False)
        else:
            c_hi, c_lo = split_hi_lo(c, DOT_DTYPE)
            s = mma(q, tl.trans(c_hi), UPCAST) + mma(q, tl.trans(c_lo), UPCAST) + mma(q_lo, tl.trans(c_hi), UPCAST)
        s = s * weight[None, :]
    return s


@triton.jit
def tile_pv(p, value_ptr, slot_off, d, n_mask, kv_mask, VALUE_ENC: tl.constexpr, VALUE_BITS: tl.constexpr,
            VALUE_CODE_BYTES: tl.constexpr, HEAD_DIM: tl.constexpr, FP16_ALIGNED: tl.constexpr,
            ACC_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    """p [GROUP_PAD, BLOCK_N] (accumulator dtype) @ the values [BLOCK_N, HEAD_DIM_PAD] of the tile's slots, whose
    value parts start ``slot_off`` [BLOCK_N] past ``value_ptr``. MODEL and FP8 values: p cast to the values'
    dtype (fp8 widened exactly to DOT_DTYPE) and one MMA. UNIFORM values ``code * scale + zero`` per slot: on the
    tensor cores ``(p * scale) @ codes + (p . zero)`` (codes are exact in 16 bits), else decoded in the accumulator
    dtype (masked lanes 0)."""
    v_ptrs = value_ptr + (slot_off[:, None] + d[None, :])
    if VALUE_ENC == ENC_MODEL:
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        return mma(p.to(v.dtype), v, UPCAST)
    elif VALUE_ENC == ENC_FP8:
        v = load_fp8(v_ptrs, kv_mask).to(DOT_DTYPE)
        return mma(p.to(DOT_DTYPE), v, UPCAST)
    else:
        slot_ptr = value_ptr + slot_off  # [BLOCK_N]
        codes = tile_codes(slot_ptr, n_mask, d, kv_mask, VALUE_BITS, VALUE_CODE_BYTES, HEAD_DIM)
        v_scale = load_fp16(slot_ptr + VALUE_CODE_BYTES, n_mask, FP16_ALIGNED).to(ACC_DTYPE)
        v_zero = load_fp16(slot_ptr + VALUE_CODE_BYTES + 2, n_mask, FP16_ALIGNED).to(ACC_DTYPE)
        if DOT_DTYPE == ACC_DTYPE:
            v = codes.to(ACC_DTYPE) * v_scale[:, None] + v_zero[:, None]
            return mma(p, tl.where(kv_mask, v, 0.0), False)
        scaled = (p * v_scale[None, :]).to(DOT_DTYPE)
        codes = codes.to(tl.float32).to(DOT_DTYPE)  # via fp32: Triton 3.6's interpreter casts int32 -> bf16 wrongly
        return mma(scaled, codes, UPCAST) + reduce_sum(p * v_zero[None, :], 1)[:, None]
