"""GDN prefill on GPU: gdn_recurrent (one token after another) vs gdn_chunked (fla-core's chunk kernel).

    python3 benchmarks/gdn_prefill.py [--dtypes bfloat16,float32] [--iters 10] [--min-chunk-len 64]

Shape of Qwen3.5-0.8B's GDN layer (16 k-heads, 16 v-heads, dk = dv = 128); R fresh prefills of L tokens each
keeping their final state, plus one mixed step (decodes and verifies beside a long chunk). q, k, v are strided
views of one conv output, as in the layer. Prints milliseconds per call, the speed-up, and the relative error
of gdn_chunked's outputs and final states vs gdn_recurrent (Frobenius norm, worst request). Every prefill here
goes to the chunk kernel (--min-chunk-len 64, not gdn_chunked's default) so both paths are timed on every case.
"""

import argparse
import statistics

import torch

from truespec.kernels.gdn_chunked import gdn_chunked, is_available
from truespec.kernels.gdn_recurrent import gdn_recurrent

HK, HV, DK, DV = 16, 16, 128, 128
GROUP = 4  # state slots per request
CASES = {  # name -> [(query_len, state_write_start)] per request
    "1x512": [(512, 511)],
    "8x512": [(512, 511)] * 8,
    "128x512": [(512, 511)] * 128,
    "1x4096": [(4096, 4095)],
    "32 decodes + 16 verifies 1+3 + 1x2048": [(1, 0)] * 32 + [(4, 0)] * 16 + [(2048, 2047)],
}


def make_step(reqs: list[tuple[int, int]], dtype: torch.dtype, gen: torch.Generator) -> tuple[list, dict]:
    """Random inputs and metadata: request i starts from slot i*GROUP+1 (decodes) or zeros (prefills)."""
    qsl = [0]
    for n, _ in reqs:
        qsl.append(qsl[-1] + n)
    num_tokens = qsl[-1]
    conv_out = torch.randn(num_tokens, 2 * HK * DK + HV * DV, generator=gen).cuda().to(dtype)
    q, k, v = conv_out.split([HK * DK, HK * DK, HV * DV], dim=-1)
    g = -torch.nn.functional.softplus(torch.randn(num_tokens, HV, generator=gen).cuda() - 1.0)
    beta = torch.sigmoid(torch.randn(num_tokens, HV, generator=gen)).cuda()
    tensors = [q.unflatten(-1, (HK, DK)), k.unflatten(-1, (HK, DK)), v.unflatten(-1, (HV, DV)), g, beta]
    host = dict(query_start_loc=qsl, state_src=[i * GROUP + 1 if n < 64 else -1 for i, (n, _) in enumerate(reqs)],
                state_dst=[i * GROUP for i in range(len(reqs))], state_write_start=[ws for _, ws in reqs])  # fmt: skip
    return tensors, host


def time_ms(fn: object, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def run_case(name: str, reqs: list[tuple[int, int]], dtype: torch.dtype, iters: int, min_len: int) -> None:
    tensors, host = make_step(reqs, dtype, torch.Generator().manual_seed(0))
    meta = {n: torch.tensor(x, dtype=torch.int64, device="cuda") for n, x in host.items()}
    host_kwargs = {f"{n}_cpu": x for n, x in host.items()} | {"min_chunk_len": min_len}
    state = torch.randn(len(reqs) * GROUP, HV, DK, DV, generator=torch.Generator().manual_seed(1)).cuda() * 0.3
    states = {"recurrent": state.clone(), "chunked": state.clone()}
    outs = {
        "recurrent": gdn_recurrent(*tensors, states["recurrent"], **meta),
        "chunked": gdn_chunked(*tensors, states["chunked"], **meta, **host_kwargs),
    }
    qsl, dst = host["query_start_loc"], host["state_dst"]
    err_out = max(rel_err(outs["chunked"][a:b], outs["recurrent"][a:b]) for a, b in zip(qsl, qsl[1:], strict=False))
    err_state = max(rel_err(states["chunked"][s], states["recurrent"][s]) for s in dst)
    scratch = state  # timed calls update it in place (no per-call copy of the slots)
    ms_rec = time_ms(lambda: gdn_recurrent(*tensors, scratch, **meta), iters)
    ms_chunk = time_ms(lambda: gdn_chunked(*tensors, scratch, **meta, **host_kwargs), iters)
    tokens = qsl[-1]
    print(f"{name:40s} {tokens:7d} {ms_rec:10.3f} {ms_chunk:10.3f} {ms_rec / ms_chunk:8.1f}x "
          f"{tokens / ms_chunk / 1e3:9.2f} {err_out:10.2e} {err_state:10.2e}", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--min-chunk-len", type=int, default=64)
    args = parser.parse_args()
    if not is_available():
        raise SystemExit("needs CUDA and fla-core (pip install --no-deps fla_core-*.whl)")
    import fla

    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  fla-core {fla.__version__}")
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        print(f"\ninputs {dtype}, fp32 state; ms per call (median of {args.iters}), error vs gdn_recurrent")
        print(f"{'case':40s} {'tokens':>7s} {'recurrent':>10s} {'chunked':>10s} {'speedup':>9s} "
              f"{'Mtok/s':>9s} {'rel err o':>10s} {'rel err S':>10s}")  # fmt: skip
        for name, reqs in CASES.items():
            run_case(name, reqs, dtype, args.iters, args.min_chunk_len)


if __name__ == "__main__":
    main()
