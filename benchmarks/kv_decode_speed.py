"""Decode speed per ``kv_cache_dtype`` at long context: the whole model's decode step and the attention kernel alone.

    python3 benchmarks/kv_decode_speed.py --model DIR [--contexts 8192 32768] [--batch-sizes 1 8]
        [--kv-cache-dtypes auto fp8 turboquant_k8v4 ...] [--max-splits 16 64 128] [--sparse-v-threshold T]
        [--kernels N] [--json FILE]

Decode time does not depend on what the cache holds, so no prompt is prefilled: each request's context is a run of
blocks filled with random bytes (random normal K/V for ``auto``; for packed formats random codes, fp8 bytes
that are NaN patterns replaced), and a decode step at position ``context`` is replayed through the engine's CUDA
graph of its batch size (``GraphRunner.run``: the host's metadata copy plus the replay; no sampling), with the
engine's split cap (``MAX_SPLITS``). The kernel rows time the attention read (``paged_attention`` /
``paged_attention_packed``) over the same caches, once per split cap of ``--max-splits``: one call per attention
layer, each over its own cache (so that a layer's K/V is not still in L2 from its previous call, as in the model),
replayed as one CUDA graph (``triton.testing.do_bench_cudagraph``: no host launch cost), and report us per call,
the ratio to ``auto`` at the same cap (above 1.0x: faster than the bf16 cache) and the bytes of K/V the call must
read per second, beside the card's copy bandwidth (a 1 GiB device-to-device copy, read + write counted). Prints a
markdown table of the steps and one of the kernel per cap last. ``--kernels N``: where a step's GPU time goes, the
N kernels with the most device time per step (torch.profiler over the step's graph replays), per dtype and shape.
"""

import argparse
import functools
import json
import time
from collections.abc import Callable

import torch
import triton
from torch.profiler import ProfilerActivity, profile

from truespec import LLM
from truespec.kernels import paged_attention, paged_attention_packed
from truespec.kernels.paged_attention import MAX_SPLITS
from truespec.worker.input_builder import ContextRow

