"""Paged causal attention read straight from a packed (compressed) KV cache: ``fp8`` and the TurboQuant presets.

The cache is uint8 [num_blocks, block_size, num_kv_heads, bytes_per_token]; one slot (token, KV head) holds its
key part then its value part, laid out as kv_cache/formats.py describes. The kernel decodes each K / V tile in
registers where the model-dtype kernel (kernels/paged_attention.py) loads it, and never writes decoded K/V back:

- ``fp8`` keys / values: D bytes, bitcast to ``tl.float8e4nv`` and widened (scale 1.0, as the reference).
- Lloyd-Max keys (``turboquant_*_nc``): the wrapper rotates q once (q @ H in fp32, fp64 for fp64 q); the kernel
  unpacks each coordinate's code from the little-endian bit stream (two byte loads and a shift, so 3-bit codes
  straddling a byte boundary come out right), looks its centroid up in a small table tensor, and scores
  ``<q_rot, c> * norm / ||c||`` (norm correction). Keys are never rotated back.
- Uniform values: codes unpacked the same way, ``v = code * scale + zero`` (fp16 scale / zero, little-endian).

Layout: one program per (query row, kv head), serving the kv head's GQA group of query heads (padded to 16 rows
for ``tl.dot``), looping over the row's keys in BLOCK_N tiles from key 0 with online softmax in fp32 (fp64 for
fp64 q), output cast to q's dtype. The tiles a row walks are a function of its number of keys (position + 1) and
the compile-time constants only, so a row gives bitwise the same output as a decode, inside a 1+k verify, a
prefill chunk or any mixed batch (docs/ARCHITECTURE.md invariant 4). Padding rows (token >=
query_start_loc[num_reqs]) have 0 keys and write zeros. No host reads; the grid comes from tensor shapes only;
the rotation matrix and centroid table are cached per (head_dim, bits, dtype, device), so a first eager call
before capture makes the wrapper CUDA-graph capturable.

Not done yet (speed only; correctness does not need them):
- split-KV (flash-decoding) as in kernels/paged_attention.py: long decodes run one chain of tiles per program.
- a fused store kernel (the cache is written by ``KVFormat.encode`` + ``store_packed_ref`` today).
- per-layer calibrated fp8 k_scale / v_scale (the formats use 1.0, as the reference).
- no GPU timing or tuning yet (BLOCK_N / num_warps defaults are untuned guesses).
"""

from functools import cache
from typing import Protocol

import torch
import triton
import triton.language as tl

from truespec.kernels.paged_attention import MAX_SPLITS, MIN_SPLIT_KEYS, _row_layout
from truespec.kernels.triton_utils import mma, pad_pow2, reduce_max, reduce_sum, tl_compute_dtype
from truespec.ops.kv_quant import hadamard, packed_size
from truespec.ops.lloyd_max import lloyd_max_codebook
from truespec.ops.precision import compute_dtype

BLOCK_N, NUM_WARPS = 32, 4  # untuned defaults
# kv_cache/formats.py's encoding names (kernels sit below kv_cache in the import order: tests/test_import_graph.py)
FP8, LLOYD_MAX, UNIFORM = "fp8", "lloyd_max", "uniform"
_KEY_ENCODINGS = {FP8: 0, LLOYD_MAX: 1}
_VALUE_ENCODINGS = {FP8: 0, UNIFORM: 1}


class KVFormat(Protocol):
    """What the kernel reads of a ``kv_cache.formats.KVFormat`` (structural: kernels may not import kv_cache)."""

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


@triton.jit
def _unpack_codes(base_ptr, idx, mask, BITS: tl.constexpr, NUM_BYTES: tl.constexpr):
    """Codes ``idx`` (any int tensor) of a packed little-endian bit stream at ``base_ptr`` (NUM_BYTES bytes),
    as int32: code j is bits [j * BITS, (j + 1) * BITS); it may straddle two bytes."""
    bit = idx * BITS
    byte = bit // 8
    lo = tl.load(base_ptr + byte, mask=mask, other=0).to(tl.int32)
    hi = tl.load(base_ptr + byte + 1, mask=mask & (byte + 1 < NUM_BYTES), other=0).to(tl.int32)
    return ((lo | (hi << 8)) >> (bit % 8)) & ((1 << BITS) - 1)


