"""Decode / verify attention per call on the Qwen3.5-0.8B attention shape (8 q / 2 kv heads of 256, block size 16):
the model-dtype kernel (bf16 cache) against every packed ``kv_cache_dtype``, each with the sparse-V skip off, at
threshold 0 and at 1e-3, and optionally against an earlier ``paged_attention.py`` (``--old``: its output must be
bitwise the current one's with the skip off) or another checkout's ``src`` tree (``--old-src``: its bf16 and packed
kernels, kernels/kv_tiles.py included, each beside ours; outputs bitwise ours with the skip off).

Times are ``triton.testing.do_bench_cudagraph`` (replays of a captured graph, as in the engine), us per call, at
each split cap of ``--max-splits`` (default: the engine's); GB/s counts the K/V bytes a call must read, with the skip
off (one cache read again on every replay: up to ~40 MB of K/V it stays in L2, so GB/s may pass DRAM's).
Random queries and keys give flat attention, where the sparse-V rule skips nothing: those columns measure the
switch's cost; ``--peak`` aligns queries with the early keys (tests/helpers/attention_rows.py ``peak_attention``)
so that tiles are skipped.

    python3 benchmarks/packed_attention_speed.py [--keys 512 2048 8192] [--query-len 1 4] [--max-splits 16 64 128]
        [--num-warps 4 8]
        [--old path.py] [--old-src other_checkout/src] [--peak 64]
"""

import argparse
import importlib.util
import itertools
import os
import sys
from collections.abc import Callable
from types import ModuleType

import torch
import triton

from truespec.kernels.paged_attention import MAX_SPLITS, paged_attention
from truespec.kernels.paged_attention_packed import paged_attention_packed
from truespec.kv_cache.formats import FORMATS

