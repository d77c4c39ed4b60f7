"""A whole Qwen3.5 gated-attention decoder layer for a step in one compiled call
(attention_layer.c): the CPU path of models/qwen3_5.Qwen3_5DecoderLayer where every stage has its kernel (norm.py,
linear.py, rotary.py, attention.py, activation.py and mlp_block.py would each take it).

The layer was ~12 calls with their argument checks, views and allocations (about 170 us of a ~2 ms decode step of the
embedded model per attention layer: BENCHMARKS.md, session 23). Each stage is the C function that runs it alone, so
a row gets the same bits on either path.
"""

import ctypes
from typing import NamedTuple

import torch

from truespec.cpu_kernels import build
from truespec.cpu_kernels import linear as cpu_linear
from truespec.cpu_kernels.rotary import MAX_HEAD_DIM

ENABLED = True  # tests compare against the stage-by-stage path by turning it off


class AttentionLayerWeights(NamedTuple):
    """What the kernel reads of one layer (the model gathers it from its modules)."""

    input_norm: torch.Tensor  # [D]
    input_norm_eps: float
    input_norm_unit: bool  # (1 + w) RMSNorm
    post_norm: torch.Tensor  # [D]
    post_norm_eps: float
    post_norm_unit: bool
    qkv: torch.Tensor  # [2 H Dh + 2 H_kv Dh, D]: per head [q | gate], then k, v
    o_proj: torch.Tensor  # [D, H Dh]
    gate_up: torch.Tensor  # [2 I, D]
    down: torch.Tensor  # [D, I]
    q_norm: torch.Tensor  # [Dh]
    k_norm: torch.Tensor  # [Dh]
    qk_norm_eps: float
    qk_norm_unit: bool
    heads: tuple[int, int, int]  # (H, H_kv, Dh)
    scale: float


def can_run(h: torch.Tensor, w: AttentionLayerWeights, kv_cache: torch.Tensor) -> bool:
    """Whether ``AttentionLayerCall`` takes this layer: a float32 / float64 model on the CPU whose projections all take
    the packed kernel, a contiguous cache of its dtype ([2, blocks, block_size, H_kv, Dh]), no autograd to record,
    the library built."""
    if not ENABLED or h.device.type != "cpu" or h.dtype not in build.SCALARS or h.dim() != 2:
        return False
    num_heads, num_kv_heads, head_dim = w.heads
    vectors = (w.input_norm, w.post_norm, w.q_norm, w.k_norm)
    matrices = (w.qkv, w.o_proj, w.gate_up, w.down)
    return all(t.dtype == h.dtype for t in (*vectors, *matrices, kv_cache)) and kv_cache.is_contiguous() \
        and kv_cache.dim() == 5 and tuple(kv_cache.shape[-2:]) == (num_kv_heads, head_dim) \
        and head_dim <= MAX_HEAD_DIM and all(cpu_linear.can_run(h, m) for m in matrices) \
        and not build.tracks_grad(h, *vectors)


