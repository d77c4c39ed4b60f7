"""Gated DeltaNet (Qwen3.5 linear-attention layer): torch reference path, CPU and CUDA.

State lives in flat slots the runner binds (see forward_context.py for the slot protocol):
  conv_state: [num_slots, conv_dim, kernel - 1] in the model dtype: the last kernel-1 conv *inputs*.
  ssm_state:  [num_slots, num_v_heads, head_k_dim, head_v_dim] in the compute dtype (fp32, fp64 for fp64).
Request r starts from slot ``state_src[r]`` (-1: zeros), runs its tokens one by one, and writes the
conv window and recurrent state after each query token t >= state_write_start[r] into slot
``state_dst[r] + t - state_write_start[r]`` (invariant 2); ``state_dst == -1`` writes nothing.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from truespec.forward_context import ForwardContext, get_forward_context
from truespec.layers.activation import get_activation
from truespec.layers.backend import kernels, use_kernels
from truespec.layers.linear import Linear, MergedLinear, use_checkpoint_names
from truespec.layers.norm import GatedRMSNorm
from truespec.layers.precision import compute_dtype


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps) over the last dim (the FLA / transformers form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _use_chunked_prefill(x: torch.Tensor, ctx: ForwardContext) -> bool:
    """Whether an eager step's long prefill chunks go through fla's chunk kernel (kernels/gdn_chunked.py): only
    with fla installed, for bf16 / fp16 models (fla's matrix products run in TF32, so fp32 and fp64 models, the
    ones exactness checks use, keep the token loop), never while a CUDA graph is being captured, and only when a
    request's chunk is long enough to gain (the engine splits prompts into chunks of max_num_batched_tokens)."""
    if x.dtype not in (torch.bfloat16, torch.float16) or ctx.state_cpu is None:
        return False
    from truespec.kernels.gdn_chunked import MIN_CHUNK_LEN, is_available

    return ctx.max_query_len >= MIN_CHUNK_LEN and is_available() and not torch.cuda.is_current_stream_capturing()


@dataclass
class _RequestStates:
    """One request's initial state, read before any slot of the step is written."""

    conv_window: torch.Tensor  # [conv_dim, kernel - 1], model dtype
    ssm: torch.Tensor  # [num_v_heads, head_k_dim, head_v_dim], compute dtype


