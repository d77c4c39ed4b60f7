"""Paged causal attention read straight from a packed (compressed) KV cache: ``fp8`` and the TurboQuant presets.

The cache is uint8 [num_blocks, block_size, num_kv_heads, bytes_per_token]; one slot (token, KV head) holds its
key part then its value part, laid out as kv_cache/formats.py describes. This wrapper checks the cache, rotates q
once for Lloyd-Max keys (q @ H in fp32, fp64 for fp64 q, by kernels/hadamard.py) and runs the model-dtype kernel of
kernels/paged_attention.py with the format's tile encodings (kernels/kv_tiles.py): the same split-KV loop, online
softmax, merge kernel, workspace chunking and sparse-V tile skip, with each K / V tile decoded in registers where
the model-dtype kernel loads it (never written back):

- ``fp8`` keys / values: D bytes, bitcast to ``tl.float8e4nv`` and widened (scale 1.0, as the reference).
- Lloyd-Max keys (``turboquant_*_nc``): codes unpacked from the little-endian bit stream, centroids picked from
  the table by selects, scores ``<q_rot, c> * scale`` (the stored scale holds the norm correction); keys are never
  rotated back.
- Uniform values: codes unpacked the same way, ``v = code * scale + zero`` (fp16 scale / zero, little-endian).

For 16-bit models the products run on the tensor cores (kv_tiles.py: fp8 bytes, value codes and Lloyd-Max centroids are
exact 16-bit operands; the rotated q is split into two 16-bit halves), accumulated in fp32; fp32 models
multiply decoded tiles in IEEE fp32, fp64 models in fp64. Softmax runs in fp32 (fp64), the output in q's dtype.

A row's split layout and tiles are functions of its number of keys and the compile-time constants only
(kernels/split_merge.py ``row_layout``), so a row gives bitwise the same output as a decode, inside a 1+k verify, a
prefill chunk or any mixed batch (docs/ARCHITECTURE.md invariant 4). Padding rows write zeros. No host reads; grids
and the workspace come from tensor shapes only; the centroid table (per head_dim, bits, dtype, device) and the
rotation's H[0, 0] (kernels/hadamard.py ``h00``) are cached, so a first eager call before capture makes the wrapper
CUDA-graph capturable. The cache is
written by kernels/kv_store_packed.py (``store_packed``).

fp64 q runs under Triton's interpreter only: compiled, Triton 3.6 cannot lower an fp64 ``tl.dot`` whose operand
is decoded in registers ("fp64 don't support largeK MMA"), so the wrapper refuses fp64 on CUDA.

Launch knobs: ``block_n`` and ``num_warps`` reach the kernel as for the model-dtype cache (``num_warps`` None, the
default: the format's own, ``format_num_warps``); ``key_dim_chunk`` (Lloyd-Max
keys only) decodes and scores a key tile that many head dims at a time instead of the whole head, in an unrolled or
(``key_dim_unroll=False``) a runtime loop over the chunks (kernels/kv_tiles.py), to bound the registers of a tile of
centroids at head_dim 256 (issue 14). Each fixes a row's arithmetic, so a model keeps one value for all its calls;
``key_dim_chunk=None`` (the whole head) compiles exactly the loop as it was before the knobs existed. The engine
passes none of them: it runs the defaults.

Not done yet (speed only; correctness does not need them):
- per-layer calibrated fp8 k_scale / v_scale (the formats use 1.0, as the reference).
- GPU tuning for packed caches: only num_warps (8 for 4-bit Lloyd-Max keys, ``LLOYD_MAX_4BIT_WARPS``, at one query
  row over 32K keys; at 4+ rows it was not compared with 4). BLOCK_N / MAX_SPLITS / MIN_SPLIT_KEYS are the
  model-dtype kernel's defaults (benchmarks/packed_attention_tune.py sweeps block_n x num_warps x key_dim_chunk;
  on an H200 its block_n 16 rows for uniform values and Lloyd-Max keys at head_dim 256 over 32K keys were 7e-2 to
  8e-2 away from the default's output, not understood yet; the tests' block_n 16 at small head dims passes).
"""

