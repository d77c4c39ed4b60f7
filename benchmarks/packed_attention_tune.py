"""The launch knobs of the decode / verify attention per cache (issue 14), swept on the attention shape of
benchmarks/packed_attention_speed.py: one query row over ``--keys`` (default 32768), the sparse-V skip off, at split
cap ``--max-splits`` (default the engine's): block_n 16 / 32 / 64 x num_warps 2 / 4 / 8 (not 2 warps at block_n 64)
per cache, and for Lloyd-Max keys key_dim_chunk 128 / 64 / 32 too (kernels/kv_tiles.py), its chunk loop unrolled or
a runtime loop, at 4 and 8 warps. Each cache's table is sorted by time and gives the kernel's registers and spilled
(local memory) bytes per thread, and each output's max |diff| from the engine's default config (block_n 32, the
whole head, the format's warps: the first row timed); configs that fail to compile or launch print why. ``--jobs``
processes first compile every config into Triton's disk cache (~160 compiles of 1-4 s), so the timing pass mostly
loads binaries.

    python3 benchmarks/packed_attention_tune.py [--keys 32768] [--max-splits 64] [--formats turboquant_4bit_nc ...]
        [--jobs 12]
"""

import argparse
import contextlib
import multiprocessing
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

import torch
import triton
from packed_attention_speed import BLOCK, HKV, HQ, PACKED, D, batch

from truespec.kernels.paged_attention import BLOCK_N, MAX_SPLITS, NUM_WARPS, _paged_attention_kernel, paged_attention
from truespec.kernels.paged_attention_packed import format_num_warps, paged_attention_packed
from truespec.kv_cache.formats import FORMATS

TUNE_FORMATS = ["bf16", *PACKED]
TUNE_BLOCK_N, TUNE_WARPS, TUNE_CHUNKS = (16, 32, 64), (2, 4, 8), (128, 64, 32)
Config = tuple[int, int, int, bool]  # block_n, num_warps, key_dim_chunk, key_dim_unroll


def tune_configs(name: str) -> list[Config]:
    """The configs to time for cache ``name``, the engine's default first: the whole head at every block_n x warps
    but 2 warps at block_n 64 (64 threads decoding 64 x 256 elements); for Lloyd-Max keys also each chunk, both
    loop forms, at 4 and 8 warps."""
    whole = [(n, w, D, True) for n in TUNE_BLOCK_N for w in TUNE_WARPS if (n, w) != (64, 2)]
    is_lloyd_max = name != "bf16" and FORMATS[name].is_rotated
    chunked = [(n, w, c, unroll) for c in TUNE_CHUNKS for unroll in (True, False) for n in TUNE_BLOCK_N for w in (4, 8)]
    default = default_config(name)
    return [default] + [c for c in whole + (chunked if is_lloyd_max else []) if c != default]


def default_config(name: str) -> Config:
    """The engine's config for cache ``name``: block_n 32, the whole head, and the format's warps
    (kernels/paged_attention_packed.py ``format_num_warps``)."""
    return BLOCK_N, NUM_WARPS if name == "bf16" else format_num_warps(FORMATS[name]), D, True


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
    parser.add_argument("--keys", type=int, default=32768)
    parser.add_argument("--max-splits", type=int, default=MAX_SPLITS)
    parser.add_argument("--formats", nargs="+", default=TUNE_FORMATS, choices=TUNE_FORMATS, help="bf16 always")
    parser.add_argument("--jobs", type=int, default=12, help="processes compiling configs first (1: none)")
    args = parser.parse_args()
    names = ["bf16", *(f for f in args.formats if f != "bf16")]
    tune(args.keys, names, args.max_splits, args.jobs)


if __name__ == "__main__":
    main()
