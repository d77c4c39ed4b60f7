"""Is fla-core's ``chunk_gated_delta_rule`` bitwise chunking-invariant? One call over a sequence vs two calls cut at
a position (the second from the first's final state), at 64-aligned and other cuts, and a sequence packed with
another in one call vs alone; fp32 inputs, as kernels/gdn_chunked.py feeds it; the Qwen3.5 GDN shape.

    python3 benchmarks/fla_chunk_invariance.py      # needs CUDA and fla-core (.whl/ on the device)
"""
import torch
from fla.ops.gated_delta_rule import chunk_gated_delta_rule as chunk

torch.manual_seed(0)
L, H, HV, DK, DV = 2112, 16, 16, 128, 128
dev = "cuda"
q = torch.randn(1, L, H, DK, device=dev)
k = torch.randn(1, L, H, DK, device=dev)
v = torch.randn(1, L, HV, DV, device=dev)
g = -torch.rand(1, L, HV, device=dev) * 0.5
beta = torch.rand(1, L, HV, device=dev)
h0 = torch.randn(1, HV, DK, DV, device=dev) * 0.1


def run(s: int, e: int, init: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cs = torch.tensor([0, e - s], dtype=torch.int64)
    return chunk(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], scale=DK**-0.5, initial_state=init,
                 output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cs.to(dev), cu_seqlens_cpu=cs)


o_full, h_full = run(0, L, h0)
for a in (1024, 1088, 64, 1000, 1040, 2111):
    o1, h1 = run(0, a, h0)
    o2, h2 = run(a, L, h1)
    o = torch.cat([o1, o2], 1)
    print(f"split at {a} (64-aligned: {a % 64 == 0}): outputs bitwise {torch.equal(o, o_full)} "
          f"(max diff {(o - o_full).abs().max().item():.2e}), final state bitwise {torch.equal(h2, h_full)} "
          f"(max diff {(h2 - h_full).abs().max().item():.2e})")
# several sequences packed in one call vs alone
cs = torch.tensor([0, 1024, L], dtype=torch.int64)
o_p, h_p = chunk(q, k, v, g, beta, scale=DK**-0.5, initial_state=torch.cat([h0, h0]), output_final_state=True,
                 use_qk_l2norm_in_kernel=True, cu_seqlens=cs.to(dev), cu_seqlens_cpu=cs)
o_a, h_a = run(0, 1024, h0)
print(f"packed with another sequence vs alone: outputs bitwise {torch.equal(o_p[:, :1024], o_a)}, "
      f"state bitwise {torch.equal(h_p[:1], h_a)}")