HQ, HKV, D, BLOCK = 8, 2, 256, 16
PACKED = ["fp8", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"]


def batch(num_keys: int, query_len: int, peak: float, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """(q, k, v, query_start_loc, seq_lens, block_tables) of one request whose last ``query_len`` rows attend."""
    num_blocks = triton.cdiv(num_keys, BLOCK)
    k = torch.randn(num_blocks * BLOCK, HKV, D, generator=gen)
    v = torch.randn(num_blocks * BLOCK, HKV, D, generator=gen)
    q = torch.randn(query_len, HQ, D, generator=gen)
    if peak:
        u = torch.nn.functional.normalize(torch.randn(HKV, D, generator=gen), dim=-1)
        q += peak * u.repeat_interleave(HQ // HKV, dim=0)
        ramp = 1.0 - torch.arange(num_blocks * BLOCK) / num_keys
        k += peak * ramp[:, None, None] * u
    tables = torch.randperm(num_blocks, generator=gen)[None]
    meta = torch.tensor([0, query_len]), torch.tensor([num_keys]), tables
    return (q, k, v, *meta)


ATTENTION_MODULES = ("truespec.kernels.paged_attention", "truespec.kernels.paged_attention_packed")


def import_src_tree(src: str, names: tuple[str, ...] = ATTENTION_MODULES) -> tuple[ModuleType, ...]:
    """The modules ``names`` (default: kernels.paged_attention, kernels.paged_attention_packed) of the truespec under
    another checkout's ``src``, imported beside ours: our truespec modules leave sys.modules meanwhile and come back
    after, so each side's functions keep reading their own modules (kv_tiles.py included)."""
    src = os.path.abspath(src)
    ours = {name: module for name, module in sys.modules.items() if name.split(".")[0] == "truespec"}
    for name in ours:
        del sys.modules[name]
    sys.path.insert(0, src)
    try:
        modules = tuple(importlib.import_module(name) for name in names)
    finally:
        sys.path.remove(src)
        for name in [name for name in sys.modules if name.split(".")[0] == "truespec"]:
            del sys.modules[name]
        sys.modules.update(ours)
    assert all(module.__file__.startswith(str(src)) for module in modules)
    return modules


def kernels(num_keys: int, query_len: int, peak: float, old: object | None, old_src: tuple | None,
            gen: torch.Generator, cap: int, warps: int | None = None
            ) -> tuple[dict[str, Callable[[float | None], torch.Tensor]], dict[str, int]]:
    """Each cache's attention call of one batch at split cap ``cap``, by name, as a function of the sparse-V
    threshold, and the bytes of K/V each must read; ``warps`` (None: each format's own) for the packed kernels.
    ``old_src``'s kernels follow ours, named ``<ours> (old)``."""
    q, k, v, qsl, seq_lens, tables = (x.to("cuda") for x in batch(num_keys, query_len, peak, gen))
    q, meta, scale = q.to(torch.bfloat16), (qsl, seq_lens, tables), D**-0.5
    model_cache = torch.stack([k, v]).view(2, -1, BLOCK, HKV, D).to(torch.bfloat16)
    runs = {"bf16 (model dtype)": lambda t: paged_attention(q, model_cache, *meta, scale, sparse_v_threshold=t,
                                                            max_splits=cap)}  # fmt: skip
    nbytes = {"bf16 (model dtype)": num_keys * HKV * 2 * D * 2}
    if old is not None:
        runs["bf16 (--old)"] = lambda t: old.paged_attention(q, model_cache, *meta, scale, max_splits=cap)
        nbytes["bf16 (--old)"] = nbytes["bf16 (model dtype)"]
    if old_src is not None:
        runs["bf16 (model dtype) (old)"] = lambda t: old_src[0].paged_attention(
            q, model_cache, *meta, scale, sparse_v_threshold=t, max_splits=cap)  # fmt: skip
        nbytes["bf16 (model dtype) (old)"] = nbytes["bf16 (model dtype)"]
    for name in PACKED:
        fmt = FORMATS[name]
        cache = fmt.encode(k, v).view(-1, BLOCK, HKV, fmt.bytes_per_token(D))
        runs[name] = lambda t, c=cache, f=fmt: paged_attention_packed(q, c, *meta, scale, f, D, sparse_v_threshold=t,
                                                                      max_splits=cap, num_warps=warps)  # fmt: skip
        nbytes[name] = num_keys * HKV * fmt.bytes_per_token(D)
        if old_src is not None:
            runs[f"{name} (old)"] = lambda t, c=cache, f=fmt: old_src[1].paged_attention_packed(
                q, c, *meta, scale, f, D, sparse_v_threshold=t, max_splits=cap)  # fmt: skip
            nbytes[f"{name} (old)"] = nbytes[name]
    return runs, nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--query-len", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--max-splits", type=int, nargs="+", default=[MAX_SPLITS], help="split caps to time")
    parser.add_argument("--old", help="an earlier kernels/paged_attention.py to compare with (bitwise and speed)")
    parser.add_argument("--old-src", help="another checkout's src directory: its kernels beside ours (bitwise, speed)")
    parser.add_argument("--peak", type=float, default=0.0)
    parser.add_argument("--num-warps", type=int, nargs="+", default=[None],
                        help="the packed kernels' warps to time (default: each format's own)")
    args = parser.parse_args()
    old = None
    if args.old:
        spec = importlib.util.spec_from_file_location("old_paged_attention", args.old)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
    old_src = import_src_tree(args.old_src) if args.old_src else None
    gen = torch.Generator().manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  bf16 q, {HQ} q / {HKV} kv heads of {D}, us per call (graph replay)")
    print(f"{'cache':26s} {'keys':>5s} {'q':>2s} {'cap':>3s} {'w':>2s} {'off':>8s} {'thr 0':>8s} {'thr 1e-3':>8s} "
          f"{'GB/s off':>8s} {'x bf16':>6s}  {'skip changes out':>16s}")  # fmt: skip
    for num_keys, query_len, cap, warps in itertools.product(args.keys, args.query_len, args.max_splits,
                                                             args.num_warps):
        runs, nbytes = kernels(num_keys, query_len, args.peak, old, old_src, gen, cap, warps)
        reference = runs["bf16 (model dtype)"](None)
        bf16_us, ours = None, {}
        for name, run in runs.items():
            times, outs = [], []
            for threshold in (None, 0.0, 1e-3):
                outs.append(run(threshold))
                times.append(triton.testing.do_bench_cudagraph(lambda r=run, t=threshold: r(t)) * 1e3)
            if name == "bf16 (--old)":
                assert torch.equal(outs[0], reference), "the old kernel's output differs"
            ours[name] = outs[0]
            if name.endswith(" (old)"):  # a changed tile decoding may reduce in another order: report, not assert
                diff = (outs[0].float() - ours[name.removesuffix(" (old)")].float()).abs().max().item()
                print(f"{'':26s} old vs ours: max |diff| {diff:.2e}")
            assert torch.equal(outs[0], outs[1]), f"{name}: threshold 0 differs from off"
            changed = (outs[2].float() - outs[0].float()).abs().max().item()
            bf16_us = bf16_us or times[0]
            print(f"{name:26s} {num_keys:5d} {query_len:2d} {cap:3d} {warps or 0:2d} {times[0]:8.1f} {times[1]:8.1f} "
                  f"{times[2]:8.1f} {nbytes[name] / times[0] / 1e3:8.0f} {bf16_us / times[0]:6.2f}  "
                  f"{changed:16.2e}")  # fmt: skip


if __name__ == "__main__":
    main()
