"""Tile and warp choices of the GDN recurrent and causal conv1d kernels on decode / verify batches, on the
Qwen3.5-0.8B GDN shape (16 k-heads, 16 v-heads, dk = dv = 128, conv over 6144 channels, kernel 4).

Each variant is checked against the default configuration (max abs difference) and timed with
``triton.testing.do_bench_cudagraph`` (replays of a captured graph: no Python launch overhead, as in the engine).
The recurrence runs as the engine calls it (``layers/gdn.py``): with ``gate_inputs=GateInputs(a, b, A_log, dt_bias)``,
the gates computed in the kernel from a, b (strided column slices of one projection output, in the model dtype).
GB/s counts the bytes a step must move: fp32 state read + every written state, the q/k/v and a/b/A_log/dt_bias
inputs and the output.

    python3 benchmarks/tune_decode_kernels.py [--batch-sizes 1 8 32 128] [--query-len 1] [--shape embedded]
        [--kernels gdn_recurrent]

``--shape embedded``: the embedded model's GDN shape instead (2 k-heads, 4 v-heads, dk = dv = 64).
"""

import argparse
import itertools

import torch
import triton

from truespec.kernels import GateInputs, causal_conv1d, gdn_recurrent

SHAPES = {"0.8b": (16, 16, 128, 128), "embedded": (2, 4, 64, 64)}  # k-heads, v-heads, dk, dv
HK, HV, DK, DV = SHAPES["0.8b"]
CONV_K = 4


def _metadata(num_reqs: int, query_len: int, device: str) -> tuple[torch.Tensor, ...]:
    qsl = torch.arange(num_reqs + 1, device=device) * query_len
    src = torch.arange(num_reqs, device=device)  # slot r holds request r's state
    dst = num_reqs + torch.arange(num_reqs, device=device) * query_len  # a fresh group of query_len slots
    return qsl, src, dst, torch.zeros(num_reqs, dtype=torch.long, device=device)


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(x.numel() * x.element_size() for x in tensors)


def tune_gdn(num_reqs: int, query_len: int) -> list[tuple[str, float, float, float]]:
    t, dev = num_reqs * query_len, "cuda"
    q, k = torch.randn(t, HK, DK, device=dev, dtype=torch.bfloat16), torch.randn(t, HK, DK, device=dev).bfloat16()
    v = torch.randn(t, HV, DV, device=dev, dtype=torch.bfloat16)
    b_a = torch.randn(t, 2 * HV, device=dev, dtype=torch.bfloat16)  # b, a: adjacent columns of in_proj's output
    A_log = torch.empty(HV, device=dev).uniform_(1, 16).log().bfloat16()  # noqa: N806
    gates = GateInputs(b_a[:, HV:], b_a[:, :HV], A_log, torch.rand(HV, device=dev, dtype=torch.bfloat16))
    state = torch.randn(num_reqs * (1 + query_len), HV, DK, DV, device=dev) * 0.1
    meta = _metadata(num_reqs, query_len, dev)

    def run(ssm_state: torch.Tensor, **tuning: int) -> torch.Tensor:
        return gdn_recurrent(q, k, v, None, None, ssm_state, *meta, gate_inputs=gates, **tuning)

    ref = run(state.clone())
    state_bytes = num_reqs * (1 + query_len) * _nbytes(state[0])  # each request's source read, each kept state
    nbytes = state_bytes + _nbytes(q, k, v, ref, gates.a, gates.b, gates.A_log, gates.dt_bias)
    rows = []
    for block_v, warps in itertools.product((8, 16, 32, 64), (1, 2, 4, 8)):
        if block_v * DK // (32 * warps) < 4:
            continue
        out = run(state.clone(), block_v=block_v, num_warps=warps)
        err = (out.float() - ref.float()).abs().max().item()
        ms = triton.testing.do_bench_cudagraph(lambda bv=block_v, w=warps: run(state, block_v=bv, num_warps=w))
        rows.append((f"BV={block_v} warps={warps}", ms * 1e3, nbytes / ms / 1e6, err))
    return rows


def tune_conv(num_reqs: int, query_len: int) -> list[tuple[str, float, float, float]]:
    t, dev, channels = num_reqs * query_len, "cuda", 2 * HK * DK + HV * DV
    x = torch.randn(t, channels, device=dev, dtype=torch.bfloat16)
    weight = torch.randn(channels, CONV_K, device=dev, dtype=torch.bfloat16)
    conv_state = torch.randn(num_reqs * (1 + query_len), channels, CONV_K - 1, device=dev, dtype=torch.bfloat16)
    meta = _metadata(num_reqs, query_len, dev)
    nbytes = (num_reqs * (1 + query_len) * (CONV_K - 1) + 2 * t) * channels * 2
    ref = causal_conv1d(x, weight, conv_state.clone(), *meta)
    rows = []
    for block_c, warps in itertools.product((128, 256, 512, 1024), (1, 2, 4, 8)):
        out = causal_conv1d(x, weight, conv_state.clone(), *meta, block_c=block_c, num_warps=warps)
        err = (out.float() - ref.float()).abs().max().item()
        ms = triton.testing.do_bench_cudagraph(
            lambda bc=block_c, w=warps: causal_conv1d(x, weight, conv_state, *meta, block_c=bc, num_warps=w)
        )
        rows.append((f"BLOCK_C={block_c} warps={warps}", ms * 1e3, nbytes / ms / 1e6, err))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--query-len", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--shape", choices=list(SHAPES), default="0.8b")
    parser.add_argument("--kernels", nargs="+", choices=["gdn_recurrent", "causal_conv1d"],
                        default=["gdn_recurrent", "causal_conv1d"])
    args = parser.parse_args()
    global HK, HV, DK, DV
    HK, HV, DK, DV = SHAPES[args.shape]
    print(torch.cuda.get_device_name(), args.shape)
    tuners = {"gdn_recurrent": tune_gdn, "causal_conv1d": tune_conv}
    for name, bs, qlen in itertools.product(args.kernels, args.batch_sizes, args.query_len):
        fn = tuners[name]
        rows = sorted(fn(bs, qlen), key=lambda r: r[1])
        print(f"\n{name} BS={bs} query_len={qlen}\n| variant | us | GB/s | max abs diff vs default |")
        print("|---|---:|---:|---:|")
        default = [r for r in rows if r[0] in ("BV=32 warps=1", "BLOCK_C=256 warps=4")]
        for label, us, gbps, err in rows[:6] + default:
            print(f"| {label} | {us:.1f} | {gbps:.0f} | {err:.2e} |")


if __name__ == "__main__":
    main()
