"""A whole Qwen3.5 GDN decoder layer for a step in one compiled call (gdn_layer.c): the CPU path of
models/qwen3_5.Qwen3_5DecoderLayer where every stage has its kernel (norm.py, linear.py, gdn.py would each take it).

Python's part of a call is its argument list and two output buffers: the layer was ~25 calls (norms, four projections,
the GDN core, the MLP's act * mul), and their argument checks, allocations and module calls cost more than the
arithmetic of a small model (BENCHMARKS.md, session 22). Whether a layer takes this path depends on its weights and
dtype only, never on the step (a row's bits must not depend on the rest of its batch), so a layer takes it for every
step or for none.
"""

import ctypes
from typing import NamedTuple

import torch

from truespec.cpu_kernels import build
from truespec.cpu_kernels import linear as cpu_linear
from truespec.ops.gdn import L2NORM_EPS

ENABLED = True  # tests compare against the stage-by-stage path by turning it off


class GdnLayerWeights(NamedTuple):
    """What the kernel reads of one layer (the model gathers it from its modules)."""

    input_norm: torch.Tensor  # [D]
    input_norm_eps: float
    input_norm_unit: bool  # (1 + w) RMSNorm
    post_norm: torch.Tensor  # [D]
    post_norm_eps: float
    post_norm_unit: bool
    in_proj: torch.Tensor  # [C + HV DV + 2 HV, D]: q | k | v, z, b, a
    out_proj: torch.Tensor  # [D, HV DV]
    gate_up: torch.Tensor  # [2 I, D]
    down: torch.Tensor  # [D, I]
    conv: torch.Tensor  # [C, 1, K] or [C, K]
    A_log: torch.Tensor  # [HV]  # noqa: N815
    dt_bias: torch.Tensor  # [HV]
    gated_norm: torch.Tensor  # [DV]
    gated_norm_eps: float
    heads: tuple[int, int, int, int]  # (HK, HV, DK, DV)


