"""Write a step's K/V rows into a packed (compressed) KV cache: the fused twin of ``KVFormat.encode`` +
``store_packed_ref`` (kv_cache/formats.py, ops/kv_quant.py) for ``fp8`` and the TurboQuant presets.

One program per (token, kv head): it reads the key and value rows in the compute dtype (fp32; fp64 for fp64), writes
the slot's key part then its value part (kv_cache/formats.py's layout, fp16 fields little-endian), and writes
nothing for a padding row (slot -1). Every step follows the reference's order and rounding:

- ``fp8``: clamp to +-448, round to nearest even into float8_e4m3fn (scale 1.0). The rounding is done on the fp32
  bits (exactly what torch does; Triton's interpreter rounds fp8 casts differently); fp64 rows are rounded to fp32
  first, as torch does.
- Lloyd-Max keys: ``norm = sqrt(sum x^2)``, ``unit = x / max(norm, tiny)``, ``rot = unit @ H`` (the normalised
  Hadamard matrix) by the fast Walsh-Hadamard transform in the compute dtype (kernels/hadamard.py: D log D additions
  where the [D, D] product it replaced took D^2 multiply-adds, 5x slower a call, BENCHMARKS.md session 31), each
  coordinate's code = the number of float32 decision boundaries strictly below it (``codebook_codes``: a tie goes
  to the lower code), all codes bit-packed little-endian at once (8 codes a group of whole bytes); then the fp16
  scale: ||k|| / ||c|| with norm correction (||c||^2 summed in float64, exact in any order, then divided and rounded
  as the reference does), else ||k||. Division and square root are IEEE-rounded (``div_rn`` / ``sqrt_rn``: compiled
  Triton's ``/`` and ``sqrt`` are approximate in fp32).
- Uniform values: ``lo = min``, ``hi = max``, ``scale = fp16((hi - lo) / (2^b - 1))``, ``zero = fp16(lo)``
  (saturating at +-65504; fp64 via fp32, as torch rounds), ``code = round_half_even((v - zero) / scale)`` clamped to
  [0, 2^b - 1] (scale 0 reads as 1), bit-packed; then the fp16 scale and zero.

What can differ from the reference: the sum of squares and the rotation's sums are reduced in another order than
torch's kernels (compiled, with fused multiply-adds; and 1 / sqrt(D), inexact at odd powers of two, multiplies
each sum once instead of each term; and torch's CPU fp32 sqrt is not always correctly rounded: 442 of 65536
random inputs were 1 ulp low), so the fp32 norm and rotated coordinates may differ in their last bits. A
key code then differs only where a rotated coordinate lies within a few fp32 ulps of a decision boundary, and an
fp16 scale by one ulp where the fp32 norm sits near an fp16 rounding midpoint (or as the scale of the key's own codes,
where one of them differs: ||c|| follows the codes). Measured (session 12, when the field held the norm) on CPU
with float64-exact norms and rotations against torch's fp32 encode (4M to 8M codes at D 128 / 256, 3 and 4 bits):
1 to 4 codes and 0 to 1 norm in 32768 differed; none at the tests' CPU sizes.
tests/test_kv_store_packed.py asserts exactly that: every byte equal, except such codes (|code step| = 1, the
float64 coordinate within 1e-6 of the boundary) and such scales, and none of either on the interpreter's inputs.
"""

from functools import cache

import torch
import triton
import triton.language as tl

from truespec.kernels import kv_tiles
from truespec.kernels.hadamard import h00, walsh_hadamard
from truespec.kernels.paged_attention_packed import (
    KEY_ENCODINGS,
    UNIFORM,
    VALUE_ENCODINGS,
    KVFormat,
    check_packed_cache,
)
from truespec.kernels.triton_utils import pad_pow2, reduce_max, reduce_min, reduce_sum, tl_compute_dtype
from truespec.ops.kv_quant import FP8_MAX, FP16_MAX, packed_size
from truespec.ops.lloyd_max import lloyd_max_codebook
from truespec.ops.precision import compute_dtype

