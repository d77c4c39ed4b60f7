"""The GDN layers' causal conv1d over a long prefill chunk: the engine's launch vs other tiles, with and without
``plain_tiles``, against a copy of the same bytes (the memory-bound floor), on the Qwen3.5-0.8B shape (C = 6144
channels, K = 4; x a column slice of the in_proj output, as the layer passes it); output as the engine asks for it
before fla's chunk kernel (q / k / v split, fp32; ``--plain-output``: one [T, C] in x's dtype); and whether each
variant's output and kept window are bitwise the engine's launch.

    python3 benchmarks/causal_conv1d_speed.py [--plain-output] [ROWS ...]        (default 8192 32768)

One line per variant: us per call (median), GB/s of x read + out written, bitwise equal. Markdown table last.
"""

import sys

import torch
from triton.testing import do_bench

from truespec.kernels.causal_conv1d import causal_conv1d

C, K, IN_PROJ = 6144, 4, 8224  # conv channels, kernel width, in_proj output width (conv | z | b | a)
TILES = [(None, None, 4, False), (4, 256, 4, True), (8, 256, 4, True), (8, 256, 8, True), (16, 256, 8, True),
         (16, 128, 4, True), (32, 128, 4, True), (32, 128, 8, True), (32, 64, 4, True), (64, 64, 4, True),
         (16, 128, 4, False), (8, 256, 4, False)]  # (block_t, block_c, warps, plain_tiles); None: the engine's choice
SPLIT = (2048, 2048, 2048)  # q / k / v of the 0.8B shape


def inputs(rows: int) -> tuple:
    """x [rows, C] (a strided view), weight, conv_state with 4 slots, and one request keeping its final window."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, IN_PROJ, device="cuda", dtype=torch.bfloat16, generator=gen)[:, :C]
    weight = torch.randn(C, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    state = torch.zeros(4, C, K - 1, device="cuda", dtype=torch.bfloat16)
    meta = [torch.tensor(v, device="cuda") for v in ([0, rows], [-1], [2], [rows - 1])]  # qsl, src, dst, write_start
    return x, weight, state, meta


def main() -> None:
    args = sys.argv[1:]
    split = None if "--plain-output" in args else SPLIT
    out_dtype = None if split is None else torch.float32
    print(torch.cuda.get_device_name(), "output:", "[T, C] in x's dtype" if split is None else "q / k / v split, fp32")
    table = []
    for rows in [int(a) for a in args if a.isdigit()] or [8192, 32768]:
        x, weight, state, meta = inputs(rows)
        moved = rows * C * (x.element_size() + (x.element_size() if out_dtype is None else 4))
        copy_us = do_bench(lambda: x.clone(), return_mode="median") * 1e3  # noqa: B023
        table.append((rows, "x.clone() (floor: 2 bytes in, 2 out)", copy_us, 2 * rows * C * 2 / copy_us / 1e3, ""))
        reference = causal_conv1d(x, weight, state, *meta, split=split, out_dtype=out_dtype), state.clone()
        for block_t, block_c, warps, plain in TILES:
            def run() -> torch.Tensor:
                return causal_conv1d(x, weight, state, *meta, block_t=block_t, block_c=block_c, num_warps=warps,  # noqa: B023
                                     split=split, out_dtype=out_dtype, plain_tiles=plain)  # noqa: B023
            got = run()
            same = all(torch.equal(a, b) for a, b in zip(got, reference[0], strict=True)) and torch.equal(
                state, reference[1])
            us = do_bench(run, return_mode="median") * 1e3
            name = "engine" if block_t is None else f"{block_t} x {block_c}, {warps} warps{', plain' if plain else ''}"
            table.append((rows, name, us, moved / us / 1e3, same))
            print(table[-1], flush=True)
    print("\n| rows | variant | us | GB/s | bitwise |\n|---:|---|---:|---:|---|")
    for rows, name, us, gbs, same in table:
        print(f"| {rows} | {name} | {us:.1f} | {gbs:.0f} | {same} |")


if __name__ == "__main__":
    main()
