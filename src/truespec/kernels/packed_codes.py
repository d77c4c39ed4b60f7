"""How the attention kernels read the fields of a packed cache slot (kv_cache/formats.py: the key part then the value
part, multi-byte fields little-endian): bit-packed codes, fp16 key scales / value scales / zeros and fp8 bytes.
kernels/kv_tiles.py turns them into scores and values.

Unpacking loads each code byte of a tile once, from contiguous addresses, and expands the codes in registers:
4-bit codes as [BLOCK_N, HEAD_DIM_PAD / 2] bytes split into nibbles, 3-bit codes as three byte planes
[BLOCK_N, HEAD_DIM_PAD / 8] forming 24-bit words of 8 codes, both interleaved back to [BLOCK_N, HEAD_DIM_PAD] with
``tl.join`` + ``tl.reshape`` (head dims whose codes do not fill whole bytes / words take a per-code path); a tile
may also be read a chunk of head dims at a time (``dim_start``: kv_tiles.py ``chunked_lloyd_max_scores``). An fp16
scale / zero is one 16-bit load where the host proved every such address even (``FP16_ALIGNED``,
paged_attention_packed.py ``is_fp16_aligned``: each preset's contiguous cache at power-of-two head dims >= 16), else
two byte loads. Only how bytes are loaded differs between these paths: the decoded values are the same bits
(tests/test_kv_tiles_unpack.py).
"""

import triton
import triton.language as tl


@triton.jit
def tile_codes(slot_ptr, n_mask, d, kv_mask, BITS: tl.constexpr, NUM_BYTES: tl.constexpr, HEAD_DIM: tl.constexpr,
               dim_start=0):  # fmt: skip
    """The codes [BLOCK_N, HEAD_DIM_PAD] (int32, 0 where ``kv_mask`` is off) of the slots whose packed bit streams
    (NUM_BYTES bytes each) start at ``slot_ptr`` [BLOCK_N], for the dims ``d``: 0 .. HEAD_DIM_PAD - 1, or a chunk
    dim_start + arange(HEAD_DIM_PAD) (``dim_start`` a multiple of 8, a constant or a runtime int; HEAD_DIM_PAD is
    d's width). Each code byte is loaded once, from contiguous addresses, and expanded in registers: 4-bit codes as
    [BLOCK_N, HEAD_DIM_PAD / 2] bytes, code 2i the low nibble of byte i and 2i + 1 the high one; 3-bit codes as
    three byte planes [BLOCK_N, HEAD_DIM_PAD / 8] (bytes 3g, 3g + 1, 3g + 2 hold codes 8g .. 8g + 7 as one 24-bit
    little-endian word). Both interleave with ``tl.join`` + ``tl.reshape``. Head dims these cannot cover (odd for
    4-bit, not a multiple of 8 for 3-bit) take ``unpack_codes``."""
    BLOCK_N: tl.constexpr = n_mask.shape[0]
    HEAD_DIM_PAD: tl.constexpr = d.shape[0]
    if (BITS == 4) & (HEAD_DIM % 2 == 0):
        slot_ptr += dim_start // 2
        b = tl.arange(0, HEAD_DIM_PAD // 2)
        byte_mask = n_mask[:, None] & (b[None, :] < (HEAD_DIM - dim_start) // 2)
        byte = tl.load(slot_ptr[:, None] + b[None, :], mask=byte_mask, other=0).to(tl.int32)
        return tl.reshape(tl.join(byte & 15, byte >> 4), [BLOCK_N, HEAD_DIM_PAD])
    elif (BITS == 3) & (HEAD_DIM % 8 == 0):
        slot_ptr += dim_start // 8 * 3
        g = tl.arange(0, HEAD_DIM_PAD // 8)
        group_mask = n_mask[:, None] & (g[None, :] < (HEAD_DIM - dim_start) // 8)
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