CODE_BLOCK = 32  # uniform value codes rounded and packed at a time (a multiple of 8: whole bytes per chunk)
NUM_WARPS = 4
# constants read inside @triton.jit code (compiled kernels may read only constexpr globals)
_FP8, _FP8_MAX, _FP16_MAX = tl.constexpr(kv_tiles.FP8), tl.constexpr(FP8_MAX), tl.constexpr(FP16_MAX)


@triton.jit
def _div(x, y, IS_FP64: tl.constexpr):
    """x / y rounded to nearest (IEEE) in fp32 or fp64; y broadcast to x's shape."""
    if IS_FP64:
        return x / y
    else:
        return tl.div_rn(x, tl.broadcast_to(y, x.shape))


@triton.jit
def _sqrt(x, IS_FP64: tl.constexpr):
    """sqrt(x) rounded to nearest (IEEE) in fp32 or fp64."""
    if IS_FP64:
        return tl.sqrt(x)  # IEEE in fp64
    else:
        return tl.sqrt_rn(x)


@triton.jit
def _to_fp32(x, IS_FP64: tl.constexpr):
    """fp64 -> fp32 rounded to nearest (torch narrows fp64 to fp16 / fp8 through fp32); fp32 unchanged."""
    if IS_FP64:
        x = x.to(tl.float32)
    return x


@triton.jit
def _to_fp16(x, IS_FP64: tl.constexpr):
    """Round to fp16 (nearest even), saturating at +-65504 (ops/kv_quant.py ``_to_fp16``)."""
    return tl.clamp(_to_fp32(x, IS_FP64), -_FP16_MAX, _FP16_MAX).to(tl.float16)


@triton.jit
def _store_fp16(ptr, h):
    """Store the fp16 scalar h little-endian at byte address ``ptr`` (any alignment)."""
    bits = h.to(tl.uint16, bitcast=True)
    tl.store(ptr, (bits & 0xFF).to(tl.uint8))
    tl.store(ptr + 1, (bits >> 8).to(tl.uint8))


@triton.jit
def _fp8_e4m3_bytes(x, IS_FP64: tl.constexpr):
    """x clamped to +-448 -> float8_e4m3fn bit patterns (uint8), rounded to nearest even (NaN -> 0x7F | sign)."""
    x = tl.clamp(_to_fp32(x, IS_FP64), -_FP8_MAX, _FP8_MAX)
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    a_bits = bits & 0x7FFFFFFF
    a = a_bits.to(tl.float32, bitcast=True)
    # below 2^-6 (fp8 subnormals, step 2^-9): a * 2^9 is exact; adding 2^23 rounds it to an integer, ties to even
    subnormal = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    # normal: round the fp32 mantissa to 3 bits (ties to even), rebias the exponent from 127 to 7
    normal = ((a_bits + 0x7FFFF + ((a_bits >> 20) & 1)) >> 20) - (120 << 3)
    code = tl.where(a < 0.015625, subnormal, normal)
    code = tl.where(a != a, 0x7F, code)  # NaN
    return (code | (sign << 7)).to(tl.uint8)


@triton.jit
def _round_half_even(y, IS_FP64: tl.constexpr):
    """y in [0, 2^23) (fp32) or [0, 2^52) (fp64) rounded to an integer, ties to even (torch.round)."""
    if IS_FP64:
        return (y + 4503599627370496.0) - 4503599627370496.0
    else:
        return (y + 8388608.0) - 8388608.0


