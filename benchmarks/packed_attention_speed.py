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
        [--old path.py] [--old-src other_checkout/src] [--peak 64]

``--tune`` (issue 14) sweeps the launch knobs instead, one query row over ``--keys`` (default 32768), the skip off,
at the first ``--max-splits``: block_n 16 / 32 / 64 x num_warps 2 / 4 / 8 (not 2 warps at block_n 64) per cache, and
for Lloyd-Max keys key_dim_chunk 128 / 64 / 32 too (kernels/kv_tiles.py), its chunk loop unrolled or a runtime loop,
at 4 and 8 warps. Each cache's table is sorted by time and gives the kernel's registers and spilled (local memory)
bytes per thread, and each output's max |diff| from the engine's default config (block_n 32, 4 warps, the whole
head: the first row timed); configs that fail to compile or launch print why. ``--jobs`` processes first compile
every config into Triton's disk cache (~160 compiles of 1-4 s), so the timing pass mostly loads binaries.

    python3 benchmarks/packed_attention_speed.py --tune [--keys 32768] [--formats turboquant_4bit_nc ...] [--jobs 12]
"""

import argparse
import contextlib
import importlib.util
import itertools
import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

import torch
import triton

from truespec.kernels.paged_attention import BLOCK_N, MAX_SPLITS, NUM_WARPS, _paged_attention_kernel, paged_attention
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


def import_src_tree(src: str) -> tuple[object, object]:
    """(kernels.paged_attention, kernels.paged_attention_packed) of the truespec under another checkout's ``src``,
    imported beside ours: our truespec modules leave sys.modules meanwhile and come back after, so each side's
    functions keep reading their own modules (kv_tiles.py included)."""
    src = os.path.abspath(src)
    ours = {name: module for name, module in sys.modules.items() if name.split(".")[0] == "truespec"}
    for name in ours:
        del sys.modules[name]
    sys.path.insert(0, src)
    try:
        attention = importlib.import_module("truespec.kernels.paged_attention")
        packed = importlib.import_module("truespec.kernels.paged_attention_packed")
    finally:
        sys.path.remove(src)
        for name in [name for name in sys.modules if name.split(".")[0] == "truespec"]:
            del sys.modules[name]
        sys.modules.update(ours)
    assert attention.__file__.startswith(str(src)) and packed.paged_attention_packed is not paged_attention_packed
    return attention, packed


def kernels(num_keys: int, query_len: int, peak: float, old: object | None, old_src: tuple | None,
            gen: torch.Generator, cap: int) -> tuple[dict[str, Callable[[float | None], torch.Tensor]], dict[str, int]]:
    """Each cache's attention call of one batch at split cap ``cap``, by name, as a function of the sparse-V
    threshold, and the bytes of K/V each must read. ``old_src``'s kernels follow ours, named ``<ours> (old)``."""
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
                                                                      max_splits=cap)  # fmt: skip
        nbytes[name] = num_keys * HKV * fmt.bytes_per_token(D)
        if old_src is not None:
            runs[f"{name} (old)"] = lambda t, c=cache, f=fmt: old_src[1].paged_attention_packed(
                q, c, *meta, scale, f, D, sparse_v_threshold=t, max_splits=cap)  # fmt: skip
            nbytes[f"{name} (old)"] = nbytes[name]
    return runs, nbytes


TUNE_FORMATS = ["bf16", *PACKED]
TUNE_BLOCK_N, TUNE_WARPS, TUNE_CHUNKS = (16, 32, 64), (2, 4, 8), (128, 64, 32)
DEFAULT_CONFIG = (BLOCK_N, NUM_WARPS, D, True)
Config = tuple[int, int, int, bool]  # block_n, num_warps, key_dim_chunk, key_dim_unroll


def tune_configs(name: str) -> list[Config]:
    """The configs to time for cache ``name``, the engine's default first: the whole head at every block_n x warps
    but 2 warps at block_n 64 (64 threads decoding 64 x 256 elements); for Lloyd-Max keys also each chunk, both
    loop forms, at 4 and 8 warps."""
    whole = [(n, w, D, True) for n in TUNE_BLOCK_N for w in TUNE_WARPS if (n, w) != (64, 2)]
    is_lloyd_max = name != "bf16" and FORMATS[name].is_rotated
    chunked = [(n, w, c, unroll) for c in TUNE_CHUNKS for unroll in (True, False) for n in TUNE_BLOCK_N for w in (4, 8)]
    return [DEFAULT_CONFIG] + [c for c in whole + (chunked if is_lloyd_max else []) if c != DEFAULT_CONFIG]


