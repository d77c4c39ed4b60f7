"""The CPU kernels alone (cpu_kernels/): the GDN core per call for a plain decode batch of 1 and 16 requests, and the
packed projection kernel's GFLOP/s over the embedded model's weight shapes at 1, 4 and 16 rows; float32, this thread.

    python3 benchmarks/cpu_kernel_speed.py [--repeats 7]

Best of ``--repeats`` runs of 200 calls each (a shared machine: the best run is the least disturbed), Python wrapper
included. For before / after comparisons run it on both trees in turn, more than once.
"""

import argparse
import time
from collections.abc import Callable

import torch

from truespec.cpu_kernels import gdn as cpu_gdn
from truespec.cpu_kernels import linear as cpu_linear

HK, HV, DK, DV, K = 2, 4, 64, 64, 4  # the embedded model's GDN heads
PROJECTIONS = [(776, 256), (256, 256), (512, 256), (256, 256), (2048, 256)]  # in_proj, out_proj, gate_up, down, lm_head


def best_seconds(call: Callable[[], object], repeats: int, calls: int = 200) -> float:
    for _ in range(20):
        call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def gdn_core_call(num_reqs: int) -> Callable[[], object]:
    gen = torch.Generator().manual_seed(0)
    channels = 2 * HK * DK + HV * DV
    x = torch.randn(num_reqs, channels + HV * DV + 2 * HV, generator=gen)
    mixed, z, a, b = x.split([channels, HV * DV, HV, HV], dim=1)
    conv_w = torch.randn(channels, 1, K, generator=gen) * 0.3
    a_log, dt_bias, norm_w = torch.randn(HV, generator=gen) * 0.1, torch.randn(HV, generator=gen) * 0.1, torch.ones(DV)
    conv_state = torch.randn(64, channels, K - 1, generator=gen)
    ssm_state = torch.randn(64, HV, DK, DV, generator=gen) * 0.1
    qsl, slots = torch.arange(num_reqs + 1), torch.arange(num_reqs) + 3  # each request updated in its own slot
    args = (mixed, z, a, b, conv_w, a_log, dt_bias, norm_w, 1e-6, conv_state, ssm_state, qsl, slots, slots,
            torch.zeros(num_reqs, dtype=torch.long), (HK, HV, DK, DV))  # fmt: skip
    return lambda: cpu_gdn.gdn_core(*args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for num_reqs in (1, 16):
        print(f"gdn_core, {num_reqs} decodes: {1e6 * best_seconds(gdn_core_call(num_reqs), args.repeats):.1f} us")
    for rows in (1, 4, 16):
        seconds = flops = 0.0
        for n, k in PROJECTIONS:
            w, x = torch.randn(n, k), torch.randn(rows, k)
            seconds += best_seconds(lambda w=w, x=x: cpu_linear.linear(x, w), args.repeats)
            flops += 2 * rows * n * k
        print(f"linear, {rows} rows over {len(PROJECTIONS)} weights: {1e6 * seconds:.1f} us, "
              f"{flops / seconds / 1e9:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
