"""One attention layer's prefill, three ways, on the GPU: the split-KV kernel the engine runs today for prefill
rows (``paged_attention``), the tiled prefill kernel (``prefill_attention``) and torch's SDPA on contiguous K / V
(FlashAttention when torch has it: the bound to reach, without a paged cache). Qwen3.5-0.8B attention shape
(8 query / 2 kv heads of 256), bf16, block size 16, whole prompts as one chunk.

    python3 benchmarks/prefill_attention_speed.py [--prompts 512 8192 32768] [--batch-sizes 1 8] [--json FILE]
    python3 benchmarks/prefill_attention_speed.py --tune [--prompts 8192] [--kv-dtypes auto fp8 ...]  # block sizes

Prints ms per call (``triton.testing.do_bench``, median) and achieved TFLOP/s (causal: 2 * 2 * heads * D * L^2 / 2
per prompt) and a markdown table last.
"""

import argparse
import functools
import itertools
import json

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from truespec.kernels.paged_attention import paged_attention
from truespec.kernels.prefill_attention import prefill_attention
from truespec.kv_cache.formats import FORMATS, KVFormat

HEADS, KV_HEADS, D, BLOCK = 8, 2, 256, 16


def prompt_batch(prompt: int, batch_size: int, fmt: KVFormat | None = None) -> tuple:
    """(q, kv_cache, query_start_loc, seq_lens, block_tables, scale): ``batch_size`` whole prompts of ``prompt``
    tokens, as one chunk each, over a bf16 cache (``fmt``: a packed one of random bytes: timing does not depend on
    the values)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    blocks_per = -(-prompt // BLOCK)
    if fmt is None:
        cache = torch.randn(2, batch_size * blocks_per, BLOCK, KV_HEADS, D, device="cuda", dtype=torch.bfloat16,
                            generator=gen)  # fmt: skip
    else:
        shape = (batch_size * blocks_per, BLOCK, KV_HEADS, fmt.bytes_per_token(D))
        cache = torch.randint(0, 256, shape, device="cuda", dtype=torch.uint8, generator=gen)
    q = torch.randn(batch_size * prompt, HEADS, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    qsl = torch.arange(batch_size + 1, device="cuda") * prompt
    seq_lens = torch.full((batch_size,), prompt, device="cuda")
    tables = torch.arange(batch_size * blocks_per, device="cuda").view(batch_size, blocks_per)
    return q, cache, qsl, seq_lens, tables, D**-0.5


def causal_flops(prompt: int, batch_size: int) -> int:
    return batch_size * 2 * HEADS * D * prompt * prompt  # QK^T + PV over the causal half


def measure(prompt: int, batch_size: int) -> dict[str, float]:
    args = prompt_batch(prompt, batch_size)
    q, cache = args[:2]
    k = cache[0].view(batch_size, -1, KV_HEADS, D)[:, :prompt].transpose(1, 2).repeat_interleave(HEADS // KV_HEADS, 1)
    v = cache[1].view(batch_size, -1, KV_HEADS, D)[:, :prompt].transpose(1, 2).repeat_interleave(HEADS // KV_HEADS, 1)
    qb = q.view(batch_size, prompt, HEADS, D).transpose(1, 2)
    flops = causal_flops(prompt, batch_size)
    # seconds per call: triton's do_bench (warm-up, then the median of timed calls, its L2 cache flushed between)
    times = {name: do_bench(fn, return_mode="median") / 1e3 for name, fn in (
        ("split_kv", lambda: paged_attention(*args)), ("prefill", lambda: prefill_attention(*args)),
        ("sdpa", lambda: F.scaled_dot_product_attention(qb, k, v, is_causal=True)))}  # fmt: skip
    ref, out = paged_attention(*args).float(), prefill_attention(*args).float()
    return {"max_abs_diff": (ref - out).abs().max().item(),
            **{f"{name}_ms": t * 1e3 for name, t in times.items()},
            **{f"{name}_tflops": flops / t / 1e12 for name, t in times.items()}}  # fmt: skip


def tune(prompt: int, batch_size: int, kv_dtype: str) -> None:
    """Times the prefill kernel over (BLOCK_M, BLOCK_N, warps, stages) on a ``kv_dtype`` cache ("auto": bf16) and
    prints the ranking, fastest first."""
    fmt = None if kv_dtype == "auto" else FORMATS[kv_dtype]
    args, flops = prompt_batch(prompt, batch_size, fmt), causal_flops(prompt, batch_size)
    results = []
    for block_m, block_n, warps, stages in itertools.product((16, 32), (32, 64), (4, 8), (1, 2, 3)):
        fn = functools.partial(prefill_attention, *args, fmt=fmt, config=(block_m, block_n, warps, stages))
        try:
            ms = do_bench(fn, return_mode="median")
        except Exception as e:  # out of shared memory / registers: not a candidate
            print(f"BLOCK_M={block_m} BLOCK_N={block_n} warps={warps} stages={stages}: {type(e).__name__}")
            continue
        results.append((ms, block_m, block_n, warps, stages))
    print(f"\n{torch.cuda.get_device_name()}: prefill kernel, {kv_dtype}, prompt {prompt}, BS {batch_size}, "
          "fastest first")  # fmt: skip
    for ms, block_m, block_n, warps, stages in sorted(results)[:6]:
        print(f"BLOCK_M={block_m} BLOCK_N={block_n} warps={warps} stages={stages}: {ms:.3f} ms "
              f"({flops / ms / 1e9:.0f} TFLOP/s)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, nargs="+", default=[512, 8192, 32768])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--json", default=None)
    parser.add_argument("--tune", action="store_true", help="sweep the prefill kernel's block sizes instead")
    parser.add_argument("--kv-dtypes", nargs="+", default=["auto"], help="caches --tune sweeps (kv_cache_dtype)")
    args = parser.parse_args()
    if args.tune:
        for kv_dtype in args.kv_dtypes:
            for prompt in args.prompts:
                tune(prompt, args.batch_sizes[0], kv_dtype)
        return
    rows = {}
    for prompt in args.prompts:
        for bs in args.batch_sizes:
            rows[f"{prompt}/{bs}"] = r = measure(prompt, bs)
            print(f"prompt={prompt} BS={bs}: {r}", flush=True)
    print(f"\n{torch.cuda.get_device_name()}: one attention layer's prefill, ms (TFLOP/s)")
    print("| prompt, BS | split-KV kernel | prefill kernel | torch SDPA | max abs diff |")
    print("|---|---:|---:|---:|---:|")
    for key, r in rows.items():
        cells = [f"{r[f'{n}_ms']:.2f} ({r[f'{n}_tflops']:.0f})" for n in ("split_kv", "prefill", "sdpa")]
        print(f"| {key.replace('/', ', ')} | " + " | ".join(cells) + f" | {r['max_abs_diff']:.1e} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
