"""The packed-cache store (kernels/kv_store_packed.py) per call, per ``kv_cache_dtype`` and launch variant.

    python3 benchmarks/kv_store_speed.py [--tokens 1 8 64 2048] [--kv-cache-dtypes ...] [--old-src DIR]

The Qwen3.5-0.8B attention shape (2 kv heads of 256, bf16 rows, block size 16), random rows stored into random
distinct slots of a 4096-block cache, timed with ``triton.testing.do_bench_cudagraph`` (replays of a captured graph,
as in the engine's decode step), us per call. Variants: (``code_block``, ``num_warps``); the first row of each dtype
is the engine's default; the last column counts the slots (token, kv head) where a variant's bytes differ from it.
``--old-src``: another checkout's ``src`` tree, whose ``store_packed`` (its defaults) is timed beside ours as the
row ``old``; its bytes may differ from ours where a key's rotated coordinate lies within fp32 rounding of a decision
boundary (kernels/kv_store_packed.py), and such slots are counted. Prints a markdown table last.
"""

import argparse
import functools

import torch
import triton
from packed_attention_speed import import_src_tree

from truespec.kernels.kv_store_packed import CODE_BLOCK, NUM_WARPS, store_packed
from truespec.kv_cache.formats import FORMATS

HKV, D, BLOCK, NUM_BLOCKS = 2, 256, 16, 4096
PACKED = ["fp8", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"]
VARIANTS = [(CODE_BLOCK, NUM_WARPS), (CODE_BLOCK, 8), (CODE_BLOCK, 2), (64, 4), (64, 8), (16, 4), "old"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 2048])
    parser.add_argument("--kv-cache-dtypes", nargs="+", default=PACKED)
    parser.add_argument("--old-src", default=None, help="another checkout's src: its store_packed beside ours")
    args = parser.parse_args()
    old_store = import_src_tree(args.old_src, ("truespec.kernels.kv_store_packed",))[0] if args.old_src else None
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name in args.kv_cache_dtypes:
        fmt = FORMATS[name]
        cache = torch.zeros(NUM_BLOCKS, BLOCK, HKV, fmt.bytes_per_token(D), dtype=torch.uint8, device="cuda")
        variants = [v for v in VARIANTS if v != "old" or old_store is not None]
        for tokens in args.tokens:
            k = torch.randn(tokens, HKV, D, generator=gen, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(tokens, HKV, D, generator=gen, device="cuda", dtype=torch.bfloat16)
            slots = torch.randperm(NUM_BLOCKS * BLOCK, generator=gen, device="cuda")[:tokens]
            default = None
            for variant in variants:
                if variant == "old":
                    store = functools.partial(old_store.store_packed, k, v, cache, slots, fmt)
                else:
                    store = functools.partial(store_packed, k, v, cache, slots, fmt, code_block=variant[0],
                                              num_warps=variant[1])  # fmt: skip
                cache.zero_()
                store()
                written = cache.clone()
                default = written if default is None else default
                differ = int((written != default).flatten(2).any(-1).sum())  # slots (token, head) that differ
                us = triton.testing.do_bench_cudagraph(store) * 1e3
                rows.append((name, tokens, variant, us, differ))
                print(rows[-1], flush=True)
    print(f"\n{torch.cuda.get_device_name()}: store_packed us per call, {HKV} kv heads of {D}, bf16 rows")
    print("| kv_cache_dtype | tokens | variant (code_block, warps) | us | slots not the default's bytes |")
    print("|---|---:|---|---:|---:|")
    for name, tokens, variant, us, differ in rows:
        print(f"| {name} | {tokens} | {variant} | {us:.1f} | {differ} |")


if __name__ == "__main__":
    main()
