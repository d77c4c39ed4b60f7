"""Where a 4-bit uniform value tile's time goes (issue 14): the ``p @ V`` half of the decode attention kernel alone,
on the Qwen3.5-0.8B attention shape (2 kv heads of 256, 4 query heads each, padded to 16 rows), one query row over
``--keys`` keys split 64 ways, in variants that each add one step of ``kernels/kv_tiles.py`` ``tile_pv``'s
interleaved path (the engine's path until the split kernel took the planes form, ``uniform_planes_pv``).

Variants (``VARIANTS``): bf16 values (one MMA, the model-dtype cache); fp8 bytes widened; 4-bit codes
(nibble-expanded, ``tile_codes``) as numbers via ``code_floats`` or the byte permutes (``value_code_operands``),
with no scale or zero; + the per-key fp16 scale folded into p; + the zero point's row sum (``tile_pv``'s whole
interleaved tile); and the codes' two nibble planes multiplied apart (two MMAs into two half-width accumulators:
no interleave). Weights p are a fixed random tile, so only the value side differs. Each program stores its
accumulator, so nothing is dead code. Time: ``do_bench_cudagraph``, us per call.

    python3 benchmarks/uniform_values_probe.py [--keys 32768] [--check]
"""

import torch
import triton
import triton.language as tl
from probe_timing import probe_args, time_variant

from truespec.kernels.code_operands import code_floats, value_code_operands
from truespec.kernels.kv_tiles import UNIFORM, tile_pv
from truespec.kernels.packed_codes import load_fp8, load_fp16, tile_codes
from truespec.kernels.triton_utils import reduce_sum

HKV, GROUP_PAD, D, SPLITS = 2, 16, 256, 64
CODE_BYTES = D // 2
SLOT_BYTES = CODE_BYTES + 4  # 4-bit codes, fp16 scale, fp16 zero (a turboquant value part)
T_HKV, T_GROUP_PAD, T_D, T_SPLITS = tl.constexpr(HKV), tl.constexpr(GROUP_PAD), tl.constexpr(D), tl.constexpr(SPLITS)
T_CODE_BYTES, T_SLOT_BYTES, T_UNIFORM = tl.constexpr(CODE_BYTES), tl.constexpr(SLOT_BYTES), tl.constexpr(UNIFORM)
T_BITS = tl.constexpr(4)
VARIANTS = {"bf16": 0, "fp8": 1, "codes (code_floats)": 2, "codes (permutes)": 3, "+ scale": 4,
            "+ zero (interleaved tile_pv)": 5, "nibble planes, 2 MMAs": 6}  # fmt: skip