@triton.jit
def _store_codes(ptr, codes, first_code, BITS: tl.constexpr, NUM_BYTES: tl.constexpr, CODES: tl.constexpr):
    """Pack int32 ``codes`` [CODES] (codes first_code.., first_code a multiple of 8) into their bytes of the
    little-endian bit stream at ``ptr`` (NUM_BYTES bytes in all): code j's bits land at bit (first_code + j) * BITS."""
    i = tl.arange(0, CODES)  # the chunk's bytes (CODES * BITS / 8 <= CODES of them)
    j = tl.arange(0, CODES)
    shift = j[None, :] * BITS - 8 * i[:, None]  # [CODES, CODES]: where code j starts within byte i
    is_in = (shift > -BITS) & (shift < 8)
    left = tl.where(is_in & (shift >= 0), shift, 0)
    right = tl.where(is_in & (shift < 0), -shift, 0)
    pieces = tl.where(is_in, ((codes[None, :] << left) >> right) & 0xFF, 0)
    byte = first_code * BITS // 8 + i
    is_chunk_byte = (i < (CODES * BITS + 7) // 8) & (byte < NUM_BYTES)
    tl.store(ptr + byte, reduce_sum(pieces, 1).to(tl.uint8), mask=is_chunk_byte)  # disjoint bits: sum == or


@triton.jit
def _store_all_codes(ptr, codes, BITS: tl.constexpr, NUM_BYTES: tl.constexpr):
    """Pack int32 ``codes`` [D] (every code of a slot) into the NUM_BYTES bytes of the little-endian bit stream at
    ``ptr``: groups of 8 codes are BITS whole bytes each (D a multiple of 8), else the bytes of ``_store_codes``."""
    D: tl.constexpr = codes.shape[0]
    if D % 8 == 0:
        shifts = tl.arange(0, 8) * BITS
        words = reduce_sum(tl.reshape(codes, [D // 8, 8]) << shifts[None, :], 1)  # [D / 8]: disjoint bits, sum == or
        group = tl.arange(0, D // 8)
        for byte in tl.static_range(BITS):
            tl.store(ptr + group * BITS + byte, ((words >> (8 * byte)) & 0xFF).to(tl.uint8))
    else:
        _store_codes(ptr, codes, 0, BITS, NUM_BYTES, D)


@triton.jit
def _kv_store_packed_kernel(
    k_ptr,  # [T', num_kv_heads, head_dim]
    v_ptr,  # [T', num_kv_heads, head_dim]
    kv_cache_ptr,  # uint8 [num_blocks, block_size, num_kv_heads, bytes_per_token]
    slot_mapping_ptr,  # [T]
    h00_ptr,  # [1]: H[0, 0] = 1 / sqrt(D) in the compute dtype (LLOYD_MAX keys only)
    boundaries_ptr,  # [2^KEY_BITS - 1] float32 decision boundaries (LLOYD_MAX keys only)
    centroids_ptr,  # [2^KEY_BITS] float64 centroids (LLOYD_MAX keys with NORM_CORRECTION only)
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_cache_slot,  # flat slot = block * block_size + offset (blocks are contiguous)
    stride_cache_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    KEY_ENC: tl.constexpr,  # kernels/kv_tiles.py encodings
    KEY_BITS: tl.constexpr,
    KEY_CODE_BYTES: tl.constexpr,
    KEY_BYTES: tl.constexpr,
    NORM_CORRECTION: tl.constexpr,  # LLOYD_MAX keys: store ||k|| / ||c||, else ||k||
    VALUE_ENC: tl.constexpr,
    VALUE_BITS: tl.constexpr,
    VALUE_CODE_BYTES: tl.constexpr,
    CODE_BLOCK: tl.constexpr,  # uniform values: min(code_block, HEAD_DIM_PAD)
    COMPUTE_DTYPE: tl.constexpr,
    TINY: tl.constexpr,  # smallest normal of the compute dtype (the reference's clamp of the norm)
    IS_FP64: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token)  # int64
    if slot < 0:  # padding: write nothing
        return
    slot_ptr = kv_cache_ptr + slot * stride_cache_slot + head * stride_cache_head
    k_row = k_ptr + token * stride_k_tok + head * stride_k_head
    v_row = v_ptr + token * stride_v_tok + head * stride_v_head
    d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = d < HEAD_DIM

    # ---- key part
    x = tl.load(k_row + d, mask=d_mask, other=0.0).to(COMPUTE_DTYPE)
    if KEY_ENC == _FP8:
        tl.store(slot_ptr + d, _fp8_e4m3_bytes(x, IS_FP64), mask=d_mask)
    else:  # LLOYD_MAX: HEAD_DIM is a power of two >= 4 (no padded lanes)
        norm = _sqrt(reduce_sum(x * x, 0), IS_FP64)
        unit = _div(x, tl.maximum(norm, tl.full([], TINY, COMPUTE_DTYPE)), IS_FP64)
        b = tl.arange(0, 1 << KEY_BITS)
        boundaries = tl.load(boundaries_ptr + b, mask=b < (1 << KEY_BITS) - 1, other=float("inf")).to(COMPUTE_DTYPE)
        rot = tl.reshape(walsh_hadamard(tl.reshape(unit, [1, HEAD_DIM]), HEAD_DIM), [HEAD_DIM])  # unit @ H / H[0, 0]
        rot *= tl.load(h00_ptr)
        # codebook_codes: the number of boundaries strictly below (a tie goes to the lower code)
        codes = reduce_sum((boundaries[None, :] < rot[:, None]).to(tl.int32), 1)  # [HEAD_DIM]
        _store_all_codes(slot_ptr, codes, KEY_BITS, KEY_CODE_BYTES)
        if NORM_CORRECTION:
            c = tl.load(centroids_ptr + codes)
            c_sq = reduce_sum(c * c, 0)  # ||c||^2 in float64: exact in any order (ops/kv_quant.py centroid_norms)
            _store_fp16(slot_ptr + KEY_CODE_BYTES, _to_fp16(norm.to(tl.float64) / tl.sqrt(c_sq), True))
        else:
            _store_fp16(slot_ptr + KEY_CODE_BYTES, _to_fp16(norm, IS_FP64))

    # ---- value part
    value_ptr = slot_ptr + KEY_BYTES
    v = tl.load(v_row + d, mask=d_mask, other=0.0).to(COMPUTE_DTYPE)
    if VALUE_ENC == _FP8:
        tl.store(value_ptr + d, _fp8_e4m3_bytes(v, IS_FP64), mask=d_mask)
    else:  # UNIFORM
        max_code = (1 << VALUE_BITS) - 1
        lo = reduce_min(tl.where(d_mask, v, float("inf")), 0)
        hi = reduce_max(tl.where(d_mask, v, float("-inf")), 0)
        scale = _to_fp16(_div(hi - lo, tl.full([], max_code, COMPUTE_DTYPE), IS_FP64), IS_FP64)
        zero = _to_fp16(lo, IS_FP64)
        s = tl.where(scale > 0, scale.to(COMPUTE_DTYPE), 1.0)
        z = zero.to(COMPUTE_DTYPE)
        for c0 in tl.static_range(0, HEAD_DIM_PAD, CODE_BLOCK):
            cols = c0 + tl.arange(0, CODE_BLOCK)
            vc = tl.load(v_row + cols, mask=cols < HEAD_DIM, other=0.0).to(COMPUTE_DTYPE)
            # round((v - z) / s).clamp(0, max_code) == round(clamp((v - z) / s, 0, max_code))
            y = tl.clamp(_div(vc - z, s, IS_FP64), 0.0, max_code)
            codes = tl.where(cols < HEAD_DIM, _round_half_even(y, IS_FP64), 0).to(tl.int32)
            _store_codes(value_ptr, codes, c0, VALUE_BITS, VALUE_CODE_BYTES, CODE_BLOCK)
        _store_fp16(value_ptr + VALUE_CODE_BYTES, scale)
        _store_fp16(value_ptr + VALUE_CODE_BYTES + 2, zero)


@cache
def _rotation_tables(head_dim: int, bits: int, dtype: torch.dtype, device: torch.device
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """H[0, 0] [1] of the normalised Hadamard matrix in ``dtype`` (every entry is +-H[0, 0]), the float32 decision
    boundaries and the float64 centroids on ``device`` (cached: no host-to-device copy once warmed up)."""
    centroids, boundaries = lloyd_max_codebook(head_dim, bits)
    return h00(head_dim, dtype, device), boundaries.to(device), centroids.to(device, torch.float64)


@cache
def _dummy_tables(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.zeros(1, dtype=dtype, device=device), torch.zeros(1, device=device),
            torch.zeros(1, dtype=torch.float64, device=device))  # fmt: skip


def store_packed(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 fmt: KVFormat, code_block: int = CODE_BLOCK, num_warps: int = NUM_WARPS) -> None:  # fmt: skip
    """Encode k / v [T', num_kv_heads, head_dim] (any float dtype) as ``fmt`` and store them at ``slot_mapping`` [T]
    (T <= T'; rows with slot -1 write nothing) into the packed ``kv_cache`` uint8 [num_blocks, block_size,
    num_kv_heads, fmt.bytes_per_token(head_dim)], in place: ``store_packed_ref(fmt.encode(k, v), kv_cache,
    slot_mapping)`` in one kernel (see the module docstring for where a key code may differ). No host sync; the
    rotation tables are cached per (head_dim, bits, dtype, device), so a first eager call before capture makes it
    CUDA-graph capturable. Launch knobs (benchmarks/kv_store_speed.py; the engine passes none): ``code_block``,
    uniform value codes rounded and packed at a time (a power of two >= 8), and ``num_warps``."""
    if code_block < 8 or code_block & (code_block - 1):
        raise ValueError(f"code_block {code_block} is not a power of two >= 8")
    num_tokens = slot_mapping.shape[0]
    _, num_kv_heads, head_dim = k.shape
    check_packed_cache(kv_cache, fmt, head_dim)
    block_size = kv_cache.shape[1]
    if kv_cache.shape[2] != num_kv_heads or v.shape[1:] != k.shape[1:] or v.shape[0] < num_tokens:
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not fit kv_cache {tuple(kv_cache.shape)}")
    if kv_cache.stride(0) != block_size * kv_cache.stride(1) or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("kv_cache blocks must be contiguous (flat slot = block * block_size + offset); k and v "
                         "need a unit last stride")  # fmt: skip
    if num_tokens == 0:
        return
    acc_dtype = compute_dtype(k.dtype)
    if fmt.is_rotated:
        assert fmt.key_bits is not None
        h00_table, boundaries, centroids = _rotation_tables(head_dim, fmt.key_bits, acc_dtype, k.device)
        key_bits, key_code_bytes = fmt.key_bits, packed_size(head_dim, fmt.key_bits)
    else:
        h00_table, boundaries, centroids = _dummy_tables(acc_dtype, k.device)
        key_bits, key_code_bytes = 8, head_dim
    value_bits = fmt.value_bits if fmt.value_encoding == UNIFORM else 8
    assert value_bits is not None
    head_dim_pad = pad_pow2(head_dim, 1)
    _kv_store_packed_kernel[(num_tokens, num_kv_heads)](
        k, v, kv_cache, slot_mapping, h00_table, boundaries, centroids, k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), kv_cache.stride(1), kv_cache.stride(2),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, KEY_ENC=KEY_ENCODINGS[fmt.key_encoding], KEY_BITS=key_bits,
        KEY_CODE_BYTES=key_code_bytes, KEY_BYTES=fmt.key_bytes(head_dim), NORM_CORRECTION=fmt.norm_correction,
        VALUE_ENC=VALUE_ENCODINGS[fmt.value_encoding], VALUE_BITS=value_bits,
        VALUE_CODE_BYTES=packed_size(head_dim, value_bits), CODE_BLOCK=min(code_block, head_dim_pad),
        COMPUTE_DTYPE=tl_compute_dtype(k.dtype), TINY=torch.finfo(acc_dtype).tiny,
        IS_FP64=acc_dtype == torch.float64, num_warps=num_warps,
    )  # fmt: skip