@triton.jit
def _load_fp16(ptr, mask):
    """A little-endian fp16 at byte address ``ptr`` (any alignment), widened to fp32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _load_fp8(ptr, mask):
    """float8_e4m3fn bytes at ``ptr``, widened exactly to fp32 (masked lanes read 0)."""
    return tl.load(ptr, mask=mask, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)


# One binary for every batch and (eager) block-table width: integer arguments that vary are not specialised.
@triton.jit(do_not_specialize=["num_reqs", "stride_bt_req"])
def _paged_attention_packed_kernel(
    out_ptr,  # [T, num_heads, head_dim], q's dtype
    q_ptr,  # [T, num_heads, head_dim]: q (rotated, in the accumulator dtype, for Lloyd-Max keys)
    kv_cache_ptr,  # uint8 [num_blocks, block_size, num_kv_heads, bytes_per_token]
    centroids_ptr,  # [2^KEY_BITS] Lloyd-Max centroids in the accumulator dtype (unused for fp8 keys)
    query_start_loc_ptr,  # [R + 1]
    seq_lens_ptr,  # [R]
    block_tables_ptr,  # [R, max_blocks]
    num_reqs,
    scale: tl.float64,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_bt_req,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # KV cache block size (tokens per block)
    BLOCK_N: tl.constexpr,  # keys per tile
    KEY_ENC: tl.constexpr,  # 0: fp8, 1: Lloyd-Max codes + fp16 norm (norm corrected)
    KEY_BITS: tl.constexpr,
    KEY_BYTES: tl.constexpr,  # bytes of the key part (codes + norm for Lloyd-Max)
    KEY_CODE_BYTES: tl.constexpr,
    VALUE_ENC: tl.constexpr,  # 0: fp8, 1: uniform codes + fp16 scale + fp16 zero
    VALUE_BITS: tl.constexpr,
    VALUE_CODE_BYTES: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
):
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    # the row's request and its keys 0..position (0 for padding rows), as the model-dtype kernel reads them
    r, num_keys, _, _ = _row_layout(query_start_loc_ptr, seq_lens_ptr, num_reqs, token, BLOCK_N, MAX_SPLITS,
                                    MIN_SPLIT_KEYS)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q_mask = (g[:, None] < GROUP) & d_mask[None, :]
    q = tl.load(q_ptr + token * stride_q_tok + heads[:, None] * stride_q_head + d[None, :], mask=q_mask, other=0.0)
    q = q.to(ACC_DTYPE)
    scale_acc = tl.full([], scale, ACC_DTYPE)

    m = tl.full([GROUP_PAD], float("-inf"), ACC_DTYPE)  # running max of the scaled scores
    l = tl.full([GROUP_PAD], 0, ACC_DTYPE)  # running sum of exp(score - m)
    acc = tl.full([GROUP_PAD, HEAD_DIM_PAD], 0, ACC_DTYPE)
    cache_head_ptr = kv_cache_ptr + kv_head * stride_cache_head
    for tile_start in range(0, num_keys, BLOCK_N):
        n = tile_start + tl.arange(0, BLOCK_N)
        n_mask = n < num_keys
        blocks = tl.load(block_tables_ptr + r * stride_bt_req + n // BLOCK_SIZE, mask=n_mask, other=0)
        slot_ptr = cache_head_ptr + blocks * stride_cache_block + (n % BLOCK_SIZE) * stride_cache_slot  # [BLOCK_N]
        kv_mask = n_mask[:, None] & d_mask[None, :]

        # ---- keys -> scores [GROUP_PAD, BLOCK_N]
        if KEY_ENC == 0:
            k = _load_fp8(slot_ptr[:, None] + d[None, :], kv_mask).to(ACC_DTYPE)
            s = mma(q, tl.trans(k), False)
        else:
            codes = _unpack_codes(slot_ptr[:, None], d[None, :], kv_mask, KEY_BITS, KEY_CODE_BYTES)
            c = tl.load(centroids_ptr + codes, mask=kv_mask, other=0.0)  # [BLOCK_N, HEAD_DIM_PAD]
            c_norm = tl.sqrt(reduce_sum(c * c, 1))
            norm = _load_fp16(slot_ptr + KEY_CODE_BYTES, n_mask).to(ACC_DTYPE)
            weight = norm / tl.where(c_norm > 0, c_norm, 1.0)  # ||k|| / ||c||; masked keys: 0
            s = mma(q, tl.trans(c), False) * weight[None, :]
        s = s * scale_acc
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, reduce_max(s, 1))  # finite: every tile holds a key
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + reduce_sum(p, 1)

        # ---- values [BLOCK_N, HEAD_DIM_PAD]
        value_ptr = slot_ptr + KEY_BYTES
        if VALUE_ENC == 0:
            v = _load_fp8(value_ptr[:, None] + d[None, :], kv_mask).to(ACC_DTYPE)
        else:
            vcodes = _unpack_codes(value_ptr[:, None], d[None, :], kv_mask, VALUE_BITS, VALUE_CODE_BYTES)
            v_scale = _load_fp16(value_ptr + VALUE_CODE_BYTES, n_mask).to(ACC_DTYPE)
            v_zero = _load_fp16(value_ptr + VALUE_CODE_BYTES + 2, n_mask).to(ACC_DTYPE)
            v = vcodes.to(ACC_DTYPE) * v_scale[:, None] + v_zero[:, None]
            v = tl.where(kv_mask, v, 0.0)
        acc = acc * alpha[:, None] + mma(p, v, False)
        m = m_new

    out = acc / tl.where(l > 0, l, 1.0)[:, None]  # padding rows: acc = 0, l = 0 -> 0
    o_ptrs = out_ptr + token * stride_o_tok + heads[:, None] * stride_o_head + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@cache
def _centroid_table(head_dim: int, bits: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Lloyd-Max centroids [2^bits] on ``device`` (cached: no host-to-device copy once warmed up)."""
    return lloyd_max_codebook(head_dim, bits)[0].to(device=device, dtype=dtype)


