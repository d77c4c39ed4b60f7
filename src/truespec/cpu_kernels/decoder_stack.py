"""Every decoder layer of a step and the final norm in one compiled call (decoder_stack.c): the CPU path of a model
whose layers all hold a bound call for the step (gdn_layer.py, attention_layer.py). Each layer runs the same C function
as its own call would, on the same rows, so the bits are the per-layer path's; what goes is the Python between layers
(module calls, argument lists, allocations: ~40 us a layer, a third of the embedded model's decode step; BENCHMARKS.md,
session 23).
"""

import ctypes

import torch

from truespec.cpu_kernels import build
from truespec.cpu_kernels.attention_layer import AttentionLayerCall, rope_tables
from truespec.cpu_kernels.gdn_layer import GdnLayerCall

ENABLED = True  # tests compare against one call per layer by turning it off


class DecoderStackCall:
    """The stack of one model's layer calls, in layer order, kept while those calls are (the caller compares them)."""

    def __init__(self, calls: list[GdnLayerCall | AttentionLayerCall], norm_weight: torch.Tensor, norm_eps: float,
                 norm_unit: bool) -> None:  # fmt: skip
        if not calls or any(c.dtype != calls[0].dtype or c.dim != calls[0].dim for c in calls) \
                or norm_weight.shape != (calls[0].dim,) or norm_weight.dtype != calls[0].dtype:
            raise ValueError("decoder_stack: the layer calls and the final norm must share one dtype and hidden size")
        self.calls, self.dtype, self.dim = calls, calls[0].dtype, calls[0].dim
        self._bound = (ctypes.c_void_p * len(calls))(*(c.bound.address for c in calls))
        self._kinds = torch.tensor([int(isinstance(c, AttentionLayerCall)) for c in calls], dtype=torch.int64)
        self._norm = norm_weight.detach().contiguous()  # the pointer below reads it
        self.norm_args = (self._norm.data_ptr(), norm_eps, int(norm_unit))
        self.work_per_row = max(c.work_per_row for c in calls)
        suffix, scalar = build.SCALARS[self.dtype]
        p, i = build.POINTER, build.INT
        self.fn = build.function(f"decoder_stack_{suffix}", [i, p, p, p, p, p, i, i, p, i, p, p, p, p, p, i, p, i, p,
                                                             p, i, p, scalar, ctypes.c_int, p, p])  # fmt: skip

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, gdn_meta: tuple[torch.Tensor, ...],
                 attention_meta: tuple[torch.Tensor, ...]) -> torch.Tensor:  # fmt: skip
        """The model's hidden states [M, D] (after its final norm) for h [M, D], as ``base.run_decoder_layers`` gives
        them. ``gdn_meta`` = (query_start_loc, state_src, state_dst, state_write_start), ``attention_meta`` =
        (block_tables, seq_lens, slot_mapping) of the step."""
        num_rows = h.shape[0]
        buffers = torch.empty(4, num_rows, self.dim, dtype=self.dtype)  # layer inputs (two), the stream, the result
        buffers[0] = h
        cos, sin = rope_tables(cos, sin, num_rows)
        qsl, src, dst, wstart = (build.as_int64(t) for t in gdn_meta)
        tables, seq_lens, slots = (build.as_int64(t) for t in attention_meta)
        work = build.work_buffer(num_rows * self.work_per_row, self.dtype)
        status = self.fn(len(self.calls), self._bound, self._kinds.data_ptr(), buffers[0].data_ptr(),
                         buffers[1].data_ptr(), buffers[2].data_ptr(), num_rows, self.dim, qsl.data_ptr(),
                         qsl.shape[0] - 1, src.data_ptr(), dst.data_ptr(), wstart.data_ptr(), cos.data_ptr(),
                         sin.data_ptr(), cos.shape[-1], tables.data_ptr(), tables.stride(0), seq_lens.data_ptr(),
                         slots.data_ptr(), slots.shape[0], *self.norm_args, work.data_ptr(),
                         buffers[3].data_ptr())  # fmt: skip
        if status:
            raise MemoryError("decoder_stack: a layer's CPU kernel could not allocate its scratch")
        return buffers[3]
