"""Packed codes (kernels/packed_codes.py ``tile_codes``) as the numbers the attention tiles multiply: Lloyd-Max
centroids and uniform value codes, in the accumulator dtype or as 16-bit tensor-core operands.

Compiled for the GPU, the 16-bit operands come from byte permutes (PTX ``prmt``), four codes per instruction
sequence, with no table in memory and no per-element select:

- Lloyd-Max centroids (``centroid_operands``): the codebook is symmetric (c[2^b - 1 - i] = -c[i], exactly, also
  after its bf16 rounding), so a code is a sign (its top bit: set for the upper, positive half) and a magnitude
  index 0 .. 2^(b-1) - 1. One ``prmt`` looks up the low bytes of four magnitudes' 16-bit patterns in an 8-byte
  table held in two registers, one more the high bytes; two more interleave them into four 16-bit numbers and
  the sign is or-ed into bit 15. The four table words per operand dtype follow the centroids in the table the
  kernels are handed (``lut_words``; kernels/paged_attention_packed.py builds it).
- Value codes (``value_code_operands``): code k becomes the 16-bit number 2^m + k (its bits the exponent byte
  of 2^m above k: one ``prmt`` for two codes, exact for k < 2^7), minus 2^m (one packed subtraction, exact).

Both give the very numbers of the portable path (``centroid_values`` / ``code_floats``, then a cast), which runs
under ``TRITON_INTERPRET=1`` (no inline assembly there) and in fp32 / fp64 models: the same operands, so the same
bits out of the same MMA (tests/test_code_operands.py on the GPU). Going from a select tree per element to the
permutes cut the key tile's decode ~3x (benchmarks/lloyd_max_scoring_probe.py, BENCHMARKS.md session 14).
"""

# ruff: noqa: SIM300 (DOT_DTYPE == tl.float16 compares a constexpr parameter, not a constant)
import torch
import triton
import triton.language as tl

from truespec.kernels.triton_utils import is_interpreter

NATIVE = tl.constexpr(not is_interpreter())  # inline PTX allowed (compiled for the GPU)

# four codes (bytes of $2) -> four 16-bit centroids ($0: codes 0, 1; $1: codes 2, 3); $3 / $7 the low-byte table
# words (magnitudes 0-3 / 4-7), $11 / $15 the high-byte ones ($4-6 etc.: the same words' other lanes, unused)
_CENTROID_PTX = """{{
.reg .b32 s, m, t, sel, lo, hi;
and.b32 s, $2, {sign};
shr.u32 m, s, {shift};
add.u32 m, m, {base};
xor.b32 m, m, $2;
shr.u32 t, m, 4;
or.b32 t, t, m;
prmt.b32 sel, t, t, 0x0020;
prmt.b32 lo, $3, $7, sel;
prmt.b32 hi, $11, $15, sel;
xor.b32 s, s, {sign};
shl.b32 s, s, {to_bit7};
or.b32 hi, hi, s;
prmt.b32 $0, lo, hi, 0x5140;
prmt.b32 $1, lo, hi, 0x7362;
}}"""
# the magnitude index: code ^ (2^(b-1) - 1) below the sign bit (the negative half, mirrored), code ^ 2^(b-1) above
CENTROID_PTX_3 = tl.constexpr(_CENTROID_PTX.format(sign="0x04040404", shift=2, base="0x03030303", to_bit7=5))
CENTROID_PTX_4 = tl.constexpr(_CENTROID_PTX.format(sign="0x08080808", shift=3, base="0x07070707", to_bit7=4))
CENTROID_CONSTRAINTS = tl.constexpr("=r,=r," + ",".join(["r"] * 17))

# four codes (bytes of $2) -> 2^m + code as 16-bit numbers, minus 2^m: bf16 2^7 (0x4300), fp16 2^10 (0x6400)
_VALUE_PTX = """{{
.reg .b32 e;
mov.b32 e, {exponent};
prmt.b32 $0, $2, e, 0x4140;
prmt.b32 $1, $2, e, 0x4342;
mov.b32 e, {offset};
sub.{kind} $0, $0, e;
sub.{kind} $1, $1, e;
}}"""
VALUE_PTX_BF16 = tl.constexpr(_VALUE_PTX.format(exponent="0x43434343", offset="0x43004300", kind="rn.bf16x2"))
VALUE_PTX_FP16 = tl.constexpr(_VALUE_PTX.format(exponent="0x64646464", offset="0x64006400", kind="rn.f16x2"))


