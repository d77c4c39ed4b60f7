"""fla's forward kernels for a GDN prefill (``chunk_gated_delta_rule`` as kernels/gdn_chunked.py calls it: q / k / v
in the model's dtype (``--dtype``, default bfloat16; session 25 measured fp32 inputs), q / k L2-normalised before the
call unless ``--fla-l2norm``, g / beta and the state in fp32, one sequence, the Qwen3.5-0.8B GDN shape: 16 heads,
K = V = 128): for each
autotuned kernel, the config fla's autotuner picks in this process against every forced candidate, timed as the
whole call (``triton.testing.do_bench`` median, ms) with the other kernels as tuned, and whether each candidate
gives the autotuned run's bits (output and final state).

    python3 benchmarks/fla_kernel_configs.py [--lengths 8192 32768] [--kernels state output] [--json FILE]

fla tunes each kernel once per process on a key without the sequence length, and a noisy tuning run can pick a
slow config (session 24: the state kernel's pick varied by process, 0.52-1.08 ms per 8K call). Last, the whole
call with the configs truespec pins on this GPU (kernels/fla_configs.py).
"""

import argparse
import itertools
import json

import torch
import triton
from triton.testing import do_bench

from truespec.kernels import fla_configs

HEADS, K, V = 16, 128, 128
Config = triton.Config

# kernel name -> (module, attribute, forced candidates: fla's own list and neighbours)
KERNELS = {
    "state": ("fla.ops.common.chunk_delta_h", "chunk_gated_delta_rule_fwd_kernel_h_blockdim64",
              [Config({"BV": bv}, num_warps=w, num_stages=s) for bv, w, s in
               itertools.product((16, 32, 64), (2, 4, 8), (2, 3, 4))]),
    "output": ("fla.ops.common.chunk_o", "chunk_fwd_kernel_o",
               [Config({"BK": bk, "BV": bv}, num_warps=w, num_stages=s) for (bk, bv), w, s in
                itertools.product(((128, 128), (128, 64), (64, 128), (64, 64), (32, 64), (32, 32)), (4, 8),
                                  (2, 3))]),
    "w_u": ("fla.ops.gated_delta_rule.wy_fast", "recompute_w_u_fwd_kernel",
            [Config({}, num_warps=w, num_stages=s) for w, s in itertools.product((2, 4, 8), (1, 2, 3, 4))]),
    "kkt_solve": ("fla.ops.gated_delta_rule.chunk_fwd", "chunk_gated_delta_rule_fwd_kkt_solve_kernel",
                  [Config({"BK": bk}, num_warps=w, num_stages=s) for bk, w, s in
                   itertools.product((32, 64), (1, 2, 4), (1, 2, 3))]),
    "cumsum": ("fla.ops.utils.cumsum", "chunk_local_cumsum_scalar_kernel",  # the gates' chunk cumsum: not pinned
               [Config({}, num_warps=w) for w in (1, 2, 4, 8)]),
    "l2norm": ("fla.modules.norm.l2norm", "l2norm_fwd_kernel",
               [Config({"BT": bt}, num_warps=w) for bt, w in itertools.product((8, 16, 32, 64), (1, 2, 4, 8, 16))]),
}  # fmt: skip


def autotuner(name: str) -> triton.runtime.Autotuner:
    return fla_configs.autotuner(*KERNELS[name][:2])


def inputs(length: int, dtype: torch.dtype, normalized: bool) -> tuple:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(1, length, HEADS, K, device="cuda", generator=gen) for _ in range(2))
    if normalized:  # as the engine's conv hands them to fla (kernels/causal_conv1d.py, l2norm_rows)
        q, k = (torch.nn.functional.normalize(x, dim=-1) for x in (q, k))
    q, k = q.to(dtype), k.to(dtype)
    v = torch.randn(1, length, HEADS, V, device="cuda", generator=gen).to(dtype)
    g = -0.05 * torch.rand(1, length, HEADS, device="cuda", generator=gen)  # log decay per token
    beta = torch.rand(1, length, HEADS, device="cuda", generator=gen)
    h0 = torch.randn(1, HEADS, K, V, device="cuda", generator=gen) * 0.1
    cu = torch.tensor([0, length], device="cuda")
    return q, k, v, g, beta, h0, cu, cu.cpu()


def measure(length: int, names: list[str], dtype: torch.dtype = torch.bfloat16, fla_l2norm: bool = False) -> dict:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    q, k, v, g, beta, h0, cu, cu_cpu = inputs(length, dtype, normalized=not fla_l2norm)

    def call() -> tuple:
        return chunk_gated_delta_rule(q, k, v, g, beta, scale=K**-0.5, initial_state=h0, output_final_state=True,
                                      use_qk_l2norm_in_kernel=fla_l2norm, cu_seqlens=cu,
                                      cu_seqlens_cpu=cu_cpu)  # fmt: skip

    for name in KERNELS:  # tune every kernel afresh in this process, for this length
        autotuner(name).cache.clear()
    expected = call()
    report = {"auto_ms": do_bench(call, return_mode="median"), "kernels": {}}
    for name in names:
        tuner = autotuner(name)
        configs, cache = list(tuner.configs), dict(tuner.cache)
        entry = {"auto_pick": str(next(iter(cache.values()), "?")), "forced": {}}
        for cfg in KERNELS[name][2]:
            tuner.configs, tuner.cache = [cfg], {}
            try:
                got = call()
                same = all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
                diff = max((a - b).abs().max().item() for a, b in zip(got, expected, strict=True))
                entry["forced"][str(cfg)] = (do_bench(call, return_mode="median"), same, diff)
            except Exception as e:  # noqa: BLE001 - out of shared memory / registers: not a candidate
                entry["forced"][str(cfg)] = type(e).__name__
        tuner.configs, tuner.cache = configs, cache
        report["kernels"][name] = entry
    fla_configs.pin()  # truespec's configs for this GPU (none pinned: fla's tuning again)
    pinned = call()
    report["pinned"] = {"kernels": fla_configs.pin(), "ms": do_bench(call, return_mode="median"),
                        "same_bits": all(torch.equal(a, b) for a, b in zip(pinned, expected, strict=True))}
    fla_configs.unpin()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--fla-l2norm", action="store_true", help="q / k normalised by fla (the engine's: before)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    report = {length: measure(length, args.kernels, dtype, args.fla_l2norm) for length in args.lengths}
    for length, r in report.items():
        p = r["pinned"]
        print(f"{length} tokens: the whole call autotuned {r['auto_ms']:.3f} ms, with truespec's configs "
              f"{p['ms']:.3f} ms ({len(p['kernels'])} kernels pinned, same bits: {p['same_bits']})")
        for name, entry in r["kernels"].items():
            timed = sorted((v[0], cfg, v[1]) for cfg, v in entry["forced"].items() if isinstance(v, tuple))
            print(f"  {name}: autotuned pick {entry['auto_pick']}; fastest forced: "
                  + "; ".join(f"{cfg} {ms:.3f}{'' if same else ' (other bits)'}" for ms, cfg, same in timed[:3]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
