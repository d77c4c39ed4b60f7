"""Decode speed per ``kv_cache_dtype`` at long context: the whole model's decode step and the attention kernel alone.

    python3 benchmarks/kv_decode_speed.py --model DIR [--contexts 8192 32768] [--batch-sizes 1 8]
        [--kv-cache-dtypes auto fp8 turboquant_k8v4 ...] [--sparse-v-threshold T] [--json FILE]

Decode time does not depend on what the cache holds, so no prompt is prefilled: each request's context is a run of
blocks filled with random bytes (random normal K/V for ``auto``; for packed formats random codes, fp8 bytes
that are NaN patterns replaced), and a decode step at position ``context`` is replayed through the engine's CUDA
graph of its batch size (``GraphRunner.run``: the host's metadata copy plus the replay; no sampling). The kernel
rows time one attention layer's read (``paged_attention`` / ``paged_attention_packed``) over the same cache and
report the bytes of K/V it must read per second, beside the card's copy bandwidth (a 1 GiB device-to-device
copy, read + write counted). Prints a markdown table last.
"""

import argparse
import json
import time

import torch

from truespec import LLM
from truespec.kernels import paged_attention, paged_attention_packed
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


def measure(llm: LLM, context: int, batch_size: int, iters: int, threshold: float | None) -> dict[str, float]:
    engine = llm.llm_engine
    graphs, block_size = engine.runner.graphs, engine.cache_config.block_size
    blocks_per_req = -(-(context + 1) // block_size)
    rows = [ContextRow(list(range(i * blocks_per_req, (i + 1) * blocks_per_req)), context, 1, -1, -1, 0, 1)
            for i in range(batch_size)]
    step_s = _time(lambda: graphs.run(rows, [1] * batch_size, [context] * batch_size, decode_only=True), iters)

    layer = engine.loaded.model.attention_layers()[0]
    heads, head_dim = layer.num_heads, layer.head_dim
    q = torch.randn(batch_size, heads, head_dim, device="cuda", dtype=engine.dtype)
    qsl = torch.arange(batch_size + 1, device="cuda", dtype=torch.int32)
    seq_lens = torch.full((batch_size,), context + 1, device="cuda", dtype=torch.int32)
    tables = torch.tensor([r.block_ids for r in rows], device="cuda", dtype=torch.int32)
    if layer.kv_format is None:
        kernel = lambda: paged_attention(q, layer.kv_cache, qsl, seq_lens, tables, layer.scale,  # noqa: E731
                                         sparse_v_threshold=threshold)
        slot_bytes = 2 * head_dim * layer.kv_cache.element_size()
    else:
        fmt = layer.kv_format
        kernel = lambda: paged_attention_packed(q, layer.kv_cache, qsl, seq_lens, tables, layer.scale,  # noqa: E731
                                                fmt, head_dim, sparse_v_threshold=threshold)
        slot_bytes = fmt.bytes_per_token(head_dim)
    kernel_s = _time(kernel, iters)
    kv_bytes = batch_size * (context + 1) * layer.num_kv_heads * slot_bytes
    return {"step_ms": step_s * 1e3, "attn_us": kernel_s * 1e6, "attn_gbps": kv_bytes / kernel_s / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--kv-cache-dtypes", nargs="+", default=DTYPES)
    parser.add_argument("--sparse-v-threshold", type=float, default=None, help="kernel rows only (default off)")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    max_len = max(args.contexts) + 64
    results: dict[str, dict[str, dict[str, float]]] = {}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for dtype in args.kv_cache_dtypes:
        llm = LLM(args.model, dtype="bfloat16", device="cuda", kv_cache_dtype=dtype, max_model_len=max_len,
                  max_num_seqs=max(args.batch_sizes), max_num_batched_tokens=2048,
                  compilation_config={"max_cudagraph_capture_size": max(args.batch_sizes)})
        for layer in llm.llm_engine.loaded.model.attention_layers():
            _fill_random(layer, gen)
        results[dtype] = {}
        for context in args.contexts:
            for bs in args.batch_sizes:
                r = results[dtype][f"{context}/{bs}"] = measure(llm, context, bs, args.iters, args.sparse_v_threshold)
                print(f"{dtype} ctx={context} BS={bs}: {r}", flush=True)
        del llm
        torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e9:.0f} GB/s; decode step ms (x auto) | "
          f"attention us, GB/s of K/V (% of copy)")
    keys = [f"{c}/{b}" for c in args.contexts for b in args.batch_sizes]
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
            json.dump({"device": torch.cuda.get_device_name(), "copy_gbps": bandwidth / 1e9, "results": results}, f,
                      indent=2)


if __name__ == "__main__":
    main()
