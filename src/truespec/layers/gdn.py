"""Gated DeltaNet (Qwen3.5 linear-attention layer): in_proj, gates, causal conv, gated delta rule, gated
norm, out_proj. The Triton kernels on CUDA; the torch references of ``ops/`` (gdn.py, conv.py) elsewhere.

State lives in flat slots the runner binds (see forward_context.py for the slot protocol):
  conv_state: [num_slots, conv_dim, kernel - 1] in the model dtype: the last kernel-1 conv *inputs*.
  ssm_state:  [num_slots, num_v_heads, head_k_dim, head_v_dim] in the compute dtype (fp32, fp64 for fp64).
Request r starts from slot ``state_src[r]`` (-1: zeros), runs its tokens one by one, and writes the
conv window and recurrent state after each query token t >= state_write_start[r] into slot
``state_dst[r] + t - state_write_start[r]`` (invariant 2); ``state_dst == -1`` writes nothing.
"""

from typing import TYPE_CHECKING

import torch
from torch import nn

from truespec.cpu_kernels import gdn as cpu_gdn
from truespec.forward_context import ForwardContext, get_forward_context
from truespec.layers.backend import kernels, use_kernels
from truespec.layers.linear import Linear, MergedLinear, use_checkpoint_names
from truespec.layers.norm import GatedRMSNorm
from truespec.ops.activation import get_activation
from truespec.ops.gdn import gdn_gating_ref
from truespec.ops.gdn_batched import StepRows, causal_conv1d_batched, gdn_recurrent_batched
from truespec.ops.precision import compute_dtype
from truespec.ops.state_slots import StateSlots

if TYPE_CHECKING:
    from truespec.kernels.gdn_chunked_plan import ChunkedPlan


def chunked_prefill_min_len(model: nn.Module, device: torch.device) -> int | None:
    """The chunk length from which GDN prefill runs fla's chunk kernel in ``model`` on ``device`` (kernels/
    gdn_chunked.MIN_CHUNK_LEN), or None where it never does: no GDN layer, not the Triton kernels on CUDA, not a
    bf16 / fp16 model, fla not importable, or a head_k_dim fla cannot take. The engine's GdnPrefillRule follows."""
    layers = model.gdn_layers()
    probe = torch.empty(0, dtype=model.dtype, device=device)
    if not layers or not use_kernels(probe) or model.dtype not in (torch.bfloat16, torch.float16):
        return None
    chunked = kernels().gdn_chunked
    if not chunked.is_available() or any(layer.head_k_dim > chunked.MAX_HEAD_K_DIM for layer in layers):
        return None
    return chunked.MIN_CHUNK_LEN


