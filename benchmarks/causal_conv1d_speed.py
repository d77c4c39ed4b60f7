"""The GDN layers' causal conv1d over a long prefill chunk: the engine's launch vs other tiles, against a copy of
the same bytes (the memory-bound floor), on the Qwen3.5-0.8B shape (C = 6144 channels, K = 4; x a column slice of
the in_proj output, as the layer passes it); and whether each tile's output and kept window are bitwise the
engine's launch.

    python3 benchmarks/causal_conv1d_speed.py [ROWS ...]        (default 8192 32768)

One line per variant: us per call (median), GB/s of x read + out written, bitwise equal. Markdown table last.
"""

import sys

import torch
from triton.testing import do_bench

from truespec.kernels.causal_conv1d import causal_conv1d

C, K, IN_PROJ = 6144, 4, 8224  # conv channels, kernel width, in_proj output width (conv | z | b | a)
TILES = [(None, None, 4), (1, 256, 4), (4, 256, 4), (8, 256, 4), (8, 256, 8), (16, 256, 8), (8, 512, 8), (4, 512, 4),
         (16, 128, 4), (8, 128, 4)]  # (block_t, block_c, warps); None: the engine's choice


def inputs(rows: int) -> tuple:
    """x [rows, C] (a strided view), weight, conv_state with 4 slots, and one request keeping its final window."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, IN_PROJ, device="cuda", dtype=torch.bfloat16, generator=gen)[:, :C]
    weight = torch.randn(C, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    state = torch.zeros(4, C, K - 1, device="cuda", dtype=torch.bfloat16)
    meta = [torch.tensor(v, device="cuda") for v in ([0, rows], [-1], [2], [rows - 1])]  # qsl, src, dst, write_start
    return x, weight, state, meta


def main() -> None:
    print(torch.cuda.get_device_name())
    table = []
    for rows in [int(a) for a in sys.argv[1:]] or [8192, 32768]:
        x, weight, state, meta = inputs(rows)
        moved = 2 * rows * C * x.element_size()
        copy_us = do_bench(lambda: x.clone(), return_mode="median") * 1e3  # noqa: B023
        table.append((rows, "x.clone() (floor)", copy_us, moved / copy_us / 1e3, ""))
        reference = causal_conv1d(x, weight, state, *meta), state.clone()
        for block_t, block_c, warps in TILES:
            def run() -> torch.Tensor:
                return causal_conv1d(x, weight, state, *meta, block_t=block_t, block_c=block_c, num_warps=warps)  # noqa: B023
            same = torch.equal(run(), reference[0]) and torch.equal(state, reference[1])
            us = do_bench(run, return_mode="median") * 1e3
            name = "engine" if block_t is None else f"{block_t} x {block_c}, {warps} warps"
            table.append((rows, name, us, moved / us / 1e3, same))
            print(table[-1], flush=True)
    print("\n| rows | variant | us | GB/s | bitwise |\n|---:|---|---:|---:|---|")
    for rows, name, us, gbs, same in table:
        print(f"| {rows} | {name} | {us:.1f} | {gbs:.0f} | {same} |")


if __name__ == "__main__":
    main()