DTYPES = ["auto", "fp8", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"]


def _fill_random(layer: torch.nn.Module, gen: torch.Generator) -> None:
    cache = layer.kv_cache
    if layer.kv_format is None:
        cache.copy_(torch.randn(cache.shape, generator=gen, device=cache.device, dtype=cache.dtype))
        return
    cache.copy_(torch.randint(0, 256, cache.shape, generator=gen, device=cache.device, dtype=torch.uint8))
    cache[(cache & 0x7F) == 0x7F] = 0  # fp8 e4m3 NaN patterns (harmless elsewhere: any byte is a valid code)


def _time(fn, iters: int) -> float:
    """Mean seconds per call, after two warm-up calls."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device copy (read + write)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / _time(lambda: dst.copy_(src), 20)


def attention_calls(llm: LLM, tables: torch.Tensor, context: int, threshold: float | None, max_splits: int
                    ) -> tuple[list[Callable[[], torch.Tensor]], int]:  # fmt: skip
    """One decode row per table row at position ``context``: each attention layer's kernel call over its own cache,
    and the bytes of K/V those calls must read."""
    engine = llm.llm_engine
    batch_size = tables.shape[0]
    meta = (torch.arange(batch_size + 1, device="cuda", dtype=torch.int32),
            torch.full((batch_size,), context + 1, device="cuda", dtype=torch.int32), tables)  # fmt: skip
    options = dict(sparse_v_threshold=threshold, max_splits=max_splits)
    calls, kv_bytes = [], 0
    for layer in engine.loaded.model.attention_layers():
        head_dim = layer.head_dim
        q = torch.randn(batch_size, layer.num_heads, head_dim, device="cuda", dtype=engine.dtype)
        if layer.kv_format is None:
            calls.append(functools.partial(paged_attention, q, layer.kv_cache, *meta, layer.scale, **options))
            slot_bytes = 2 * head_dim * layer.kv_cache.element_size()
        else:
            calls.append(functools.partial(paged_attention_packed, q, layer.kv_cache, *meta, layer.scale,
                                           layer.kv_format, head_dim, **options))  # fmt: skip
            slot_bytes = layer.kv_format.bytes_per_token(head_dim)
        kv_bytes += batch_size * (context + 1) * layer.num_kv_heads * slot_bytes
    return calls, kv_bytes


def step_kernels(step: Callable[[], object], iters: int, top: int) -> list[tuple[str, float, float]]:
    """The ``top`` kernels by device time over ``iters`` calls of ``step``: (name, us per step, calls per step)."""
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    rows = [(e.key[:60], e.self_device_time_total / iters, e.count / iters) for e in prof.key_averages()
            if e.self_device_time_total > 0]  # fmt: skip
    rows.sort(key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    return [("all kernels", total, sum(r[2] for r in rows))] + rows[:top]


def measure(llm: LLM, context: int, batch_size: int, iters: int, threshold: float | None,
            caps: list[int], top: int) -> dict[str, object]:  # fmt: skip
    engine = llm.llm_engine
    graphs, block_size = engine.runner.graphs, engine.cache_config.block_size
    blocks_per_req = -(-(context + 1) // block_size)
    rows = [ContextRow(list(range(i * blocks_per_req, (i + 1) * blocks_per_req)), context, 1, -1, -1, 0, 1)
            for i in range(batch_size)]
    step = functools.partial(graphs.run, rows, [1] * batch_size, [context] * batch_size, decode_only=True)
    step_s = _time(step, iters)
    kernels = step_kernels(step, iters, top) if top else []
    for name, us, calls in kernels:
        print(f"    {us:8.1f} us {calls:5.1f} calls  {name}")
    tables = torch.tensor([r.block_ids for r in rows], device="cuda", dtype=torch.int32)
    by_cap = {}
    for cap in caps:
        calls, kv_bytes = attention_calls(llm, tables, context, threshold, cap)
        kernel_s = triton.testing.do_bench_cudagraph(lambda c=calls: [call() for call in c]) / 1e3 / len(calls)
        by_cap[cap] = {"attn_us": kernel_s * 1e6, "attn_gbps": kv_bytes / len(calls) / kernel_s / 1e9}
    return {"step_ms": step_s * 1e3, **by_cap[caps[0]], "by_max_splits": by_cap, "kernels": kernels}


def kernel_table(results: dict[str, dict[str, dict]], keys: list[str], caps: list[int], bandwidth: float) -> None:
    """One attention call per (dtype, split cap): us (x auto at the same cap), GB/s of K/V (% of copy)."""
    print("\nattention per call by split cap: us (x auto at the same cap), GB/s of K/V (% of copy)")
    print("| kv_cache_dtype | max_splits | " + " | ".join(f"ctx {k.replace('/', ', BS ')}" for k in keys) + " |")
    print("|---|---:|" + "---:|" * len(keys))
    for dtype, by_key in results.items():
        for cap in caps:
            cells = []
            for k in keys:
                r, base = by_key[k]["by_max_splits"][cap], results.get("auto", {}).get(k)
                ratio = f" ({base['by_max_splits'][cap]['attn_us'] / r['attn_us']:.2f}x)" if base else ""
                cells.append(f"{r['attn_us']:.1f}{ratio}, {r['attn_gbps']:.0f} GB/s "
                             f"({100 * r['attn_gbps'] * 1e9 / bandwidth:.0f}%)")  # fmt: skip
            print(f"| {dtype} | {cap} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--kv-cache-dtypes", nargs="+", default=DTYPES)
    parser.add_argument("--max-splits", type=int, nargs="+", default=[MAX_SPLITS],
                        help=f"split caps the kernel rows time (default: the engine's, {MAX_SPLITS})")
    parser.add_argument("--sparse-v-threshold", type=float, default=None, help="kernel rows only (default off)")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--kernels", type=int, default=0, help="print the N kernels with the most time per step")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    max_len = max(args.contexts) + 64
    results: dict[str, dict[str, dict]] = {}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for dtype in args.kv_cache_dtypes:
        llm = LLM(args.model, dtype="bfloat16", device="cuda", kv_cache_dtype=dtype, max_model_len=max_len,
                  max_num_seqs=max(args.batch_sizes), max_num_batched_tokens=2048,
                  compilation_config={"max_cudagraph_capture_size": max(args.batch_sizes)},
                  enable_prefix_caching=False)
        for layer in llm.llm_engine.loaded.model.attention_layers():
            _fill_random(layer, gen)
        results[dtype] = {}
        for context in args.contexts:
            for bs in args.batch_sizes:
                print(f"{dtype} ctx={context} BS={bs}:", flush=True)
                r = results[dtype][f"{context}/{bs}"] = measure(llm, context, bs, args.iters, args.sparse_v_threshold,
                                                                args.max_splits, args.kernels)  # fmt: skip
                print(f"  {dict((k, v) for k, v in r.items() if k != 'kernels')}", flush=True)
        del llm
        torch.cuda.empty_cache()
    keys = [f"{c}/{b}" for c in args.contexts for b in args.batch_sizes]
    print(f"\n{torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    kernel_table(results, keys, args.max_splits, bandwidth)
    print(f"\ndecode step ms with the engine's cap {MAX_SPLITS} (x auto) | attention us at cap {args.max_splits[0]}, "
          f"GB/s of K/V (% of copy)")
    print("| kv_cache_dtype | " + " | ".join(f"ctx {k.replace('/', ', BS ')}" for k in keys) + " |")
    print("|---|" + "---:|" * len(keys))
    for dtype, by_key in results.items():
        cells = []
        for k in keys:
            r, base = by_key[k], results.get("auto", {}).get(k)
            ratio = f" ({base['step_ms'] / r['step_ms']:.2f}x)" if base else ""
            cells.append(f"{r['step_ms']:.3f}{ratio} / {r['attn_us']:.0f} us, {r['attn_gbps']:.0f} GB/s "
                         f"({100 * r['attn_gbps'] * 1e9 / bandwidth:.0f}%)")
        print(f"| {dtype} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_gbps": bandwidth / 1e9, "engine_max_splits":
                       MAX_SPLITS, "results": results}, f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