@triton.jit
def _probe_kernel(out_ptr, p_ptr, packed_ptr, bf16_ptr, fp8_ptr, split_size, BLOCK_N: tl.constexpr,
                  VARIANT: tl.constexpr):  # fmt: skip
    head = tl.program_id(0)
    split = tl.program_id(1)
    g = tl.arange(0, T_GROUP_PAD)
    d = tl.arange(0, T_D)
    h = tl.arange(0, T_D // 2)
    n0 = tl.arange(0, BLOCK_N)
    p = tl.load(p_ptr + g[:, None] * BLOCK_N + n0[None, :])  # fp32 weights [GROUP_PAD, BLOCK_N]
    acc = tl.full([T_GROUP_PAD, T_D], 0, tl.float32)
    acc_lo = tl.full([T_GROUP_PAD, T_D // 2], 0, tl.float32)
    acc_hi = tl.full([T_GROUP_PAD, T_D // 2], 0, tl.float32)
    for start in range(split * split_size, (split + 1) * split_size, BLOCK_N):
        n = start + n0
        n_mask = n >= 0
        kv_mask = n_mask[:, None] & (d[None, :] < T_D)
        row = (n.to(tl.int64) * T_HKV + head)[:, None]
        slot_ptr = packed_ptr + (n.to(tl.int64) * T_HKV + head) * T_SLOT_BYTES
        if VARIANT == 0:
            v = tl.load(bf16_ptr + row * T_D + d[None, :])
            acc = tl.dot(p.to(tl.bfloat16), v, acc)
        elif VARIANT == 1:
            v = load_fp8(fp8_ptr + row * T_D + d[None, :], kv_mask).to(tl.bfloat16)
            acc = tl.dot(p.to(tl.bfloat16), v, acc)
        elif VARIANT <= 4:
            codes = tile_codes(slot_ptr, n_mask, d, kv_mask, T_BITS, T_CODE_BYTES, T_D)
            if VARIANT == 2:  # noqa: SIM108 (a constexpr branch)
                v = code_floats(codes).to(tl.bfloat16)
            else:
                v = value_code_operands(codes, tl.bfloat16)
            w = p
            if VARIANT == 4:
                w = p * load_fp16(slot_ptr + T_CODE_BYTES, n_mask, True)[None, :]
            acc = tl.dot(w.to(tl.bfloat16), v, acc)
        elif VARIANT == 5:
            acc += tile_pv(p, packed_ptr, (n.to(tl.int64) * T_HKV + head) * T_SLOT_BYTES, d, n_mask, kv_mask,
                           T_UNIFORM, T_BITS, T_CODE_BYTES, T_D, True, tl.float32, tl.bfloat16, False)  # fmt: skip
        else:
            byte = tl.load(slot_ptr[:, None] + h[None, :])
            w = (p * load_fp16(slot_ptr + T_CODE_BYTES, n_mask, True)[None, :]).to(tl.bfloat16)
            acc_lo = tl.dot(w, value_code_operands(byte & 15, tl.bfloat16), acc_lo)
            acc_hi = tl.dot(w, value_code_operands(byte >> 4, tl.bfloat16), acc_hi)
    total = reduce_sum(acc, 1) + reduce_sum(acc_lo, 1) + reduce_sum(acc_hi, 1)
    tl.store(out_ptr + (head * T_SPLITS + split) * T_GROUP_PAD + g, total)


def main() -> None:
    args, dev = probe_args(__doc__)
    gen = torch.Generator().manual_seed(0)
    keys = args.keys
    packed = torch.randint(0, 256, (keys, HKV, SLOT_BYTES), dtype=torch.uint8, generator=gen)
    packed[:, :, CODE_BYTES:] = torch.tensor([0.01, -0.05], dtype=torch.float16).view(torch.uint8)
    packed = packed.to(dev)
    bf16 = torch.randn(keys, HKV, D, generator=gen).to(torch.bfloat16).to(dev)
    fp8 = torch.randn(keys, HKV, D, generator=gen).to(torch.float8_e4m3fn).view(torch.uint8).to(dev)
    where = "interpreter" if args.check else torch.cuda.get_device_name()
    print(f"{where}  4-bit uniform value tiles only (p @ V), {keys} keys, {HKV} kv heads x 4 q heads padded to "
          f"{GROUP_PAD}, head_dim {D}, {SPLITS} splits; us per call (graph replay)", flush=True)
    rows = []
    for block_n, warps in [(32, 4)] if args.check else [(32, 4), (32, 8), (64, 4)]:
        p = torch.rand(GROUP_PAD, block_n, generator=gen).to(dev)
        out = torch.empty(HKV, SPLITS, GROUP_PAD, device=dev)
        for name, variant in VARIANTS.items():
            def call(v=variant, bn=block_n, w=warps, p=p, out=out):
                _probe_kernel[(HKV, SPLITS)](out, p, packed, bf16, fp8, keys // SPLITS, BLOCK_N=bn, VARIANT=v,
                                             num_warps=w)  # fmt: skip
            us = time_variant(call, out, args.check, f"{name} {block_n}/{warps}")
            if us is None:
                continue
            rows.append((block_n, warps, name, us))
            if not args.check:
                print(f"  block_n {block_n:3d} warps {warps}  {name:28s} {us:8.1f} us", flush=True)
    if args.check:
        for block_n, warps, name, value in rows:
            print(f"  block_n {block_n:3d} warps {warps}  {name:28s} ran (|out| {value:.3g})")


if __name__ == "__main__":
    main()