def gated_delta_step(
    state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule, per value head.

    state [HV, dk, dv]; q, k [HV, dk]; v [HV, dv]; g, beta [HV]. Returns (new state, output [HV, dv]):
    S = exp(g) S;  u = beta (v - S^T k);  S = S + k u^T;  o = S^T q.
    """
    state = state * g.exp()[:, None, None]
    kv_mem = (state * k[:, :, None]).sum(dim=-2)
    delta = (v - kv_mem) * beta[:, None]
    state = state + k[:, :, None] * delta[:, None, :]
    return state, (state * q[:, :, None]).sum(dim=-2)


class GatedDeltaNet(nn.Module):
    """Projections, causal depthwise conv + act, gated delta rule, gated RMSNorm, out_proj.

    Parameter names match HF checkpoints (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``,
    ``conv1d``, ``dt_bias``, ``A_log``, ``norm``, ``out_proj``); the four input projections run as one GEMM
    (``in_proj``, a ``MergedLinear`` that loads and saves under those four names).
    """

    def __init__(
        self,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int,
        eps: float,
        hidden_act: str,
    ) -> None:
        super().__init__()
        if num_v_heads % num_k_heads != 0:
            raise ValueError(f"linear value heads {num_v_heads} not a multiple of key heads {num_k_heads}")
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim  # channels of [q | k | v]
        self.conv_kernel = conv_kernel
        self.act_fn = get_activation(hidden_act)
        self.in_proj = MergedLinear(hidden_size, {"in_proj_qkv": self.conv_dim, "in_proj_z": self.value_dim,
                                                  "in_proj_b": num_v_heads, "in_proj_a": num_v_heads})
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.norm = GatedRMSNorm(head_v_dim, eps)
        self.out_proj = Linear(self.value_dim, hidden_size, bias=False)
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None
        use_checkpoint_names(self)

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """Per-slot shapes: (conv_state [conv_dim, kernel-1], ssm_state [num_v_heads, head_k_dim, head_v_dim])."""
        return (self.conv_dim, self.conv_kernel - 1), (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def state_dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        """(conv_state dtype, ssm_state dtype): the model dtype, and fp32 (fp64 for fp64 models)."""
        dtype = self.out_proj.weight.dtype
        return dtype, compute_dtype(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden_size] -> [T, hidden_size]; rows past the context's tokens stay zero before out_proj.
        if self.conv_state is None or self.ssm_state is None:
            raise RuntimeError("GatedDeltaNet conv_state/ssm_state are not bound: the model runner must bind them")
        ctx = get_forward_context()
        if use_kernels(x):
            return self._forward_kernels(x, ctx)
        cdt = compute_dtype(x.dtype)
        mixed_qkv, z, b, a = self.in_proj.split(self.in_proj(x))  # [T, conv_dim], [T, value_dim], [T, HV] x 2
        z = z.unflatten(-1, (self.num_v_heads, self.head_v_dim))
        beta = b.sigmoid().to(cdt)  # [T, HV]
        g = -self.A_log.to(cdt).exp() * F.softplus(a.to(cdt) + self.dt_bias.to(cdt))  # [T, HV], log decay
        src, dst, write_start = torch.stack([ctx.state_src, ctx.state_dst, ctx.state_write_start]).tolist()
        qsl = ctx.query_start_loc_cpu
        initial = [self._read_state(s, x) for s in src]  # all reads before any write
        core = torch.zeros(x.shape[0], self.num_v_heads, self.head_v_dim, dtype=x.dtype, device=x.device)
        for r in range(ctx.num_reqs):
            if qsl[r + 1] > qsl[r]:
                rows = slice(qsl[r], qsl[r + 1])
                core[rows] = self._run_request(mixed_qkv[rows], g[rows], beta[rows], initial[r], dst[r], write_start[r])
        core = self.norm(core, z).reshape(x.shape[0], self.value_dim)
        return self.out_proj(core)

    def _forward_kernels(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The same layer through the Triton kernels: no host sync, graph-safe (tests/test_gdn_kernels.py). A decode
        step launches 6 kernels: in_proj, conv window gather, conv, recurrence (gates fused), gated norm, out_proj."""
        k_ops = kernels()
        meta = (ctx.query_start_loc, ctx.state_src, ctx.state_dst, ctx.state_write_start)
        mixed_qkv, z, b, a = self.in_proj.split(self.in_proj(x))
        conv_out = k_ops.causal_conv1d(mixed_qkv, self.conv1d.weight, self.conv_state, *meta)
        q, k, v = conv_out.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        k_heads, v_heads = (self.num_k_heads, self.head_k_dim), (self.num_v_heads, self.head_v_dim)
        q, k, v = q.unflatten(-1, k_heads), k.unflatten(-1, k_heads), v.unflatten(-1, v_heads)
        if _use_chunked_prefill(x, ctx):
            from truespec.kernels.gdn_chunked import gdn_chunked

            g, beta = k_ops.gdn_gating(a, b, self.A_log, self.dt_bias)  # fla's kernel takes the gates as tensors
            src, dst, write_start = ctx.state_cpu
            core = gdn_chunked(q, k, v, g, beta, self.ssm_state, *meta, query_start_loc_cpu=ctx.query_start_loc_cpu,
                               state_src_cpu=src, state_dst_cpu=dst, state_write_start_cpu=write_start)
        else:  # the gates are computed inside the recurrent kernel (bitwise as gdn_gating): one launch fewer
            gates = k_ops.GateInputs(a, b, self.A_log, self.dt_bias)
            core = k_ops.gdn_recurrent(q, k, v, None, None, self.ssm_state, *meta, gate_inputs=gates)
        core = k_ops.rms_norm(core, self.norm.weight, self.norm.eps, gate=z.unflatten(-1, v_heads))
        return self.out_proj(core.reshape(x.shape[0], self.value_dim))

    def _read_state(self, slot: int, x: torch.Tensor) -> _RequestStates:
        if slot < 0:
            window = torch.zeros(self.conv_dim, self.conv_kernel - 1, dtype=x.dtype, device=x.device)
            ssm_shape = (self.num_v_heads, self.head_k_dim, self.head_v_dim)
            return _RequestStates(window, torch.zeros(ssm_shape, dtype=compute_dtype(x.dtype), device=x.device))
        return _RequestStates(self.conv_state[slot].clone(), self.ssm_state[slot].clone())

    def _conv(self, mixed_qkv: torch.Tensor, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal depthwise conv + act of one request's [L, conv_dim] inputs, continuing ``window``.

        Returns (activated outputs [L, conv_dim], inputs with window prepended [conv_dim, kernel-1+L]).
        """
        inputs = torch.cat([window, mixed_qkv.transpose(0, 1)], dim=-1)
        out = F.conv1d(inputs[None], self.conv1d.weight, groups=self.conv_dim)[0]  # [conv_dim, L]
        return self.act_fn(out).transpose(0, 1), inputs

    def _split_heads(self, qkv: torch.Tensor, cdt: torch.dtype) -> tuple[torch.Tensor, ...]:
        """[L, conv_dim] -> q, k [L, HV, dk] (l2-normed, q scaled, k-heads repeated), v [L, HV, dv]."""
        q, k, v = torch.split(qkv.to(cdt), [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        repeat = self.num_v_heads // self.num_k_heads  # k-head i serves value heads i*repeat .. +repeat-1
        q = l2norm(q.unflatten(-1, (self.num_k_heads, self.head_k_dim))) * self.head_k_dim**-0.5
        k = l2norm(k.unflatten(-1, (self.num_k_heads, self.head_k_dim)))
        q, k = q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)
        return q, k, v.unflatten(-1, (self.num_v_heads, self.head_v_dim))

    def _run_request(
        self,
        mixed_qkv: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        initial: _RequestStates,
        dst: int,
        write_start: int,
    ) -> torch.Tensor:
        """One request's tokens in order; writes states from ``write_start`` on. Returns [L, HV, dv]."""
        conv_out, conv_inputs = self._conv(mixed_qkv, initial.conv_window)
        q, k, v = self._split_heads(conv_out, g.dtype)
        state, outputs = initial.ssm, []
        for t in range(mixed_qkv.shape[0]):
            state, o = gated_delta_step(state, q[t], k[t], v[t], g[t], beta[t])
            outputs.append(o)
            if dst >= 0 and t >= write_start:
                slot = dst + t - write_start
                self.ssm_state[slot] = state
                self.conv_state[slot] = conv_inputs[:, t + 1 : t + self.conv_kernel]  # inputs ending at t
        return torch.stack(outputs).to(mixed_qkv.dtype)