def can_run(h: torch.Tensor, w: GdnLayerWeights, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> bool:
    """Whether ``gdn_layer`` takes this layer: a float32 / float64 model on the CPU whose projections all take the
    packed kernel, states laid out as the layer allocates them, no autograd to record, the library built."""
    if not ENABLED or h.device.type != "cpu" or h.dtype not in build.SCALARS or h.dim() != 2:
        return False
    weights = (w.input_norm, w.post_norm, w.conv, w.A_log, w.dt_bias, w.gated_norm)
    matrices = (w.in_proj, w.out_proj, w.gate_up, w.down)
    return all(t.dtype == h.dtype for t in (*weights, *matrices, conv_state, ssm_state)) \
        and all(cpu_linear.can_run(h, m) for m in matrices) and conv_state[0].is_contiguous() \
        and ssm_state[0].is_contiguous() and not build.tracks_grad(h, *weights)


class GdnLayerCall:
    """``gdn_layer`` for one layer with everything the step does not change bound once (the weights' packed copies
    and pointers, the shapes, the function), for a caller that keeps it while the tensors it was built from stay the
    same (models/qwen3_5_cpu.KeptCalls, by ``build.tensor_key``)."""

    def __init__(self, w: GdnLayerWeights, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> None:
        _check_shapes(w, conv_state)
        num_k, num_v, dk, dv = w.heads
        dim, kernel = w.input_norm.shape[0], w.conv.shape[-1]
        self.inter, self.n_in = w.down.shape[1], w.in_proj.shape[0]
        matrices = (w.in_proj, w.out_proj, w.gate_up, w.down)
        vectors = (w.input_norm, w.post_norm, w.conv, w.A_log, w.dt_bias, w.gated_norm)
        self.tensors = (*vectors, *matrices)  # the weights (the caller asks autograd about them per call)
        self.dtype, self.dim, self.value_dim = w.in_proj.dtype, dim, num_v * dv
        kept = tuple(t.detach().contiguous() for t in vectors)  # the bound pointers read these and the packed copies
        packs = tuple(cpu_linear.packed_copy(m) for m in matrices)
        packed = [t.data_ptr() for t in packs]
        suffix, scalar = build.SCALARS[self.dtype]
        p, i, flag = build.POINTER, build.INT, ctypes.c_int
        args = (dim, kept[0].data_ptr(), w.input_norm_eps, int(w.input_norm_unit), kept[1].data_ptr(), w.post_norm_eps,
                int(w.post_norm_unit), packed[0], self.n_in, packed[1], packed[2], self.inter, packed[3],
                *(t.data_ptr() for t in kept[2:]), w.gated_norm_eps, conv_state.data_ptr(), conv_state.stride(0),
                ssm_state.data_ptr(), ssm_state.stride(0), num_k, num_v, dk, dv, kernel, dk**-0.5, L2NORM_EPS)
        argtypes = [i, p, scalar, flag, p, scalar, flag, p, i, p, p, i, p, p, p, p, p, scalar, p, i, p, i, i, i, i, i,
                    i, scalar, scalar]  # fmt: skip
        self.bound = build.Bound(f"gdn_layer_bind_{suffix}", argtypes, args, kept + packs)
        self.work_per_row = 3 * dim + self.n_in + self.value_dim + 3 * self.inter  # gdn_layer.c's scratch
        self.fn = build.function(f"gdn_layer_run_{suffix}", [p, p, p, i, p, p, p, p, i, p, p, p])

    def __call__(self, h: torch.Tensor, residual: torch.Tensor | None,
                 meta: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """``gdn_layer``'s result for this step (h [M, D] of the layer's dtype on the CPU: checked by the caller)."""
        h = h.contiguous()
        residual = None if residual is None else residual.contiguous()
        num_rows = h.shape[0]
        work = build.work_buffer(num_rows * self.work_per_row, h.dtype)
        out, residual_out = torch.empty_like(h), torch.empty_like(h)
        qsl, src, dst, wstart = (build.as_int64(t) for t in meta)
        status = self.fn(self.bound.address, h.data_ptr(), None if residual is None else residual.data_ptr(), num_rows,
                         qsl.data_ptr(), src.data_ptr(), dst.data_ptr(), wstart.data_ptr(), src.shape[0],
                         work.data_ptr(), out.data_ptr(), residual_out.data_ptr())  # fmt: skip
        if status:
            raise MemoryError("gdn_layer: the CPU kernel could not allocate its scratch buffers")
        return out, residual_out


def _check_shapes(w: GdnLayerWeights, conv_state: torch.Tensor) -> None:
    num_k, num_v, dk, dv = w.heads
    dim, inter = w.input_norm.shape[0], w.down.shape[1]
    channels, kernel = 2 * num_k * dk + num_v * dv, w.conv.shape[-1]
    shapes = {"in_proj": (w.in_proj.shape, (channels + num_v * dv + 2 * num_v, dim)),
              "out_proj": (w.out_proj.shape, (dim, num_v * dv)), "gate_up": (w.gate_up.shape, (2 * inter, dim)),
              "down": (w.down.shape, (dim, inter)), "conv_state": (conv_state.shape[1:], (channels, kernel - 1))}
    wrong = [f"{name} {tuple(got)} (expected {want})" for name, (got, want) in shapes.items() if tuple(got) != want]
    if wrong:
        raise ValueError(f"gdn_layer: {', '.join(wrong)} for hidden size {dim} and heads {w.heads}")


def gdn_layer(h: torch.Tensor, residual: torch.Tensor | None, w: GdnLayerWeights, conv_state: torch.Tensor,
              ssm_state: torch.Tensor, meta: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(MLP output, residual stream after the GDN) as the layer's forward returns them, updating the states by the slot
    protocol (layers/gdn.py); ``meta`` = (query_start_loc, state_src, state_dst, state_write_start). Check
    ``can_run`` first; a caller that runs a layer every step keeps its ``GdnLayerCall`` instead."""
    return GdnLayerCall(w, conv_state, ssm_state)(h, residual, meta)
