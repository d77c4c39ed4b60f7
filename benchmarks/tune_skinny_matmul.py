"""Choose the skinny matmul's fixed block sizes, and the row count up to which it beats torch (cuBLAS), on the
projections of the Qwen3.5-0.8B shape (kernels/skinny_matmul.py). Times are CUDA-graph replays
(``triton.testing.do_bench_cudagraph``), so launch overhead counts as it does in the engine.

    python3 benchmarks/tune_skinny_matmul.py [--rows 1 2 4 8 16]

Prints: per config, the time of one BS=1 step's projections (each shape times its count per step); then, for the
best configs, per shape and row count, torch vs skinny; and the correctness of the chosen config.
"""

import argparse
import itertools

import torch
import triton
from triton.testing import do_bench_cudagraph

from truespec.kernels import linear_ref, skinny_matmul

# (name, N, K, launches per step) of the 0.8B shape: 6 attention layers, 18 GDN layers, 24 MLPs, tied lm_head
SHAPES = [("attn qkv", 5120, 1024, 6), ("attn o", 1024, 2048, 6), ("mlp gate_up", 7168, 1024, 24),
          ("mlp down", 1024, 3584, 24), ("gdn in_proj", 8224, 1024, 18), ("gdn out", 1024, 2048, 18),
          ("lm_head", 248320, 1024, 1)]


def bench(fn) -> float:
    return do_bench_cudagraph(fn, rep=20) * 1e3  # us


def bench_skinny(x: torch.Tensor, w: torch.Tensor, bn: int, bk: int, warps: int) -> float:
    return bench(lambda: skinny_matmul(x, w, block_n=bn, block_k=bk, num_warps=warps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = parser.parse_args()
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    weights = {name: torch.randn(n, k, device=dev, dtype=dt) / k**0.5 for name, n, k, _ in SHAPES}
    xs = {(name, m): torch.randn(m, k, device=dev, dtype=dt) for name, _, k, _ in SHAPES for m in args.rows}
    print(torch.cuda.get_device_name())
    torch_us = {(name, m): bench(lambda name=name, m=m: torch.nn.functional.linear(xs[name, m], weights[name]))
                for name, *_ in SHAPES for m in args.rows}
    step_torch = sum(c * torch_us[name, 1] for name, _, _, c in SHAPES)
    layer_bytes = sum(c * n * k * 2 for name, n, k, c in SHAPES if name != "lm_head")
    print(f"torch, BS=1 step projections: {step_torch:.1f} us")
    results = []
    for bn, bk, warps in itertools.product([4, 8, 16], [256, 512, 1024], [2, 4, 8]):
        t = {name: bench_skinny(xs[name, 1], weights[name], bn, bk, warps) for name, *_ in SHAPES}
        layers = sum(c * t[name] for name, _, _, c in SHAPES if name != "lm_head")
        results.append((layers, bn, bk, warps, t))
        print(f"BN={bn:2d} BK={bk:4d} warps={warps}: layers {layers:7.1f} us ({layer_bytes / layers / 1e6:.2f} TB/s), "
              f"lm_head {t['lm_head']:.1f} us")
    results.sort(key=lambda r: r[0])
    torch_layers = sum(c * torch_us[name, 1] for name, _, _, c in SHAPES if name != "lm_head")
    print(f"\ntorch layers {torch_layers:.1f} us ({layer_bytes / torch_layers / 1e6:.2f} TB/s), "
          f"lm_head {torch_us['lm_head', 1]:.1f} us")
    for _, bn, bk, warps, _ in results[:3]:
        print(f"\n| BN={bn} BK={bk} warps={warps} | " + " | ".join(f"M={m} torch / skinny (us)" for m in args.rows)
              + " |")
        print("|---|" + "---:|" * len(args.rows))
        for name, *_ in SHAPES:
            cells = []
            for m in args.rows:
                s = bench_skinny(xs[name, m], weights[name], bn, bk, warps)
                cells.append(f"{torch_us[name, m]:.1f} / {s:.1f}")
            print(f"| {name} | " + " | ".join(cells) + " |")
    _, bn, bk, warps, _ = results[0]
    worst, invariant = 0.0, True
    for name, *_ in SHAPES:
        x = xs[name, max(args.rows)]
        y = skinny_matmul(x, weights[name], block_n=bn, block_k=bk, num_warps=warps)
        ref = linear_ref(x, weights[name])
        worst = max(worst, ((y.float() - ref.float()).norm() / ref.float().norm()).item())
        one = skinny_matmul(x[3:4], weights[name], block_n=bn, block_k=bk, num_warps=warps)
        invariant &= torch.equal(one[0], y[3])
    print(f"\nbest BN={bn} BK={bk} warps={warps}: max relative error vs fp32 reference {worst:.2e}; "
          f"row 3 alone == row 3 of {max(args.rows)} rows: {invariant}; triton {triton.__version__}")


if __name__ == "__main__":
    main()