from functools import cache
from typing import Protocol

import torch

from truespec.kernels import kv_tiles
from truespec.kernels.code_operands import lut_words
from truespec.kernels.hadamard import rotate_rows
from truespec.kernels.paged_attention import (
    BLOCK_N,
    MAX_SPLITS,
    MAX_WORKSPACE_BYTES,
    MIN_SPLIT_KEYS,
    NUM_WARPS,
    CacheTiles,
    model_cache_tiles,
    split_attention,
)
from truespec.kernels.triton_utils import pad_pow2
from truespec.ops.kv_quant import packed_size
from truespec.ops.lloyd_max import lloyd_max_codebook
from truespec.ops.precision import compute_dtype

# kv_cache/formats.py's encoding names (kernels sit below kv_cache in the import order: tests/test_import_graph.py)
FP8, LLOYD_MAX, UNIFORM = "fp8", "lloyd_max", "uniform"
KEY_ENCODINGS = {FP8: kv_tiles.FP8, LLOYD_MAX: kv_tiles.LLOYD_MAX}
VALUE_ENCODINGS = {FP8: kv_tiles.FP8, UNIFORM: kv_tiles.UNIFORM}
LLOYD_MAX_4BIT_WARPS = 8  # format_num_warps


class KVFormat(Protocol):
    """What the kernels read of a ``kv_cache.formats.KVFormat`` (structural: kernels may not import kv_cache)."""

    name: str
    key_encoding: str
    value_encoding: str
    key_bits: int | None
    value_bits: int | None
    norm_correction: bool

    @property
    def is_rotated(self) -> bool: ...

    def key_bytes(self, head_dim: int, model_dtype_bytes: int = 2) -> int: ...

    def bytes_per_token(self, head_dim: int, model_dtype_bytes: int = 2) -> int: ...

    def check_head_dim(self, head_dim: int) -> None: ...