@cache
def _dummy_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(1, dtype=dtype, device=device)


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
    num_warps: int = NUM_WARPS,
) -> torch.Tensor:
    """Causal attention of q [T, num_heads, head_dim] over the packed paged ``kv_cache`` uint8
    [num_blocks, block_size, num_kv_heads, fmt.bytes_per_token(head_dim)]; query token i of request r sits at
    position ``seq_lens[r] - query_len + i``. Rows past ``query_start_loc[-1]`` (padding) come back as zeros.
    No host sync and no shape derived from the batch content. ``block_n`` and ``num_warps`` fix each row's
    arithmetic: keep them the same for every call of a model (invariant 4). Returns ``out`` (allocated if None)."""
    num_tokens, num_heads, q_head_dim = q.shape
    if fmt.key_encoding not in _KEY_ENCODINGS or fmt.value_encoding not in _VALUE_ENCODINGS:
        raise ValueError(f"kv_cache_dtype {fmt.name!r} is not a packed format (use paged_attention)")
    fmt.check_head_dim(head_dim)
    _, block_size, num_kv_heads, slot_bytes = kv_cache.shape
    if kv_cache.dtype != torch.uint8 or slot_bytes != fmt.bytes_per_token(head_dim) or kv_cache.stride(-1) != 1:
        raise ValueError(
            f"kv_cache {tuple(kv_cache.shape)} {kv_cache.dtype} is not a contiguous-slot uint8 cache "
            f"of {fmt.name!r} at head_dim {head_dim}"
        )
    if q_head_dim != head_dim or num_heads % num_kv_heads != 0 or q.stride(-1) != 1:
        raise ValueError(f"q {tuple(q.shape)} (unit last stride) does not fit kv_cache {tuple(kv_cache.shape)}")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n {block_n} must be a power of two >= 16")
    out = torch.empty_like(q) if out is None else out
    if seq_lens.shape[0] == 0:
        return out.zero_()
    if num_tokens == 0:
        return out
    acc_dtype = compute_dtype(q.dtype)
    if fmt.is_rotated:
        assert fmt.key_bits is not None and fmt.norm_correction, "Lloyd-Max keys are read with norm correction"
        q_in = torch.matmul(q.to(acc_dtype), hadamard(head_dim, acc_dtype, q.device))  # rotate once
        centroids = _centroid_table(head_dim, fmt.key_bits, acc_dtype, q.device)
        key_bits, key_code_bytes = fmt.key_bits, packed_size(head_dim, fmt.key_bits)
    else:
        q_in, centroids, key_bits, key_code_bytes = q, _dummy_table(acc_dtype, q.device), 8, head_dim
    value_bits = fmt.value_bits if fmt.value_encoding == UNIFORM else 8
    assert value_bits is not None
    group = num_heads // num_kv_heads
    _paged_attention_packed_kernel[(num_tokens, num_kv_heads)](
        out, q_in, kv_cache, centroids, query_start_loc, seq_lens, block_tables, seq_lens.shape[0], scale,
        q_in.stride(0), q_in.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), block_tables.stride(0),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=pad_pow2(head_dim), GROUP=group, GROUP_PAD=pad_pow2(group),
        BLOCK_SIZE=block_size, BLOCK_N=block_n,
        KEY_ENC=_KEY_ENCODINGS[fmt.key_encoding], KEY_BITS=key_bits, KEY_BYTES=fmt.key_bytes(head_dim),
        KEY_CODE_BYTES=key_code_bytes, VALUE_ENC=_VALUE_ENCODINGS[fmt.value_encoding], VALUE_BITS=value_bits,
        VALUE_CODE_BYTES=packed_size(head_dim, value_bits), ACC_DTYPE=tl_compute_dtype(q.dtype),
        num_warps=num_warps,
    )  # fmt: skip
    return out
