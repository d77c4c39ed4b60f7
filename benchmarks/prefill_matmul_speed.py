"""The projections of a long prefill chunk: cuBLAS vs ``row_invariant_matmul`` (what the engine runs) vs
``prefill_matmul`` (kernels/prefill_matmul.py) at other tiles, on the Qwen3.5-0.8B shapes; and whether each tile's
rows are bitwise those of the row-invariant kernel (the whole call and its 16-row tile).

    python3 benchmarks/prefill_matmul_speed.py [ROWS ...]        (default 8192)

One line per variant: us per prefill chunk (each shape times its launches per forward, like
benchmarks/batch_invariance_cost.py), TFLOP/s, us per shape. The down projection's act(gate) * up is part of every
variant (torch's SiLU-and-mul for cuBLAS, the act_mul kernel before prefill_matmul).
"""

import importlib
import sys

import torch
import triton
from triton.testing import do_bench

from truespec.kernels import act_mul, row_invariant_matmul
from truespec.kernels.prefill_matmul import prefill_matmul

rim = importlib.import_module("truespec.kernels.row_invariant_matmul")  # the module (the package exports the function)
# (name, N, K, launches per forward, input activation)
SHAPES = [("attn qkv", 5120, 1024, 6, None), ("attn o", 1024, 2048, 6, None), ("mlp gate_up", 7168, 1024, 24, None),
          ("mlp down", 1024, 3584, 24, "silu"), ("gdn in_proj", 8224, 1024, 18, None),
          ("gdn out", 1024, 2048, 18, None)]
TILES = [(128, 128, 64, 4, 8), (128, 128, 64, 5, 8), (128, 256, 64, 3, 8), (256, 128, 64, 3, 8), (128, 128, 128, 3, 8),
         (64, 256, 64, 4, 4)]  # (rows, weight rows, K chunk, stages, warps)


def cublas(x: torch.Tensor, w: torch.Tensor, act: str | None) -> torch.Tensor:
    if act:
        gate, up = x.chunk(2, dim=-1)
        x = torch.nn.functional.silu(gate) * up
    return torch.nn.functional.linear(x, w)


def tiled(tile: tuple) -> object:
    def run(x: torch.Tensor, w: torch.Tensor, act: str | None) -> torch.Tensor:
        n, k = w.shape
        split = rim.plan(n, k)
        segment = triton.cdiv(triton.cdiv(k, split), rim.SEGMENT_K) * rim.SEGMENT_K
        return prefill_matmul(act_mul(*x.chunk(2, dim=-1), act) if act else x, w, None, split, segment, tile)
    return run


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def main() -> None:
    rows = [int(a) for a in sys.argv[1:]] or [8192]
    torch.manual_seed(0)
    weights = {name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for name, n, k, _, _ in SHAPES}
    xs = {name: torch.randn(max(rows), k * (2 if act else 1), device="cuda", dtype=torch.bfloat16)
          for name, _, k, _, act in SHAPES}  # fmt: skip
    print(f"{torch.cuda.get_device_name()}, bf16")
    variants = [("cublas (+torch act)", cublas), ("row_invariant_matmul", lambda x, w, a: row_invariant_matmul(
        x, w, input_act=a))] + [(f"prefill_matmul {t}", tiled(t)) for t in TILES]
    for m in rows:
        flops = sum(2 * m * n * k * count for _, n, k, count, _ in SHAPES)
        for label, fn in variants:
            try:
                us = {name: do_bench(lambda fn=fn, x=xs[name][:m], w=weights[name], a=act: fn(x, w, a), rep=50) * 1e3
                      for name, _, _, _, act in SHAPES}  # fmt: skip
            except Exception as e:  # noqa: BLE001 - a tile that does not fit (shared memory)
                print(f"M={m} {label}: skipped ({type(e).__name__})")
                continue
            total = sum(us[name] * count for name, _, _, count, _ in SHAPES)
            line = f"M={m} {label:36s} {total:9.1f} us {flops / total / 1e6:5.0f} TFLOP/s | " + " ".join(
                f"{name.split()[-1]} {us[name]:.0f}" for name, *_ in SHAPES)
            if label != "cublas (+torch act)":
                same = all(torch.equal(bits(fn(xs[name][:m], weights[name], act)),
                                       bits(row_invariant_matmul(xs[name][:m], weights[name], input_act=act)))
                           and torch.equal(bits(fn(xs[name][:m], weights[name], act)[:16]),
                                           bits(row_invariant_matmul(xs[name][:16], weights[name], input_act=act)))
                           for name, _, _, _, act in SHAPES)  # fmt: skip
                line += f" | bits equal: {same}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