def lut_words(centroids: torch.Tensor) -> torch.Tensor:
    """The byte tables ``centroid_operands`` reads after the 2^b centroids, as int32 [8]: for bf16 then fp16, the
    low bytes of magnitudes 0-3, 4-7 and the high bytes of 0-3, 4-7 (magnitude j: centroid 2^(b-1) + j, the upper
    half; 3-bit codebooks leave magnitudes 4-7 zero). A ValueError unless the codebook is symmetric and exact in
    both 16-bit dtypes."""
    half = centroids.numel() // 2
    if half not in (4, 8) or not torch.equal(centroids, -centroids.flip(0)) or bool((centroids[half:] <= 0).any()):
        raise ValueError("the byte-table lookup needs a symmetric 8- or 16-entry codebook, positive upper half")
    words = []
    for dtype in (torch.bfloat16, torch.float16):
        narrow = centroids[half:].to(dtype)
        if not torch.equal(narrow.double(), centroids[half:].double()):
            raise ValueError(f"centroids not exact in {dtype}")
        bits = narrow.view(torch.int16).long() & 0xFFFF
        bits = torch.cat([bits, bits.new_zeros(8 - half)])
        for part in (bits & 0xFF, bits >> 8):
            for j in (0, 4):
                word = sum(int(part[j + i]) << (8 * i) for i in range(4))
                words.append(word - (1 << 32) if word >= 1 << 31 else word)
    return torch.tensor(words, dtype=torch.int32)


@triton.jit
def centroid_values(codes, centroids_ptr, BITS: tl.constexpr):
    """The centroid of each code (any int dtype and shape) from the 2^BITS-entry table at ``centroids_ptr`` (BITS 3
    or 4), in the table's dtype: the entries are loaded as scalars and picked by a tree of selects on the code's
    bits (the portable path; gathering each element's centroid from memory was 3x slower, BENCHMARKS.md
    session 13)."""
    tl.static_assert((BITS == 3) | (BITS == 4), "Lloyd-Max keys have 3- or 4-bit codes")
    lower = select8(codes, centroids_ptr)
    if BITS == 4:
        return tl.where((codes & 8) != 0, select8(codes, centroids_ptr + 8), lower)
    return lower


@triton.jit
def select8(codes, table_ptr):
    """table[codes & 7] for the 8 entries at ``table_ptr``: three levels of selects on bits 0, 1, 2."""
    b0, b1, b2 = (codes & 1) != 0, (codes & 2) != 0, (codes & 4) != 0
    t0, t1, t2, t3 = tl.load(table_ptr), tl.load(table_ptr + 1), tl.load(table_ptr + 2), tl.load(table_ptr + 3)
    t4, t5, t6, t7 = tl.load(table_ptr + 4), tl.load(table_ptr + 5), tl.load(table_ptr + 6), tl.load(table_ptr + 7)
    low = tl.where(b1, tl.where(b0, t3, t2), tl.where(b0, t1, t0))
    high = tl.where(b1, tl.where(b0, t7, t6), tl.where(b0, t5, t4))
    return tl.where(b2, high, low)


@triton.jit
def centroid_operands(codes, centroids_ptr, BITS: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """The centroids of ``codes`` (ints 0 .. 2^BITS - 1) as DOT_DTYPE (bf16 / fp16) MMA operands: byte permutes on
    the table words after the fp32 centroids at ``centroids_ptr`` (``lut_words``) when compiled, else the select
    tree and a cast. The same numbers either way: the centroids are exact in both 16-bit dtypes."""
    if NATIVE & ((DOT_DTYPE == tl.bfloat16) | (DOT_DTYPE == tl.float16)):
        words = centroids_ptr.to(tl.pointer_type(tl.int32)) + (1 << BITS) + 4 * (DOT_DTYPE == tl.float16)
        args = [codes.to(tl.uint8), tl.load(words), tl.load(words + 1), tl.load(words + 2), tl.load(words + 3)]
        ptx: tl.constexpr = CENTROID_PTX_4 if BITS == 4 else CENTROID_PTX_3
        if DOT_DTYPE == tl.float16:
            c = tl.inline_asm_elementwise(ptx, CENTROID_CONSTRAINTS, args, dtype=tl.float16, is_pure=True, pack=4)
        else:
            c = tl.inline_asm_elementwise(ptx, CENTROID_CONSTRAINTS, args, dtype=tl.bfloat16, is_pure=True, pack=4)
    else:
        c = centroid_values(codes, centroids_ptr, BITS).to(DOT_DTYPE)
    return c


@triton.jit
def code_floats(codes):
    """Int codes (0 <= code < 2^23) as the fp32 numbers they are, exactly: the code's bits placed in the mantissa
    of 2^23 (an or and a subtraction, cheaper than a conversion instruction). Codes below 2^8 (every packed code)
    are exact in bf16 and fp16 too."""
    return (codes.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def value_code_operands(codes, DOT_DTYPE: tl.constexpr):
    """Codes (ints 0 .. 127) as DOT_DTYPE (bf16 / fp16) MMA operands, exactly: byte permutes and a packed
    subtraction when compiled (module docstring), else ``code_floats`` and a cast."""
    if NATIVE & ((DOT_DTYPE == tl.bfloat16) | (DOT_DTYPE == tl.float16)):
        if DOT_DTYPE == tl.float16:
            v = tl.inline_asm_elementwise(VALUE_PTX_FP16, "=r,=r,r", [codes.to(tl.uint8)], dtype=tl.float16,
                                          is_pure=True, pack=4)  # fmt: skip
        else:
            v = tl.inline_asm_elementwise(VALUE_PTX_BF16, "=r,=r,r", [codes.to(tl.uint8)], dtype=tl.bfloat16,
                                          is_pure=True, pack=4)  # fmt: skip
    else:
        v = code_floats(codes).to(DOT_DTYPE)
    return v