def tune_calls(num_keys: int, names: list[str], cap: int) -> dict[str, Callable[..., torch.Tensor]]:
    """Each cache's attention call over one 1-row batch of ``num_keys`` keys at split cap ``cap`` (the same seed in
    every process, so the same shapes and kernel specialisations), as a function of a ``Config``."""
    q, k, v, qsl, seq_lens, tables = (x.to("cuda") for x in batch(num_keys, 1, 0.0, torch.Generator().manual_seed(0)))
    q, meta, scale = q.to(torch.bfloat16), (qsl, seq_lens, tables), D**-0.5
    calls = {}
    for name in names:
        if name == "bf16":
            cache = torch.stack([k, v]).view(2, -1, BLOCK, HKV, D).to(torch.bfloat16)
            calls[name] = lambda n, w, c, u, kv=cache: paged_attention(q, kv, *meta, scale, block_n=n, max_splits=cap,
                                                                       num_warps=w)  # fmt: skip
        else:
            fmt = FORMATS[name]
            cache = fmt.encode(k, v).view(-1, BLOCK, HKV, fmt.bytes_per_token(D))
            calls[name] = lambda n, w, c, u, kv=cache, f=fmt: paged_attention_packed(
                q, kv, *meta, scale, f, D, block_n=n, max_splits=cap, num_warps=w,
                key_dim_chunk=c if f.is_rotated else None, key_dim_unroll=u)  # fmt: skip
    return calls


def compile_configs(num_keys: int, cap: int, jobs: list[tuple]) -> None:
    """Run each (cache, *config) once, so that Triton compiles it into its disk cache (a ``--jobs`` worker)."""
    calls = tune_calls(num_keys, sorted({name for name, *_ in jobs}), cap)
    for name, *config in jobs:
        with contextlib.suppress(Exception):  # the timing pass reports it
            calls[name](*config)
    torch.cuda.synchronize()


def compiled_kernels() -> dict:
    """The attention kernel's binaries loaded in this process, by Triton's cache key ({} without Triton's JIT)."""
    caches = getattr(_paged_attention_kernel, "device_caches", {})  # Triton 3.6's internals
    return {key: kernel for c in caches.values() for key, kernel in c[0].items()}


def new_binary(before: dict) -> tuple[int | str, int | str]:
    """(registers, local memory bytes per thread: spills) of the attention kernel compiled or loaded since
    ``before`` (Triton's ``n_spills`` counts 4-byte words)."""
    new = [kernel for key, kernel in compiled_kernels().items() if key not in before]
    if not new or not isinstance(getattr(new[0], "n_spills", None), int):
        return "?", "?"
    return new[0].n_regs, 4 * new[0].n_spills


def compile_in_processes(num_keys: int, cap: int, jobs: list[tuple], num_procs: int) -> None:
    """Compile ``jobs`` into Triton's disk cache in ``num_procs`` processes; a crash only costs the time."""
    start = time.perf_counter()
    shards = [jobs[i::num_procs] for i in range(num_procs)]
    try:
        with ProcessPoolExecutor(num_procs, mp_context=multiprocessing.get_context("spawn")) as pool:
            list(pool.map(compile_configs, [num_keys] * num_procs, [cap] * num_procs, shards))
    except Exception as error:  # noqa: BLE001  (the timing pass compiles what is missing)
        print(f"parallel compile failed ({type(error).__name__}: {error}); compiling while timing")
    print(f"compiled in {time.perf_counter() - start:.0f} s", flush=True)


def time_configs(name: str, call: Callable[..., torch.Tensor]) -> tuple[list[tuple], torch.Tensor]:
    """(us, *config, registers, spilled bytes per thread, max |diff| from the first config's output) of each
    config of cache ``name`` that compiles and runs; the others print why not."""
    rows, reference = [], None
    for config in tune_configs(name):
        before = compiled_kernels()
        try:
            out = call(*config)
            torch.cuda.synchronize()
            us = triton.testing.do_bench_cudagraph(lambda c=config: call(*c)) * 1e3
        except Exception as error:  # noqa: BLE001  (out of shared memory, a compile error: skip the config)
            print(f"{name:20s} {config} failed: {type(error).__name__}: {str(error).strip()[:100]}", flush=True)
            continue
        reference = out if reference is None else reference  # the default config's, unless it failed
        rows.append((us, *config, *new_binary(before), (out.float() - reference.float()).abs().max().item()))
    return rows, reference


def loop_form(chunk: int, unroll: bool) -> str:
    return "-" if chunk == D else "unroll" if unroll else "range"