def _use_chunked_prefill(x: torch.Tensor, ctx: ForwardContext) -> bool:
    """Whether an eager step's long prefill chunks go through fla's chunk kernel (kernels/gdn_chunked.py): only
    with fla installed, for bf16 / fp16 models (fla's matrix products run in the model's 16-bit dtype or TF32, so
    fp32 and fp64 models, the ones exactness checks use, keep the token loop), never while a CUDA graph is being
    captured, and only when a request asks for it (``ctx.gdn_chunked_cpu``, a GdnPrefillRule's path) or, without
    such flags, when a request's chunk is long enough to gain (the engine splits prompts into chunks of
    max_num_batched_tokens)."""
    if x.dtype not in (torch.bfloat16, torch.float16) or ctx.state_cpu is None:
        return False
    chunked = kernels().gdn_chunked  # the module: its threshold, and whether fla can run here
    flags = ctx.gdn_chunked_cpu
    wanted = any(flags) if flags is not None else ctx.max_query_len >= chunked.MIN_CHUNK_LEN
    if not wanted or not chunked.is_available():
        return False
    return not torch.cuda.is_current_stream_capturing()


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
        get_activation(hidden_act)  # unsupported names fail at construction
        self.hidden_act = hidden_act
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

    def takes_kernels(self, x: torch.Tensor) -> bool:
        """Whether ``forward`` runs the Triton kernels on ``x`` (CUDA; tests force them on the CPU)."""
        return use_kernels(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden_size] -> [T, hidden_size]; rows past the context's tokens stay zero before out_proj.
        if self.conv_state is None or self.ssm_state is None:
            raise RuntimeError("GatedDeltaNet conv_state/ssm_state are not bound: the model runner must bind them")
        ctx = get_forward_context()
        if self.takes_kernels(x):
            return self._forward_kernels(x, ctx)
        mixed_qkv, z, b, a = self.in_proj.split(self.in_proj(x))  # [T, conv_dim], [T, value_dim], [T, HV] x 2
        weights = (self.conv1d.weight, self.A_log, self.dt_bias, self.norm.weight)  # what the C kernel reads
        if self.hidden_act == "silu" and cpu_gdn.can_run(x, self.conv_state, self.ssm_state, *weights):
            core = cpu_gdn.gdn_core(
                mixed_qkv, z, a, b, self.conv1d.weight, self.A_log, self.dt_bias, self.norm.weight, self.norm.eps,
                self.conv_state, self.ssm_state, ctx.query_start_loc, ctx.state_src, ctx.state_dst,
                ctx.state_write_start, (self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim),
            )  # fmt: skip
            return self.out_proj(core)
        slots, rows = self._step_rows(ctx)
        g, beta = gdn_gating_ref(a, b, self.A_log, self.dt_bias)  # [T, HV] each, compute dtype
        conv_out = causal_conv1d_batched(mixed_qkv, self.conv1d.weight, self.conv_state, slots, rows, self.hidden_act)
        core = gdn_recurrent_batched(*self._split_heads(conv_out), g, beta, self.ssm_state, rows)
        core = self.norm(core, z.unflatten(-1, (self.num_v_heads, self.head_v_dim)))
        return self.out_proj(core.reshape(x.shape[0], self.value_dim))

    def _step_rows(self, ctx: ForwardContext) -> tuple[StateSlots, StepRows]:
        """The step's slot metadata on the host and its index tensors, built by the first GDN layer of a forward and
        shared by the others (ForwardContext.host_cache)."""
        key = f"gdn_rows_{self.conv_kernel}"
        if key not in ctx.host_cache:
            slots = StateSlots.from_tensors(ctx.query_start_loc, ctx.state_src, ctx.state_dst, ctx.state_write_start)
            ctx.host_cache[key] = slots, StepRows.of(slots, self.conv_kernel, ctx.query_start_loc.device)
        return ctx.host_cache[key]

    def _forward_kernels(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The same layer through the Triton kernels: no host sync, graph-safe (tests/test_gdn_kernels.py). A decode
        step launches 6 kernels: in_proj, conv window gather, conv, recurrence (gates fused), gated norm, out_proj."""
        k_ops = kernels()
        meta = (ctx.query_start_loc, ctx.state_src, ctx.state_dst, ctx.state_write_start)
        mixed_qkv, z, b, a = self.in_proj.split(self.in_proj(x))
        conv = (mixed_qkv, self.conv1d.weight, self.conv_state, *meta, self.hidden_act)
        pieces = ctx.pieces  # a piecewise capture (worker/piecewise_graphs.py): fla's call between two pieces
        if pieces is not None or _use_chunked_prefill(x, ctx):  # q, k, v: three contiguous blocks, as fla takes them
            if pieces is None:
                flags, conv_out, gates_out = self._chunked_plan(ctx).chunked_flags, None, None
            else:  # what the pieces read of the step's plan, and fla's inputs, live in static buffers
                flags = pieces.chunked_flags(self._chunked_plan)
                conv_out = pieces.buffer("gdn_conv", x.shape[0] * self.conv_dim, mixed_qkv.dtype)
                gates_out = pieces.buffer("gdn_gates", k_ops.gating_buffer_size(x.shape[0], self.num_v_heads),
                                          compute_dtype(a.dtype))  # fmt: skip
            # the chunk kernel's requests' q / k L2-normalised by the conv, not by fla (two launches fewer)
            normalise = flags if self.head_k_dim & (self.head_k_dim - 1) == 0 else None
            q, k, v = k_ops.causal_conv1d(*conv, split=(self.key_dim, self.key_dim, self.value_dim),
                                          l2norm_rows=normalise, l2norm_head_dim=self.head_k_dim, out=conv_out)
            q, k, v = self._heads(q, k, v)
            g, beta = k_ops.gdn_gating(a, b, self.A_log, self.dt_bias, gates_out)  # fla takes the gates as tensors

            def chunked_core(step: ForwardContext) -> torch.Tensor:  # the step's host metadata: a replay's own
                if step.state_cpu is None:  # moved on the device (shift_positions): the token loop, no fla request
                    if any(step.gdn_chunked_cpu or ()):
                        raise RuntimeError("a step moved on the device holds a request for fla's chunk kernel")
                    return k_ops.gdn_recurrent(q, k, v, g, beta, self.ssm_state, *meta)
                return k_ops.gdn_chunked.gdn_chunked(q, k, v, g, beta, self.ssm_state, *meta, **self._host(step),
                                                     qk_normalized=normalise is not None)  # fmt: skip

            core = chunked_core(ctx) if pieces is None else pieces.eager(chunked_core)
        else:  # the gates are computed inside the recurrent kernel (bitwise as gdn_gating): one launch fewer
            q, k, v = self._split_heads(k_ops.causal_conv1d(*conv))
            gates = k_ops.GateInputs(a, b, self.A_log, self.dt_bias)
            core = k_ops.gdn_recurrent(q, k, v, None, None, self.ssm_state, *meta, gate_inputs=gates)
        v_heads = (self.num_v_heads, self.head_v_dim)
        core = k_ops.rms_norm(core, self.norm.weight, self.norm.eps, gate=z.unflatten(-1, v_heads))
        return self.out_proj(core.reshape(x.shape[0], self.value_dim))

    def _host(self, ctx: ForwardContext) -> dict:
        """``gdn_chunked``'s host arguments for the step of ``ctx``."""
        src, dst, write_start = ctx.state_cpu
        return {"query_start_loc_cpu": ctx.query_start_loc_cpu, "state_src_cpu": src, "state_dst_cpu": dst,
                "state_write_start_cpu": write_start, "is_chunked_cpu": ctx.gdn_chunked_cpu,
                "plan_cache": ctx.host_cache}  # fmt: skip

    def _chunked_plan(self, ctx: ForwardContext) -> "ChunkedPlan":
        """The step's ChunkedPlan (kernels/gdn_chunked_plan.py), built by the first GDN layer, shared by the others."""
        meta = (ctx.query_start_loc, ctx.state_src, ctx.state_dst, ctx.state_write_start)
        return kernels().gdn_chunked.step_plan(self.ssm_state, self.head_k_dim, *meta, **self._host(ctx))

    def _split_heads(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, conv_dim] -> views q, k [T, num_k_heads, head_k_dim] and v [T, num_v_heads, head_v_dim]."""
        return self._heads(*conv_out.split([self.key_dim, self.key_dim, self.value_dim], dim=-1))

    def _heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k [T, key_dim] and v [T, value_dim] as views [T, heads, head_dim]."""
        k_heads, v_heads = (self.num_k_heads, self.head_k_dim), (self.num_v_heads, self.head_v_dim)
        return q.unflatten(-1, k_heads), k.unflatten(-1, k_heads), v.unflatten(-1, v_heads)
