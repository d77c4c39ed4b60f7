"""fla's chunk state kernel (``chunk_gated_delta_rule_fwd_h``, the sequential part of a GDN prefill through fla) at
the Qwen3.5-0.8B GDN shape (16 heads, K = V = 128), one sequence, fp32 inputs as kernels/gdn_chunked.py passes them:
the config fla's autotuner picks in this process against forced ones (BV, warps, stages), ms per call
(``triton.testing.do_bench`` median), and whether each forced config gives the autotuned one's bits.

    python3 benchmarks/fla_state_kernel_configs.py [--lengths 8192 32768] [--json FILE]

fla tunes this kernel once per process over BV in (32, 64) on a key without the sequence length; its grid is
``V / BV x heads`` programs, so one sequence of 16 heads fills 32-64 of an H200's 132 SMs.
"""

import argparse
import itertools
import json

import torch
import triton
from fla.ops.common import chunk_delta_h
from triton.testing import do_bench

HEADS, K, V, CHUNK = 16, 128, 128, 64


def autotuner() -> triton.runtime.Autotuner:
    """The kernel's autotuner (under fla's heuristics wrapper)."""
    kernel = chunk_delta_h.chunk_gated_delta_rule_fwd_kernel_h_blockdim64
    while not hasattr(kernel, "configs"):
        kernel = kernel.fn
    return kernel


def inputs(length: int) -> tuple:
    gen = torch.Generator(device="cuda").manual_seed(0)
    k = torch.nn.functional.normalize(torch.randn(1, length, HEADS, K, device="cuda", generator=gen), dim=-1)
    w = torch.randn(1, length, HEADS, K, device="cuda", generator=gen) * 0.05
    u = torch.randn(1, length, HEADS, V, device="cuda", generator=gen)
    decay = -0.02 * torch.rand(1, length // CHUNK, CHUNK, HEADS, device="cuda", generator=gen)
    g = decay.cumsum(2).view(1, length, HEADS)  # fla's chunk-local cumulative log decay
    cu = torch.tensor([0, length], device="cuda")
    return k, w, u, g, torch.zeros(1, HEADS, K, V, device="cuda"), cu, cu.cpu()


def measure(length: int) -> dict:
    k, w, u, g, h0, cu, cu_cpu = inputs(length)

    def call() -> tuple:
        return chunk_delta_h.chunk_gated_delta_rule_fwd_h(k, w, u, g=g, initial_state=h0, output_final_state=True,
                                                          cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)  # fmt: skip
    tuner = autotuner()
    configs = list(tuner.configs)
    tuner.cache.clear()
    expected = call()
    result = {"auto_pick": str(next(iter(tuner.cache.values()), "?")), "auto_ms": do_bench(call, return_mode="median")}
    forced = {}
    for bv, warps, stages in itertools.product((16, 32, 64), (2, 4), (2, 3)):
        tuner.configs, tuner.cache = [triton.Config({"BV": bv}, num_warps=warps, num_stages=stages)], {}
        try:
            same = all(torch.equal(a, b) for a, b in zip(call(), expected, strict=True) if a is not None)
            forced[f"BV{bv}/w{warps}/s{stages}"] = (do_bench(call, return_mode="median"), same)
        except Exception as e:  # noqa: BLE001 - out of shared memory / registers: not a candidate
            forced[f"BV{bv}/w{warps}/s{stages}"] = type(e).__name__
    tuner.configs, tuner.cache = configs, {}
    return {**result, "forced": forced}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    report = {length: measure(length) for length in args.lengths}
    for length, r in report.items():
        timed = sorted((v[0], name) for name, v in r["forced"].items() if isinstance(v, tuple))
        print(f"{length} tokens: autotuned ({r['auto_pick']}) {r['auto_ms']:.3f} ms; fastest forced: "
              + ", ".join(f"{name} {ms:.3f}" for ms, name in timed[:4]))  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