def tune(num_keys: int, names: list[str], cap: int, num_procs: int) -> None:
    """Time every ``tune_configs`` of each cache; print a table per cache sorted by time and the best of each."""
    jobs = [(name, *config) for name in names for config in tune_configs(name)]
    print(f"{len(jobs)} configs; compiling in {num_procs} processes", flush=True)
    if num_procs > 1:
        compile_in_processes(num_keys, cap, jobs, num_procs)
    calls = tune_calls(num_keys, names, cap)
    print(f"{torch.cuda.get_device_name()}  bf16 q, {HQ} q / {HKV} kv heads of {D}, 1 query row, {num_keys} keys, "
          f"max_splits {cap}, us per call (graph replay); x dflt: vs the first row timed (the engine's default)")
    best, bf16_us = {}, None
    for name in names:
        rows, reference = time_configs(name, calls[name])
        if not rows:
            continue
        bf16_us = bf16_us or rows[0][0]
        tol = 2e-2 * reference.float().abs().max().item()
        print(f"{name:20s} {'block_n':>7s} {'warps':>5s} {'chunk':>5s} {'loop':>6s} {'us':>7s} {'x bf16':>6s} "
              f"{'x dflt':>6s} {'regs':>4s} {'spill':>5s} {'max|diff|':>9s}")  # fmt: skip
        for us, n, w, c, u, regs, spills, diff in sorted(rows):
            flag = "" if diff <= tol else f"  > tol {tol:.1e}"
            print(f"{'':20s} {n:7d} {w:5d} {c:5d} {loop_form(c, u):>6s} {us:7.1f} {bf16_us / us:6.2f} "
                  f"{rows[0][0] / us:6.2f} {regs!s:>4s} {spills!s:>5s} {diff:9.2e}{flag}", flush=True)  # fmt: skip
        best[name] = (min(rows), rows[0][0])
    print("best per format (block_n, warps, chunk, loop: us, x default, x bf16 default):")
    for name, ((us, n, w, c, u, *_), default_us) in best.items():
        print(f"  {name}: {n}, {w}, {c}, {loop_form(c, u)}: {us:.1f} us, x{default_us / us:.2f}, x{bf16_us / us:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, nargs="+", default=None, help="default 512 2048 8192; --tune: 32768")
    parser.add_argument("--query-len", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--max-splits", type=int, nargs="+", default=[MAX_SPLITS], help="split caps to time")
    parser.add_argument("--old", help="an earlier kernels/paged_attention.py to compare with (bitwise and speed)")
    parser.add_argument("--old-src", help="another checkout's src directory: its kernels beside ours (bitwise, speed)")
    parser.add_argument("--peak", type=float, default=0.0)
    parser.add_argument("--tune", action="store_true", help="sweep block_n / num_warps / key_dim_chunk instead")
    parser.add_argument("--formats", nargs="+", default=TUNE_FORMATS, choices=TUNE_FORMATS,
                        help="--tune's caches (bf16 always)")
    parser.add_argument("--jobs", type=int, default=12, help="--tune: processes compiling configs first (1: none)")
    args = parser.parse_args()
    if args.tune:
        names = ["bf16", *(f for f in args.formats if f != "bf16")]
        tune((args.keys or [32768])[0], names, args.max_splits[0], args.jobs)
        return
    args.keys = args.keys or [512, 2048, 8192]
    old = None
    if args.old:
        spec = importlib.util.spec_from_file_location("old_paged_attention", args.old)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
    old_src = import_src_tree(args.old_src) if args.old_src else None
    gen = torch.Generator().manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  bf16 q, {HQ} q / {HKV} kv heads of {D}, us per call (graph replay)")
    print(f"{'cache':26s} {'keys':>5s} {'q':>2s} {'cap':>3s} {'off':>8s} {'thr 0':>8s} {'thr 1e-3':>8s} "
          f"{'GB/s off':>8s} {'x bf16':>6s}  {'skip changes out':>16s}")  # fmt: skip
    for num_keys, query_len, cap in itertools.product(args.keys, args.query_len, args.max_splits):
        runs, nbytes = kernels(num_keys, query_len, args.peak, old, old_src, gen, cap)
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
            print(f"{name:26s} {num_keys:5d} {query_len:2d} {cap:3d} {times[0]:8.1f} {times[1]:8.1f} {times[2]:8.1f} "
                  f"{nbytes[name] / times[0] / 1e3:8.0f} {bf16_us / times[0]:6.2f}  {changed:16.2e}")  # fmt: skip


if __name__ == "__main__":
    main()
