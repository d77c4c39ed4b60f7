"""What batch invariance costs, kernel by kernel, on the Qwen3.5-0.8B shape's projections, and whether the
row-invariant kernel (kernels/row_invariant_matmul.py) is bitwise row-invariant on this card.

    python3 benchmarks/batch_invariance_cost.py [--rows 1 4 8 16 32 64 128] [--prefill-rows 512 2048 8192]
        [--sweep]

Times are CUDA-graph replays (``do_bench_cudagraph``), one shape at a time, summed over one decode step's
projections (each shape times its count per step). Columns: ``cublas`` (F.linear), ``skinny`` (the one-row
kernel, the earlier BS=1 path), ``earlier`` (what the engine ran before: skinny at one row, cuBLAS above),
``invariant``. ``--sweep`` also times other tile configs of the invariant kernel (the bits do not depend on them
on the cards tested, see the check printed last).
"""

import argparse
import importlib

import torch
from triton.testing import do_bench_cudagraph

from truespec.kernels import act_mul, row_invariant_matmul, skinny_matmul

rim = importlib.import_module("truespec.kernels.row_invariant_matmul")  # the module (the package exports the function)

# (name, N, K, launches per step): 6 attention layers, 18 GDN layers, 24 MLPs, the tied lm_head
SHAPES = [("attn qkv", 5120, 1024, 6), ("attn o", 1024, 2048, 6), ("mlp gate_up", 7168, 1024, 24),
          ("mlp down", 1024, 3584, 24), ("gdn in_proj", 8224, 1024, 18), ("gdn out", 1024, 2048, 18),
          ("lm_head", 248320, 1024, 1)]


def bench(fn) -> float:
    return do_bench_cudagraph(fn, rep=30) * 1e3  # us


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def step_times(weights: dict, xs: dict, m: int, kinds: list[str]) -> dict[str, dict[str, float]]:
    """kind -> shape -> us, for an m-row input."""
    fns = {"cublas": lambda x, w: torch.nn.functional.linear(x, w),
           "skinny": lambda x, w: skinny_matmul(x, w),
           "invariant": lambda x, w: row_invariant_matmul(x, w)}
    out = {}
    for kind in kinds:
        # lm_head rows are logits rows: at most a few hundred in a step, so its prefill-sized run is skipped
        out[kind] = {name: bench(lambda name=name, kind=kind: fns[kind](xs[name][:m], weights[name]))
                     for name, *_ in SHAPES if not (name == "lm_head" and m > 512)}
    if "cublas" in out and "skinny" in out:
        out["earlier"] = out["skinny"] if m == 1 else out["cublas"]
    elif "cublas" in out:
        out["earlier"] = out["cublas"]
    return out


def total(times: dict[str, float]) -> float:
    return sum(c * times[name] for name, _, _, c in SHAPES if name in times)


def check_bits(weights: dict, xs: dict, dtype: torch.dtype) -> list[str]:
    """Rows bitwise equal: every prefix 1..64 and a few past the small path vs one 600-row call; single rows;
    the fused act(gate) * up input vs the two launches."""
    bad = []
    for name, _, k, _ in SHAPES:
        w = weights[name].to(dtype)
        x = xs[name][:600].to(dtype)
        full = bits(row_invariant_matmul(x, w))
        for m in list(range(1, 65)) + [65, 100, 128, 300, 599]:
            if not torch.equal(bits(row_invariant_matmul(x[:m], w)), full[:m]):
                bad.append(f"{name} {dtype} prefix {m}")
        for i in (0, 17, 333):
            if not torch.equal(bits(row_invariant_matmul(x[i:i + 1], w)), full[i:i + 1]):
                bad.append(f"{name} {dtype} row {i} alone")
        if name == "mlp down":
            gate_up = torch.randn(600, 2 * k, device=w.device).to(dtype)
            fused = bits(row_invariant_matmul(gate_up, w, input_act="silu"))
            two = bits(row_invariant_matmul(act_mul(*gate_up.chunk(2, dim=-1), "silu"), w))
            for m in (1, 3, 64, 600):
                if not torch.equal(bits(row_invariant_matmul(gate_up[:m], w, input_act="silu")), fused[:m]):
                    bad.append(f"fused {dtype} prefix {m}")
            if not torch.equal(fused, two):
                bad.append(f"fused {dtype} vs act_mul + matmul")
    return bad


