"""Where the time of a Lloyd-Max key tile goes (issue 14): the key scoring of the decode attention kernel alone, in
variants that each drop or replace one step, on the Qwen3.5-0.8B attention shape (2 kv heads of 256, 4 query heads
each, padded to 16 rows), 4-bit keys, one query row over ``--keys`` keys split 64 ways.

Variants (``VARIANTS``; "codes": how the 4-bit codes reach registers, "lookup": how a code becomes its centroid,
"mma": the products, "norm": the norm correction):

- bf16: the model-dtype cache's key tile and one MMA (the baseline the presets are measured against).
- session12: codes one byte load per element, centroids gathered from a fp32 table in memory, ||c||^2 summed per
  key, hi / lo halves of q and c in three MMAs (kernels/kv_tiles.py before session 13; the engine now runs
  "nibbles+select16+2mma+w").
- the others swap one step at a time: nibble-expanded code bytes (``tile_codes``), a select tree over the 16
  centroids held as scalars (no memory gather), centroids exact in 16 bits (two MMAs: q's halves by c), one MMA
  (q rounded to 16 bits), the correction weight stored per key (no ||c||^2 sum), codes as values (no lookup), or
  the centroid as an odd polynomial of the code (``poly_coefficients``: fused multiply-adds instead of selects).

Each program sums its tiles' scores into its output, so nothing is dead code. Time: ``do_bench_cudagraph``, us
per call; the last table lists every variant at each (block_n, warps).

    python3 benchmarks/lloyd_max_scoring_probe.py [--keys 32768]
"""

import torch
import triton
import triton.language as tl
from probe_timing import probe_args, time_variant

from truespec.kernels.kv_tiles import split_hi_lo
from truespec.kernels.packed_codes import load_fp16, tile_codes, unpack_codes
from truespec.kernels.triton_utils import reduce_sum
from truespec.ops.lloyd_max import lloyd_max_codebook

HKV, GROUP, GROUP_PAD, D, SPLITS = 2, 4, 16, 256, 64
CODE_BYTES, SLOT_BYTES = D // 2, 262  # a turboquant_4bit_nc slot: 128 code bytes, the fp16 scale, the value part
# the same, readable inside @triton.jit code (compiled kernels may read only constexpr globals)
T_HKV, T_GROUP_PAD, T_D = tl.constexpr(HKV), tl.constexpr(GROUP_PAD), tl.constexpr(D)
T_SPLITS, T_BITS = tl.constexpr(SPLITS), tl.constexpr(4)
T_CODE_BYTES, T_SLOT_BYTES = tl.constexpr(CODE_BYTES), tl.constexpr(SLOT_BYTES)
# name: (CODES 0 per element / 1 nibbles / 3 even and odd byte planes, LOOKUP 0 gather fp32 / 1 select tree fp32 /
# 2 select tree 16-bit exact / 3 codes as values / 4 codes as bf16 bits, MMAS 3 / 2 / 1, NORM 0 sum ||c||^2 / 1 stored)
VARIANTS = {
    "session12": (0, 0, 3, 0),
    "nibbles": (1, 0, 3, 0),
    "select": (0, 1, 3, 0),
    "nibbles+select": (1, 1, 3, 0),
    "nibbles+gather+1mma+w": (1, 0, 1, 1),
    "select16+2mma+w": (0, 2, 2, 1),
    "nibbles+select16+2mma+w": (1, 2, 2, 1),
    "nibbles+select16+1mma+w": (1, 2, 1, 1),
    "nibbles+novalues+1mma+w": (1, 3, 1, 1),
    "nibbles+magic16+1mma+w": (1, 4, 1, 1),
    "planes+select16+2mma+w": (3, 2, 2, 1),
    "planes+select16+1mma+w": (3, 2, 1, 1),
    "planes+novalues+1mma+w": (3, 3, 1, 1),
    "planes+magic16+1mma+w": (3, 4, 1, 1),
    "nibbles+poly+2mma+w": (1, 5, 2, 1),
    "nibbles+poly+1mma+w": (1, 5, 1, 1),
}


