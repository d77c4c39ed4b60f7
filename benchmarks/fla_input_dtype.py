"""fla's chunk_gated_delta_rule fed fp32 (what gdn_chunked does: products in fp32 / TF32) vs bf16 q / k / v (what
transformers and vLLM feed it): the time of one call per sequence and each one's error against a float64 token loop.

Qwen3.5-0.8B's GDN shape (16 heads, K = V = 128), one sequence from a random state; q, k, v hold bf16 values, q and
k L2-normalised in fp32 before the cast (as the conv's epilogue does), g and beta fp32 (as gdn_chunked passes them).
Errors: relative Frobenius norm of the output and of the final state vs the float64 recurrence of the same inputs.

    python3 benchmarks/fla_input_dtype.py [--lengths 8192 32768]
"""

import argparse

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from truespec.kernels import fla_configs
from truespec.ops.gdn import gdn_recurrent_ref

HEADS, K, V = 16, 128, 128


def inputs(length: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k = (F.normalize(torch.randn(length, HEADS, K, device="cuda", generator=gen).bfloat16().float(), dim=-1,
                        eps=1e-3) for _ in range(2))  # fmt: skip
    v = torch.randn(length, HEADS, V, device="cuda", generator=gen).bfloat16().float()
    g = -0.05 * torch.rand(length, HEADS, device="cuda", generator=gen)  # log decay per token
    beta = torch.rand(length, HEADS, device="cuda", generator=gen)
    h0 = torch.randn(HEADS, K, V, device="cuda", generator=gen) * 0.1
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta, "h0": h0}


@torch.no_grad()
def reference(x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token in float64 (``gdn_recurrent_ref``): (o [L, H, V], final state [H, K, V])."""
    q, k, v, g, beta = (x[n].double() for n in ("q", "k", "v", "g", "beta"))
    states = torch.stack([x["h0"].double(), torch.zeros_like(x["h0"], dtype=torch.float64)])  # slot 0 in, 1 out
    meta = [torch.tensor(t, device=q.device) for t in ([0, q.shape[0]], [0], [1], [q.shape[0] - 1])]
    out = gdn_recurrent_ref(q, k, v, g, beta, states, *meta, scale=K**-0.5, use_qk_l2norm=False)
    return out, states[1]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def run(x: dict[str, torch.Tensor], dtype: torch.dtype):  # noqa: ANN201 - a closure returning fla's (o, state)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    length = x["q"].shape[0]
    q, k, v = (x[n][None].to(dtype).contiguous() for n in ("q", "k", "v"))
    cu = torch.tensor([0, length], device="cuda")
    cu_cpu = cu.cpu()

    def call() -> tuple[torch.Tensor, torch.Tensor]:
        return chunk_gated_delta_rule(q, k, v, x["g"][None], x["beta"][None], scale=K**-0.5,
                                      initial_state=x["h0"][None], output_final_state=True,
                                      use_qk_l2norm_in_kernel=False, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)  # fmt: skip

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    args = parser.parse_args()
    rows = []
    for length in args.lengths:
        x = inputs(length)
        o_ref, state_ref = reference(x)
        for label, dtype, pinned in (("fp32, pinned", torch.float32, True), ("bf16, fla-tuned", torch.bfloat16, False),
                                     ("bf16, pinned", torch.bfloat16, True)):  # fmt: skip
            fla_configs.pin() if pinned else fla_configs.unpin()
            call = run(x, dtype)
            o, state = call()
            ms = do_bench(call, return_mode="median")
            rows.append((length, label, ms, rel_err(o[0], o_ref), rel_err(state[0], state_ref)))
            print(rows[-1], flush=True)
    print(f"{torch.cuda.get_device_name()}: fla chunk_gated_delta_rule, one sequence, 16 heads, K = V = 128")
    print("| tokens | inputs, configs | ms per call | output rel. err | final state rel. err |")
    print("|---:|---|---:|---:|---:|")
    for length, label, ms, e_o, e_s in rows:
        print(f"| {length} | {label} | {ms:.3f} | {e_o:.2e} | {e_s:.2e} |")


if __name__ == "__main__":
    main()