@cache
def _centroid_table(head_dim: int, bits: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Lloyd-Max centroids [2^bits] on ``device`` (cached: no host-to-device copy once warmed up), in ``dtype``; for
    fp32 followed by the byte tables of kernels/code_operands.py (``lut_words``, 8 int32 as fp32 bits), from which
    the GPU kernels look up the centroids as exact bf16 / fp16 operands (``lut_words`` checks they are exact)."""
    centroids = lloyd_max_codebook(head_dim, bits)[0]
    words = lut_words(centroids)
    if dtype == torch.float32:
        return torch.cat([centroids, words.view(torch.float32)]).to(device)
    return centroids.to(device=device, dtype=dtype)


@cache
def _dummy_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(1, dtype=dtype, device=device)


def is_fp16_aligned(kv_cache: torch.Tensor, fp16_fields: list[int]) -> bool:
    """Whether the slots of the uint8 ``kv_cache`` [num_blocks, block_size, num_kv_heads, bytes] hold fp16 fields
    (a key's scale, a value's scale; a zero follows a value's scale), ``fp16_fields`` bytes into a slot, and every
    one of them sits at an even address: then the kernels read each with one 16-bit load (kv_tiles.py
    ``load_fp16``). A property of the cache's layout, not of the batch: fixed for a model's calls."""
    return bool(fp16_fields) and all(x % 2 == 0 for x in (kv_cache.data_ptr(), *kv_cache.stride()[:3], *fp16_fields))


def format_num_warps(fmt: KVFormat) -> int:
    """The split kernel's warps for a cache of ``fmt``, one constant per format (it fixes a row's bits): 8 for 4-bit
    Lloyd-Max keys, whose tiles need ~250 registers a thread at 4 warps (at 8 the kernel ran 1.6x faster with the
    same output bits at one query row over 32K keys, H200, benchmarks/packed_attention_tune.py; BENCHMARKS.md
    session 13; not yet compared at 4+ rows); the engine's 4 for the others (3-bit keys: 8 warps 0.93x)."""
    return LLOYD_MAX_4BIT_WARPS if fmt.is_rotated and fmt.key_bits == 4 else NUM_WARPS


def check_packed_cache(kv_cache: torch.Tensor, fmt: KVFormat, head_dim: int) -> None:
    """Raise a ValueError unless ``kv_cache`` is a uint8 [num_blocks, block_size, num_kv_heads, bytes] cache of
    ``fmt`` (a packed format) at ``head_dim``, each slot's bytes contiguous."""
    if fmt.key_encoding not in KEY_ENCODINGS or fmt.value_encoding not in VALUE_ENCODINGS:
        raise ValueError(f"kv_cache_dtype {fmt.name!r} is not a packed format (use paged_attention)")
    fmt.check_head_dim(head_dim)
    if (kv_cache.dtype != torch.uint8 or kv_cache.dim() != 4 or kv_cache.shape[-1] != fmt.bytes_per_token(head_dim)
            or kv_cache.stride(-1) != 1):  # fmt: skip
        raise ValueError(
            f"kv_cache {tuple(kv_cache.shape)} {kv_cache.dtype} is not a contiguous-slot uint8 cache "
            f"of {fmt.name!r} at head_dim {head_dim}"
        )


def check_key_dim_chunk(key_dim_chunk: int | None, fmt: KVFormat, head_dim: int) -> int:
    """The KEY_DIM_CHUNK constant for ``key_dim_chunk``: the padded head dim for None; else a ValueError unless
    ``fmt`` has Lloyd-Max keys and the chunk is a power of two from 16 (``tl.dot``) to the padded head dim."""
    head_dim_pad = pad_pow2(head_dim)
    if key_dim_chunk is None:
        return head_dim_pad
    if not fmt.is_rotated or key_dim_chunk < 16 or key_dim_chunk > head_dim_pad or key_dim_chunk & (key_dim_chunk - 1):
        raise ValueError(f"key_dim_chunk {key_dim_chunk} needs Lloyd-Max keys (not {fmt.name!r}) and a power of two "
                         f"in [16, {head_dim_pad}]")
    return key_dim_chunk


def paged_attention_packed(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    fmt: KVFormat,
    head_dim: int,
    out: torch.Tensor | None = None,
    block_n: int = BLOCK_N,
    max_splits: int = MAX_SPLITS,
    min_split_keys: int = MIN_SPLIT_KEYS,
    num_warps: int | None = None,
    max_workspace_bytes: int = MAX_WORKSPACE_BYTES,
    sparse_v_threshold: float | None = None,
    sparse_v_min_keys: int = 0,
    key_dim_chunk: int | None = None,
    key_dim_unroll: bool = True,
) -> torch.Tensor:
    """Causal attention of q [T, num_heads, head_dim] over the packed paged ``kv_cache`` uint8
    [num_blocks, block_size, num_kv_heads, fmt.bytes_per_token(head_dim)]; query token i of request r sits at
    position ``seq_lens[r] - query_len + i``. Rows past ``query_start_loc[-1]`` (padding) come back as zeros.
    No host sync and no shape derived from the batch content. The split layout, workspace and sparse-V arguments
    are ``paged_attention``'s: ``block_n``, ``max_splits``, ``min_split_keys``, ``num_warps`` fix each row's
    arithmetic (keep them the same for every call of a model: invariant 4; ``num_warps`` None: the format's own,
    ``CacheTiles.num_warps``); ``sparse_v_threshold`` None is off,
    0 gives the same bits as off. ``key_dim_chunk`` (Lloyd-Max keys): head dims decoded and scored at a time
    (kernels/kv_tiles.py), over the chunks in an unrolled loop (``key_dim_unroll``) or a runtime one; None, the
    whole head, gives the engine's bits; per-model constants too. Returns ``out`` (allocated if None) in q's dtype."""
    q_in, tiles = packed_cache_tiles(q, kv_cache, fmt, head_dim, key_dim_chunk, key_dim_unroll)
    out = torch.empty_like(q) if out is None else out
    return split_attention(q_in, tiles, query_start_loc, seq_lens, block_tables, scale, out, block_n, max_splits,
                           min_split_keys, num_warps or tiles.num_warps, max_workspace_bytes, sparse_v_threshold,
                           sparse_v_min_keys)  # fmt: skip


def cache_tiles(q: torch.Tensor, kv_cache: torch.Tensor, fmt: KVFormat | None) -> tuple[torch.Tensor, CacheTiles]:
    """(q as the kernels read it, how they read ``kv_cache``): a model-dtype cache (``fmt`` None) or a packed one of
    ``fmt`` (``packed_cache_tiles``) at q's head_dim."""
    if fmt is None:
        return q, model_cache_tiles(q, kv_cache)
    return packed_cache_tiles(q, kv_cache, fmt, q.shape[-1])


def packed_cache_tiles(q: torch.Tensor, kv_cache: torch.Tensor, fmt: KVFormat, head_dim: int,
                       key_dim_chunk: int | None = None, key_dim_unroll: bool = True
                       ) -> tuple[torch.Tensor, CacheTiles]:  # fmt: skip
    """(q as the kernels read it, how they read the packed ``kv_cache``): q rotated once (q @ H, in the accumulator
    dtype) for Lloyd-Max keys, else q itself; a ValueError if q and the cache do not fit. ``key_dim_chunk``,
    ``key_dim_unroll``: see ``paged_attention_packed`` (None: the whole head)."""
    check_packed_cache(kv_cache, fmt, head_dim)
    key_dim_chunk = check_key_dim_chunk(key_dim_chunk, fmt, head_dim)
    _, block_size, num_kv_heads, _ = kv_cache.shape
    num_heads = q.shape[1]
    if q.shape[-1] != head_dim or num_heads % num_kv_heads != 0 or q.stride(-1) != 1:
        raise ValueError(f"q {tuple(q.shape)} (unit last stride) does not fit kv_cache {tuple(kv_cache.shape)}")
    if q.dtype == torch.float64 and q.is_cuda:
        raise ValueError("packed attention in fp64 does not compile on CUDA (Triton 3.6 has no fp64 MMA on "
                         "register-decoded operands): fp64 models read packed caches through the torch reference")
    acc_dtype = compute_dtype(q.dtype)
    if fmt.is_rotated:
        assert fmt.key_bits is not None
        q_in = rotate_rows(q)  # q @ H in the accumulator dtype, once per step, each row alone (invariant 4)
        centroids = _centroid_table(head_dim, fmt.key_bits, acc_dtype, q.device)
        key_bits, key_code_bytes = fmt.key_bits, packed_size(head_dim, fmt.key_bits)
    else:
        q_in, centroids, key_bits, key_code_bytes = q, _dummy_table(acc_dtype, q.device), 8, head_dim
    value_bits = fmt.value_bits if fmt.value_encoding == UNIFORM else 8
    assert value_bits is not None
    value_code_bytes = packed_size(head_dim, value_bits)
    fp16_fields = ([key_code_bytes] if fmt.is_rotated else []) + (
        [fmt.key_bytes(head_dim) + value_code_bytes] if fmt.value_encoding == UNIFORM else [])  # fmt: skip
    encoding = dict(KEY_ENC=KEY_ENCODINGS[fmt.key_encoding], KEY_BITS=key_bits, KEY_CODE_BYTES=key_code_bytes,
                    KEY_DIM_CHUNK=key_dim_chunk, KEY_DIM_UNROLL=key_dim_unroll or key_dim_chunk == pad_pow2(head_dim),
                    VALUE_ENC=VALUE_ENCODINGS[fmt.value_encoding], VALUE_BITS=value_bits,
                    VALUE_CODE_BYTES=value_code_bytes, FP16_ALIGNED=is_fp16_aligned(kv_cache, fp16_fields))  # fmt: skip
    tiles = CacheTiles(kv_cache, block_size, num_kv_heads, (kv_cache.stride(0), kv_cache.stride(1),
                       kv_cache.stride(2)), fmt.key_bytes(head_dim), centroids, encoding,
                       format_num_warps(fmt))  # fmt: skip
    return q_in, tiles