@triton.jit
def select_tree(codes, t0, t1, t2, t3, t4, t5, t6, t7, t8, t9, t10, t11, t12, t13, t14, t15):
    """Centroid t[code] of each code by a binary tree of 15 selects on the code's bits (no memory access)."""
    b0 = (codes & 1) != 0
    b1 = (codes & 2) != 0
    b2 = (codes & 4) != 0
    b3 = (codes & 8) != 0
    a0 = tl.where(b0, t1, t0)
    a1 = tl.where(b0, t3, t2)
    a2 = tl.where(b0, t5, t4)
    a3 = tl.where(b0, t7, t6)
    a4 = tl.where(b0, t9, t8)
    a5 = tl.where(b0, t11, t10)
    a6 = tl.where(b0, t13, t12)
    a7 = tl.where(b0, t15, t14)
    c0 = tl.where(b1, a1, a0)
    c1 = tl.where(b1, a3, a2)
    c2 = tl.where(b1, a5, a4)
    c3 = tl.where(b1, a7, a6)
    e0 = tl.where(b2, c1, c0)
    e1 = tl.where(b2, c3, c2)
    return tl.where(b3, e1, e0)


@triton.jit
def lookup(codes, LOOKUP: tl.constexpr, table_ptr, t0, t1, t2, t3, t4, t5, t6, t7, t8, t9, t10, t11, t12, t13, t14,
           t15):  # fmt: skip
    if LOOKUP == 0:
        c = tl.load(table_ptr + codes)
    elif LOOKUP == 3:
        c = codes.to(tl.float32)
    elif LOOKUP == 4:  # 128 + code as bf16 bits: no conversion instruction
        c = (codes | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True).to(tl.float32)
    elif LOOKUP == 5:  # c = u * P(u^2), u = code - 7.5: the odd interpolating polynomial, 7 fused multiply-adds
        u = ((codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0) - 7.5
        t = u * u
        p = tl.load(table_ptr + 39)
        p = p * t + tl.load(table_ptr + 38)
        p = p * t + tl.load(table_ptr + 37)
        p = p * t + tl.load(table_ptr + 36)
        p = p * t + tl.load(table_ptr + 35)
        p = p * t + tl.load(table_ptr + 34)
        p = p * t + tl.load(table_ptr + 33)
        p = p * t + tl.load(table_ptr + 32)
        c = u * p
    else:
        c = select_tree(codes, t0, t1, t2, t3, t4, t5, t6, t7, t8, t9, t10, t11, t12, t13, t14, t15)
    return c


@triton.jit
def plane_scores(qa, qb, c, MMAS: tl.constexpr):
    if MMAS == 2:
        c16 = c.to(tl.bfloat16)
        return tl.dot(qa, tl.trans(c16)) + tl.dot(qb, tl.trans(c16))
    return tl.dot(qa, tl.trans(c.to(tl.bfloat16)))


@triton.jit
def _probe_kernel(out_ptr, q_ptr, packed_ptr, bf16_ptr, table_ptr, weight_ptr, split_size,
                  BLOCK_N: tl.constexpr, BF16: tl.constexpr, CODES: tl.constexpr, LOOKUP: tl.constexpr,
                  MMAS: tl.constexpr, NORM: tl.constexpr):  # fmt: skip
    head = tl.program_id(0)
    split = tl.program_id(1)
    g = tl.arange(0, T_GROUP_PAD)
    d = tl.arange(0, T_D)
    n0 = tl.arange(0, BLOCK_N)
    q = tl.load(q_ptr + (head * T_GROUP_PAD + g[:, None]) * T_D + d[None, :])  # fp32 rotated q
    q_hi, q_lo = split_hi_lo(q, tl.bfloat16)
    h = tl.arange(0, T_D // 2)
    q_even = tl.load(q_ptr + (head * T_GROUP_PAD + g[:, None]) * T_D + 2 * h[None, :])
    q_odd = tl.load(q_ptr + (head * T_GROUP_PAD + g[:, None]) * T_D + 2 * h[None, :] + 1)
    qe_hi, qe_lo = split_hi_lo(q_even, tl.bfloat16)
    qo_hi, qo_lo = split_hi_lo(q_odd, tl.bfloat16)
    tb = table_ptr if LOOKUP != 2 else table_ptr + 16  # the second table: 16-bit-exact values
    t0, t1, t2, t3 = tl.load(tb + 0), tl.load(tb + 1), tl.load(tb + 2), tl.load(tb + 3)
    t4, t5, t6, t7 = tl.load(tb + 4), tl.load(tb + 5), tl.load(tb + 6), tl.load(tb + 7)
    t8, t9, t10, t11 = tl.load(tb + 8), tl.load(tb + 9), tl.load(tb + 10), tl.load(tb + 11)
    t12, t13, t14, t15 = tl.load(tb + 12), tl.load(tb + 13), tl.load(tb + 14), tl.load(tb + 15)
    total = tl.full([T_GROUP_PAD, BLOCK_N], 0, tl.float32)
    for start in range(split * split_size, (split + 1) * split_size, BLOCK_N):
        n = start + n0
        n_mask = n >= 0
        if BF16:
            k = tl.load(bf16_ptr + ((n * T_HKV + head) * T_D)[:, None] + d[None, :])
            s = tl.dot(q_hi, tl.trans(k))
        else:
            slot_ptr = packed_ptr + (n.to(tl.int64) * T_HKV + head) * T_SLOT_BYTES
            kv_mask = n_mask[:, None] & (d[None, :] < T_D)
            if CODES == 3:  # byte planes: even dims in the low nibbles, odd dims in the high ones; never joined
                byte = tl.load(slot_ptr[:, None] + h[None, :]).to(tl.int32)
                c_even = lookup(byte & 15, LOOKUP, table_ptr, t0, t1, t2, t3, t4, t5, t6, t7, t8, t9, t10, t11, t12,
                                t13, t14, t15)  # fmt: skip
                c_odd = lookup(byte >> 4, LOOKUP, table_ptr, t0, t1, t2, t3, t4, t5, t6, t7, t8, t9, t10, t11, t12,
                               t13, t14, t15)  # fmt: skip
                s = plane_scores(qe_hi, qe_lo, c_even, MMAS) + plane_scores(qo_hi, qo_lo, c_odd, MMAS)
                s = s * tl.load(weight_ptr + n * T_HKV + head)[None, :]
            else:
                s = tile_scores(slot_ptr, n_mask, d, kv_mask, q_hi, q_lo, table_ptr, weight_ptr, n, head, CODES,
                                LOOKUP, MMAS, NORM, t0, t1, t2, t3, t4, t5, t6, t7, t8, t9, t10, t11, t12, t13, t14,
                                t15)  # fmt: skip
        total += s
    tl.store(out_ptr + ((head * T_SPLITS + split) * T_GROUP_PAD + g[:, None]) * BLOCK_N + n0[None, :], total)


@triton.jit
def tile_scores(slot_ptr, n_mask, d, kv_mask, q_hi, q_lo, table_ptr, weight_ptr, n, head, CODES: tl.constexpr,
                LOOKUP: tl.constexpr, MMAS: tl.constexpr, NORM: tl.constexpr, t0, t1, t2, t3, t4, t5, t6, t7, t8, t9,
                t10, t11, t12, t13, t14, t15):  # fmt: skip
    if CODES == 0:
        codes = unpack_codes(slot_ptr[:, None], d[None, :], kv_mask, T_BITS, T_CODE_BYTES)
    else:
        codes = tile_codes(slot_ptr, n_mask, d, kv_mask, T_BITS, T_CODE_BYTES, T_D)
    c = lookup(codes, LOOKUP, table_ptr, t0, t1, t2, t3, t4, t5, t6, t7, t8, t9, t10, t11, t12, t13, t14, t15)
    if NORM == 0:
        w = load_fp16(slot_ptr + T_CODE_BYTES, n_mask, True) / tl.sqrt(reduce_sum(c * c, 1))
    else:
        w = tl.load(weight_ptr + n * T_HKV + head)
    if MMAS == 3:
        c_hi, c_lo = split_hi_lo(c, tl.bfloat16)
        s = tl.dot(q_hi, tl.trans(c_hi)) + tl.dot(q_hi, tl.trans(c_lo)) + tl.dot(q_lo, tl.trans(c_hi))
    elif MMAS == 2:
        c16 = c.to(tl.bfloat16)
        s = tl.dot(q_hi, tl.trans(c16)) + tl.dot(q_lo, tl.trans(c16))
    else:
        s = tl.dot(q_hi, tl.trans(c.to(tl.bfloat16)))
    return s * w[None, :]


def poly_coefficients(head_dim: int = D) -> torch.Tensor:
    """The 8 coefficients a_j (float32) of c(code) = u * sum_j a_j (u^2)^j, u = code - 7.5, through the 4-bit codebook's
    16 centroids (odd: 8 magnitudes). Evaluated in fp32 the values lie within 3e-6 (relative) of the centroids, far
    inside half a bf16 ulp: rounded to bf16 they are the centroids exactly (checked here)."""
    centroids = lloyd_max_codebook(head_dim, 4)[0].double()
    u = torch.arange(8, dtype=torch.float64) + 0.5
    coefficients = torch.linalg.solve(torch.vander(u * u, 8, increasing=True), centroids[8:] / u).float()
    x = torch.arange(16, dtype=torch.float32) - 7.5
    p = torch.zeros(16)
    for a in coefficients.flip(0):
        p = p * (x * x) + a
    assert torch.equal((x * p).to(torch.bfloat16).float(), centroids.float())
    return coefficients


def main() -> None:
    args, dev = probe_args(__doc__)
    gen = torch.Generator().manual_seed(0)
    keys = args.keys
    q = torch.randn(HKV, GROUP_PAD, D, generator=gen).to(dev) * 0.06
    packed = torch.randint(0, 256, (keys, HKV, SLOT_BYTES), dtype=torch.uint8, generator=gen).to(dev)
    packed[:, :, CODE_BYTES:CODE_BYTES + 2] = torch.full((keys, HKV), 1.0, dtype=torch.float16).view(torch.uint8).view(
        keys, HKV, 2).to(dev)  # norm 1.0
    bf16 = torch.randn(keys, HKV, D, generator=gen).to(torch.bfloat16).to(dev)
    table = torch.linspace(-2.7, 2.7, 16) / D**0.5
    table = torch.cat([table, table.to(torch.bfloat16).float(), poly_coefficients()]).to(dev)
    weight = torch.rand(keys, HKV, generator=gen).to(dev) + 0.5
    rows = []
    where = "interpreter" if args.check else torch.cuda.get_device_name()
    print(f"{where}  4-bit Lloyd-Max key scoring only, {keys} keys, {HKV} kv heads x {GROUP} q heads, head_dim {D}, "
          f"{SPLITS} splits; us per call (graph replay)", flush=True)
    for block_n, warps in [(32, 4)] if args.check else [(32, 4), (64, 8), (64, 4), (32, 8)]:
        out = torch.empty(HKV, SPLITS, GROUP_PAD, block_n, device=dev)
        for name, (codes, lookup, mmas, norm) in {"bf16": (0, 0, 1, 1), **VARIANTS}.items():
            def call(n=name, c=codes, lk=lookup, mm=mmas, no=norm, bn=block_n, w=warps, out=out):
                _probe_kernel[(HKV, SPLITS)](out, q, packed, bf16, table, weight, keys // SPLITS, BLOCK_N=bn,
                                            BF16=n == "bf16", CODES=c, LOOKUP=lk, MMAS=mm, NORM=no, num_warps=w)
            us = time_variant(call, out, args.check, f"{name} {block_n}/{warps}")
            if us is None:
                continue
            rows.append((block_n, warps, name, us))
            if not args.check:
                print(f"  block_n {block_n:3d} warps {warps}  {name:26s} {us:8.1f} us", flush=True)
    print("\nblock_n warps variant                          us   x bf16")
    base = {(b, w): us for b, w, n, us in rows if n == "bf16"}
    for block_n, warps, name, us in rows:
        print(f"{block_n:7d} {warps:5d} {name:28s} {us:8.1f} {base[(block_n, warps)] / us:7.2f}")


if __name__ == "__main__":
    main()