CANDIDATES = {  # row-count class -> (rows timed, tiles tried): (weight rows, input rows, K chunk, warps, stages,
    # swapped: weight rows on the MMA's M side). Past 512 rows bf16 takes kernels/prefill_matmul.py, whose tiles
    # benchmarks/prefill_matmul_speed.py sweeps.
    128: ([96, 128], [(64, 128, 128, 8, 3, True), (32, 128, 128, 4, 3, True), (64, 128, 128, 4, 3, True),
                      (128, 128, 64, 8, 3, False), (128, 64, 64, 4, 3, False)]),
}


def sweep(weights: dict, xs: dict) -> None:
    """Time each candidate tile at its class's row counts (``rim.TILES`` patched for the call)."""
    default = list(rim.TILES)
    for limit, (rows, tiles) in CANDIDATES.items():
        print(f"rows <= {limit}: step us at rows {rows}")
        for tile in tiles:
            rim.TILES = [(limit, tile)] + [t for t in default if t[0] != limit]
            rim.TILES.sort(key=lambda t: float("inf") if t[0] is None else t[0])
            try:
                cells = [total(step_times(weights, xs, m, ["invariant"])["invariant"]) for m in rows]
                same = all(torch.equal(bits(row_invariant_matmul(xs[name][:rows[-1]], weights[name])[:16]),
                                       bits(row_invariant_matmul(xs[name][:16], weights[name])))
                           for name in ("attn qkv", "mlp down"))
                print(f"  {tile}: " + " ".join(f"{c:8.1f}" for c in cells) + f"  bits == 16-row tile: {same}")
            except Exception as e:  # noqa: BLE001 - a tile that does not fit (shared memory)
                print(f"  {tile}: skipped ({type(e).__name__})")
    rim.TILES = default


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    parser.add_argument("--prefill-rows", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    max_m = max(args.rows + args.prefill_rows + [600])
    weights = {name: torch.randn(n, k, device=dev, dtype=dt) / k**0.5 for name, n, k, _ in SHAPES}
    xs = {name: torch.randn(max_m, k, device=dev, dtype=dt) for name, _, k, _ in SHAPES}
    print(f"{torch.cuda.get_device_name()}, bf16; plan (segments): "
          + ", ".join(f"{name} {rim.plan(n, k)}" for name, n, k, _ in SHAPES))
    if args.sweep:
        sweep(weights, xs)
    print("\n| rows | cublas (us) | earlier (us) | invariant (us) | invariant / earlier | lm_head earlier / inv |")
    print("|---:|---:|---:|---:|---:|---:|")
    for m in args.rows + args.prefill_rows:
        t = step_times(weights, xs, m, ["cublas", "skinny", "invariant"] if m == 1 else ["cublas", "invariant"])
        e, i = total(t["earlier"]), total(t["invariant"])
        lm = (f"{t['earlier']['lm_head']:.1f} / {t['invariant']['lm_head']:.1f}" if "lm_head" in t["invariant"]
              else "-")
        print(f"| {m} | {total(t['cublas']):.1f} | {e:.1f} | {i:.1f} | {i / e:.3f} | {lm} |")
    for m in (1, 16, 64):
        t = step_times(weights, xs, m, ["cublas", "invariant"])
        print(f"rows={m}: " + ", ".join(f"{name} {t['cublas'][name]:.1f}/{t['invariant'][name]:.1f}"
                                        for name, *_ in SHAPES))
    bad = check_bits(weights, xs, torch.bfloat16) + check_bits(weights, xs, torch.float16)
    print(f"\nbitwise row invariance (bf16, fp16; prefixes 1..64, 65..599, single rows, fused act): "
          f"{'all equal' if not bad else 'FAILED: ' + '; '.join(bad[:10])}")


if __name__ == "__main__":
    main()
