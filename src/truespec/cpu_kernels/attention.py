"""The attention of every row of a step (decodes, verifies, prefill chunks of any length) over a model-dtype paged
cache in one compiled call: the CPU path of layers/attention.py where build.py could build attention_core.c. Each row
is computed by itself in a fixed order, so a prompt position has the same bits however its prompt is chunked and a
verify row those of the same decode row. (ops/attention_batched.py's tiled products, the path without the library,
ran long chunks as products of two rows each for the same reason: the C rows prefill ~1.8x faster; BENCHMARKS.md,
session 24.)"""

import torch

from truespec.cpu_kernels import build


def can_run(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether ``attention_rows`` takes this step: a float32 / float64 model on the CPU over a contiguous cache of its
    dtype ([2, blocks, block_size, kv heads, D]), and the library built."""
    return q.device.type == "cpu" and q.dtype in build.SCALARS and kv_cache.dtype == q.dtype \
        and kv_cache.dim() == 5 and kv_cache.is_contiguous() and not build.tracks_grad(q) and build.load() is not None


def attention_rows(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                   block_tables: torch.Tensor, scale: float, out: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """Writes into ``out`` [T, H, D] the rows of every request (``paged_attention_ref``'s values for them); padding
    rows past ``query_start_loc[-1]`` are left as they are. Check ``can_run`` first."""
    num_heads, head_dim = q.shape[1:]
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    if num_heads % num_kv_heads or kv_cache.shape[-1] != head_dim or q.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError(f"q {tuple(q.shape)} and kv_cache {tuple(kv_cache.shape)} do not fit (unit last strides)")
    suffix, scalar = build.SCALARS[q.dtype]
    meta = [build.as_int64(t) for t in (block_tables, query_start_loc, seq_lens)]
    p, i = build.POINTER, build.INT
    argtypes = [p, i, i, p, p, p, i, p, p, i, i, i, i, i, scalar, p, i, i]
    status = build.function(f"attention_rows_{suffix}", argtypes)(
        q.data_ptr(), q.stride(0), q.stride(1), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), meta[0].data_ptr(),
        meta[0].stride(0), meta[1].data_ptr(), meta[2].data_ptr(), meta[2].shape[0], num_heads,
        num_kv_heads, head_dim, block_size, scale, out.data_ptr(), out.stride(0), out.stride(1),
    )  # fmt: skip
    if status:
        raise MemoryError("attention_rows: the CPU kernel could not allocate its score buffer")
    return out


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``reshape_and_cache_ref``: k / v [T', H_kv, D] (unit last strides) at ``slot_mapping`` [T] of the model-dtype
    cache (slot -1: nothing). Check ``can_run`` first."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    if k.shape[1:] != (num_kv_heads, head_dim) or v.shape[1:] != k.shape[1:] or k.dtype != kv_cache.dtype \
            or v.dtype != k.dtype or k.stride(-1) != 1 or v.stride(-1) != 1 or k.shape[0] < slot_mapping.shape[0]:
        raise ValueError(f"store_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, cache {tuple(kv_cache.shape)} do not fit")
    suffix, _ = build.SCALARS[k.dtype]
    slots = build.as_int64(slot_mapping)
    p, i = build.POINTER, build.INT
    build.function(f"store_kv_{suffix}", [p, i, i, p, i, i, p, i, i, i, p, p])(
        k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1), slots.data_ptr(),
        slots.shape[0], num_kv_heads, head_dim, kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
    )  # fmt: skip
