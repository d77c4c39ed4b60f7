"""A decoder layer's second half in one compiled call (mlp_block.c): stream + x, RMSNorm, gate_up, SiLU(gate) * up,
down. The CPU path of the post-attention norm and MLP of Qwen3.5's attention layers (its GDN layers run whole,
gdn_layer.py, whose MLP is this same function) where the kernels take every stage. Whether a layer takes it depends
on its weights and dtype only, never on the step, so a layer's rows take it at every step or never.
"""

import ctypes

import torch

from truespec.cpu_kernels import build
from truespec.cpu_kernels import linear as cpu_linear

ENABLED = True  # tests compare against the stage-by-stage path by turning it off


def can_run(x: torch.Tensor, norm_weight: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether ``MlpBlockCall`` takes these weights for rows like ``x``: a float32 / float64 model on the CPU whose two
    projections take the packed kernel (linear.py), no autograd to record, the library built."""
    return ENABLED and x.device.type == "cpu" and x.dim() == 2 and x.dtype in build.SCALARS \
        and norm_weight.dtype == x.dtype and all(cpu_linear.can_run(x, m) for m in (gate_up, down)) \
        and not build.tracks_grad(x, norm_weight)


class MlpBlockCall:
    """The call for one layer's weights, bound once (packed projections, pointers, shapes), for a caller that keeps
    it while those weights stay the same (models/qwen3_5_cpu.KeptCalls, by ``build.tensor_key``)."""

    def __init__(self, norm_weight: torch.Tensor, norm_eps: float, norm_unit: bool, gate_up: torch.Tensor,
                 down: torch.Tensor) -> None:  # fmt: skip
        (dim,), inter = norm_weight.shape, down.shape[1]
        if gate_up.shape != (2 * inter, dim) or down.shape != (dim, inter):
            raise ValueError(f"mlp_block: gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} do not fit "
                             f"hidden size {dim}")  # fmt: skip
        self.tensors = (norm_weight, gate_up, down)
        self.dtype, self.dim, self.inter = norm_weight.dtype, dim, inter
        self._norm = norm_weight.detach().contiguous()  # the pointer below reads it
        suffix, scalar = build.SCALARS[self.dtype]
        p, i = build.POINTER, build.INT
        self.fn = build.function(f"mlp_block_{suffix}", [p, p, i, i, p, scalar, ctypes.c_int, p, i, p, p, p, p])
        self._packs = (cpu_linear.packed_copy(gate_up), cpu_linear.packed_copy(down))  # held: the pointers read them
        self.weight_args = (self._norm.data_ptr(), norm_eps, int(norm_unit), self._packs[0].data_ptr(), inter,
                            self._packs[1].data_ptr())  # fmt: skip

    def __call__(self, x: torch.Tensor, stream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, stream + x) for x, stream [M, D] of the layer's dtype (checked by the caller)."""
        x, stream = x.contiguous(), stream.contiguous()
        work = build.work_buffer(x.shape[0] * (self.dim + 3 * self.inter), x.dtype)
        out, stream_out = torch.empty_like(x), torch.empty_like(x)
        self.fn(x.data_ptr(), stream.data_ptr(), x.shape[0], self.dim, *self.weight_args, work.data_ptr(),
                out.data_ptr(), stream_out.data_ptr())  # fmt: skip
        return out, stream_out