class AttentionLayerCall:
    """The layer's call with everything the step does not change bound once (packed weights, pointers, the cache,
    shapes), for a caller that keeps it while those tensors stay the same (models/qwen3_5_cpu.KeptCalls)."""

    def __init__(self, w: AttentionLayerWeights, kv_cache: torch.Tensor) -> None:
        _check_shapes(w)
        num_heads, num_kv_heads, head_dim = w.heads
        self.dim, self.inter = w.input_norm.shape[0], w.down.shape[1]
        self.num_qkv, self.heads = w.qkv.shape[0], w.heads
        self.dtype, self.tensors = w.qkv.dtype, (w.input_norm, w.post_norm, w.q_norm, w.k_norm)
        kept = tuple(t.detach().contiguous() for t in self.tensors)  # the bound pointers read these and the packs
        matrices = (w.qkv, w.o_proj, w.gate_up, w.down)
        self.tensors += matrices  # the weights (the caller asks autograd about them per call)
        packs = tuple(cpu_linear.packed_copy(m) for m in matrices)
        suffix, scalar = build.SCALARS[self.dtype]
        p, i, flag = build.POINTER, build.INT, ctypes.c_int
        vectors, packed = [t.data_ptr() for t in kept], [t.data_ptr() for t in packs]
        args = (self.dim, vectors[0], w.input_norm_eps, int(w.input_norm_unit), vectors[1], w.post_norm_eps,
                int(w.post_norm_unit), *packed[:3], self.inter, packed[3], vectors[2], vectors[3], w.qk_norm_eps,
                int(w.qk_norm_unit), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), kv_cache.shape[2], num_heads,
                num_kv_heads, head_dim, w.scale)  # fmt: skip
        argtypes = [i, p, scalar, flag, p, scalar, flag, p, p, p, i, p, p, p, scalar, flag, p, p, i, i, i, i, scalar]
        self.bound = build.Bound(f"attention_layer_bind_{suffix}", argtypes, args, kept + packs + (kv_cache,))
        # attention_layer.c's scratch
        self.work_per_row = 3 * self.dim + self.num_qkv + (3 * num_heads + num_kv_heads) * head_dim + 3 * self.inter
        run_types = [p, p, p, i, p, p, i, p, i, p, p, i, p, i, p, p, p]
        self.fn = build.function(f"attention_layer_run_{suffix}", run_types)

    def __call__(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                 meta: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(MLP output, residual stream after the attention) for h [M, D] of the layer's dtype (checked by the caller);
        ``meta`` = (block_tables, query_start_loc, seq_lens, slot_mapping) of the step."""
        h = h.contiguous()
        residual = None if residual is None else residual.contiguous()
        cos, sin = rope_tables(cos, sin, h.shape[0])
        work = build.work_buffer(h.shape[0] * self.work_per_row, h.dtype)
        out, residual_out = torch.empty_like(h), torch.empty_like(h)
        tables, qsl, seq_lens, slots = (build.as_int64(t) for t in meta)
        status = self.fn(self.bound.address, h.data_ptr(), None if residual is None else residual.data_ptr(),
                         h.shape[0], cos.data_ptr(), sin.data_ptr(), cos.shape[-1], tables.data_ptr(),
                         tables.stride(0), qsl.data_ptr(), seq_lens.data_ptr(), seq_lens.shape[0], slots.data_ptr(),
                         slots.shape[0], work.data_ptr(), out.data_ptr(),
                         residual_out.data_ptr())  # fmt: skip
        if status:
            raise MemoryError("attention_layer: the CPU kernel could not allocate its score buffer")
        return out, residual_out


def rope_tables(cos: torch.Tensor, sin: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin as the kernel reads them ([num_rows, rot], contiguous); ValueError if they do not fit."""
    if cos.shape != (num_rows, cos.shape[-1]) or sin.shape != cos.shape:
        raise ValueError(f"attention_layer: cos {tuple(cos.shape)} / sin {tuple(sin.shape)} for {num_rows} rows")
    return cos.contiguous(), sin.contiguous()


def _check_shapes(w: AttentionLayerWeights) -> None:
    num_heads, num_kv_heads, head_dim = w.heads
    dim, inter = w.input_norm.shape[0], w.down.shape[1]
    shapes = {"qkv": (w.qkv.shape, (2 * (num_heads + num_kv_heads) * head_dim, dim)),
              "o_proj": (w.o_proj.shape, (dim, num_heads * head_dim)), "gate_up": (w.gate_up.shape, (2 * inter, dim)),
              "down": (w.down.shape, (dim, inter)), "q_norm": (w.q_norm.shape, (head_dim,)),
              "k_norm": (w.k_norm.shape, (head_dim,))}
    wrong = [f"{name} {tuple(got)} (expected {want})" for name, (got, want) in shapes.items() if tuple(got) != want]
    if wrong or num_heads % num_kv_heads:
        raise ValueError(f"attention_layer: {', '.join(wrong) or 'heads'} for hidden size {dim} and heads {w.heads}")
