"""Compressed KV cache formats in torch: quantise on store, dequantise or score on read.

The reference the Triton store / attention kernels must match (kv_cache/formats.py names the presets and their
byte layouts). Shapes: keys and values are ``[T, H, D]`` (tokens, KV heads, head_dim); every per-vector quantity
is ``[T, H]``. Inputs in float16 / bfloat16 / float32 are computed in float32, float64 inputs in float64
(ops/precision.py); the stored bytes are the same types either way (uint8 codes, fp16 key scales, fp16 value
scales / zeros, fp8 e4m3), so only a coordinate within rounding of a decision boundary can code differently.

- FP8 (``fp8``, the keys of ``turboquant_k8v4``): ``x / scale`` saturated to +-448, cast round-to-nearest-even to
  float8_e4m3fn; read ``fp8 * scale``. The scale is per tensor (one k_scale, one v_scale per layer) and, as in
  vLLM, 1.0 unless calibrated scales are supplied (``DEFAULT_KV_SCALE``).
- TurboQuant keys (3 or 4 bits): k / ||k|| rotated by the normalised Sylvester Hadamard matrix; each rotated
  coordinate coded by its Lloyd-Max codebook (ops/lloyd_max.py); codes bit-packed; then the key's fp16 scale. With
  norm correction ("nc") the centroid vector c stands for a unit vector, k^ = ||k|| H c / ||c||, and the scale is
  ||k|| / ||c||, computed when the key is stored (||c||^2 summed in float64, where every partial sum of the
  squares of the bf16-exact centroids is exact, so any summation order gives the same bits); without nc it is
  ||k||. A read is then k^ = scale * H c. H is symmetric and orthonormal (its own inverse), so a query is rotated
  once and scored against c directly.
- Values (never rotated): per token and head, asymmetric uniform codes over [min, max] with fp16 scale and zero.

Packing: code j of a vector occupies bits [j * bits, (j + 1) * bits) of a little-endian bit stream whose bit i is
bit i % 8 of byte i // 8. 4-bit: two codes per byte, the even one in the low nibble; 3-bit: 8 codes per 3 bytes,
codes 2 and 5 of each group straddle a byte boundary. A vector of n codes takes ceil(n * bits / 8) bytes.
"""

import math
from functools import cache
from typing import NamedTuple

import torch
import torch.nn.functional as F

from truespec.ops.linear import padded_rows
from truespec.ops.lloyd_max import codebook_codes, lloyd_max_codebook
from truespec.ops.precision import compute_dtype

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP16_MAX = 65504.0
DEFAULT_KV_SCALE = 1.0  # vLLM's k_scale / v_scale when no calibrated scales are loaded


class QuantizedKeys(NamedTuple):
    codes: torch.Tensor  # uint8 [T, H, ceil(D * bits / 8)]: packed Lloyd-Max codes of the rotated unit key
    scales: torch.Tensor  # float16 [T, H]: ||k|| / ||c|| with norm correction, else ||k||
    bits: int
    head_dim: int


class QuantizedValues(NamedTuple):
    codes: torch.Tensor  # uint8 [T, H, ceil(D * bits / 8)]: packed uniform codes
    scales: torch.Tensor  # float16 [T, H]: (max - min) / (2^bits - 1)
    zeros: torch.Tensor  # float16 [T, H]: min
    bits: int
    head_dim: int


def packed_size(num_codes: int, bits: int) -> int:
    """Bytes that ``num_codes`` codes of ``bits`` bits take, packed densely."""
    return (num_codes * bits + 7) // 8


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., n] (each < 2^bits) -> uint8 [..., ceil(n * bits / 8)], the little-endian bit stream."""
    n = codes.shape[-1]
    groups = F.pad(codes.long(), (0, -n % 8)).unflatten(-1, (-1, 8))  # [..., G, 8]
    shifts = torch.arange(8, device=codes.device) * bits
    words = (groups << shifts).sum(-1, keepdim=True)  # [..., G, 1]: 8 codes in `bits` bytes (disjoint bits)
    byte_shifts = torch.arange(bits, device=codes.device) * 8
    packed = ((words >> byte_shifts) & 0xFF).flatten(-2)  # [..., G * bits]
    return packed[..., : packed_size(n, bits)].to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, num_codes: int) -> torch.Tensor:
    """uint8 [..., ceil(n * bits / 8)] -> uint8 codes [..., n]: the inverse of ``pack_codes``."""
    if packed.shape[-1] != packed_size(num_codes, bits):
        raise ValueError(f"{packed.shape[-1]} packed bytes do not hold {num_codes} codes of {bits} bits")
    num_groups = -(-num_codes // 8)
    full = F.pad(packed.long(), (0, num_groups * bits - packed.shape[-1])).unflatten(-1, (-1, bits))  # [..., G, b]
    byte_shifts = torch.arange(bits, device=packed.device) * 8
    words = (full << byte_shifts).sum(-1, keepdim=True)  # [..., G, 1]
    shifts = torch.arange(8, device=packed.device) * bits
    codes = ((words >> shifts) & ((1 << bits) - 1)).flatten(-2)  # [..., G * 8]
    return codes[..., :num_codes].to(torch.uint8)


@cache
def hadamard(head_dim: int, dtype: torch.dtype = torch.float32, device: torch.device | None = None) -> torch.Tensor:
    """The normalised Sylvester Hadamard matrix H_D [D, D]: symmetric, orthonormal, entries +-1/sqrt(D).

    Built deterministically (H_1 = [1], H_2n = [[H, H], [H, -H]]) in float64, then cast; one matrix serves
    every layer. Cached per (D, dtype, device).
    """
    if head_dim < 1 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two for the Hadamard rotation, got {head_dim}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < head_dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h * (1.0 / math.sqrt(head_dim))).to(dtype=dtype, device=device)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] @ H_D in x's dtype. H is its own inverse, so the same call rotates back. On the CPU the rows run
    padded (``ops.linear.padded_rows``), so a key's bits do not depend on how many are stored or read with it."""
    h = hadamard(x.shape[-1], x.dtype, x.device)
    if x.device.type != "cpu":
        return torch.matmul(x, h)
    rows = x.reshape(-1, x.shape[-1])
    return torch.matmul(padded_rows(rows), h)[:rows.shape[0]].view(x.shape)


def fp8_store(x: torch.Tensor, scale: float = DEFAULT_KV_SCALE) -> torch.Tensor:
    """x [...] -> float8_e4m3fn: x / scale (true division in the compute dtype), saturated to +-448 (NaN stays)."""
    y = x.to(compute_dtype(x.dtype)) / scale
    return y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def fp8_load(x: torch.Tensor, scale: float = DEFAULT_KV_SCALE, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """float8_e4m3fn [...] -> dtype: exact widening, then times scale."""
    return x.to(dtype) * scale


def quantize_keys(k: torch.Tensor, bits: int, *, norm_correction: bool) -> QuantizedKeys:
    """Keys [T, H, D] -> TurboQuant MSE codes: Lloyd-Max codes of the Hadamard-rotated unit key and the fp16 scale.

    The norm is sqrt(sum k^2) in the compute dtype; a zero key stores scale 0 (and reads back as 0). With
    ``norm_correction`` the scale is ||k|| / ||c|| (``centroid_norms``), divided in float64, else ||k||.
    """
    head_dim = k.shape[-1]
    x = k.to(compute_dtype(k.dtype))
    norms = torch.sqrt((x * x).sum(-1))  # [T, H]
    unit = x / norms.clamp_min(torch.finfo(x.dtype).tiny).unsqueeze(-1)
    centroids, boundaries = lloyd_max_codebook(head_dim, bits)
    codes = codebook_codes(rotate(unit), boundaries)  # [T, H, D]
    scales = norms.double() / centroid_norms(centroids.to(x.device)[codes.long()]) if norm_correction else norms
    return QuantizedKeys(pack_codes(codes, bits), _to_fp16(scales), bits, head_dim)


def centroid_norms(c: torch.Tensor) -> torch.Tensor:
    """||c|| [...] of centroid vectors c [..., D] (bf16-exact values), in float64. Each square is exact (16 significant
    bits) and so is every partial sum: their bits span at most 16 + log2(D * c_max^2 / c_min^2) < 53 bits for the
    codebooks of up to 4 bits at head dims up to 4096 (tests/test_kv_quant.py checks it), so the sum has the same
    bits in any order and a kernel's reduction gives exactly this (kernels/kv_store_packed.py)."""
    c = c.double()
    return torch.sqrt((c * c).sum(-1))


def key_centroids(keys: QuantizedKeys, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The centroid vectors c [T, H, D] of stored keys, in the rotated basis (no scale applied)."""
    centroids, _ = lloyd_max_codebook(keys.head_dim, keys.bits)
    codes = unpack_codes(keys.codes, keys.bits, keys.head_dim).long()
    return centroids.to(device=keys.codes.device, dtype=dtype)[codes]


def dequantize_keys(keys: QuantizedKeys, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored keys -> [T, H, D] in the original basis (for tests: attention never un-rotates keys)."""
    c = key_centroids(keys, dtype)
    return rotate(c * keys.scales.to(dtype).unsqueeze(-1))


def key_scores(q_rot: torch.Tensor, keys: QuantizedKeys) -> torch.Tensor:
    """q_rot [L, Hq, D] (queries already rotated: ``rotate(q)``) against stored keys [S, Hkv] -> [Hq, L, S].

    score = <q_rot, c> * scale: equal to q . k^ with no inverse rotation, since <H q, c> = <q, H c>. Unscaled
    (the caller applies the softmax scale). Query head h reads KV head h // (Hq / Hkv) (GQA). Computed in q's
    compute dtype.
    """
    dtype = compute_dtype(q_rot.dtype)
    group = q_rot.shape[1] // keys.scales.shape[1]
    c = key_centroids(keys, dtype)  # [S, Hkv, D]
    scales = keys.scales.to(dtype).repeat_interleave(group, dim=1)  # [S, Hq]
    c = c.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, S, D]
    dots = torch.matmul(q_rot.to(dtype).transpose(0, 1), c.transpose(1, 2))  # [Hq, L, S]
    return dots * scales.t().unsqueeze(1)


def quantize_values(v: torch.Tensor, bits: int) -> QuantizedValues:
    """Values [T, H, D] -> asymmetric uniform codes round((v - zero) / scale), clamped to [0, 2^bits - 1].

    zero = min and scale = (max - min) / (2^bits - 1) are rounded to fp16 first and the codes computed from the
    rounded pair, so decoding with the stored pair is consistent. round() is round-half-to-even; the division is
    a true division. A constant vector gets scale 0 and codes 0.
    """
    head_dim = v.shape[-1]
    x = v.to(compute_dtype(v.dtype))
    max_code = (1 << bits) - 1
    lo, hi = x.amin(-1), x.amax(-1)  # [T, H]
    scales, zeros = _to_fp16((hi - lo) / max_code), _to_fp16(lo)
    s, z = scales.to(x.dtype).unsqueeze(-1), zeros.to(x.dtype).unsqueeze(-1)
    s = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.round((x - z) / s).clamp(0, max_code).to(torch.uint8)  # [T, H, D]
    return QuantizedValues(pack_codes(codes, bits), scales, zeros, bits, head_dim)


def dequantize_values(values: QuantizedValues, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored values -> [T, H, D]: code * scale + zero in ``dtype``."""
    codes = unpack_codes(values.codes, values.bits, values.head_dim).to(dtype)
    return codes * values.scales.to(dtype).unsqueeze(-1) + values.zeros.to(dtype).unsqueeze(-1)


def _to_fp16(x: torch.Tensor) -> torch.Tensor:
    """Round to float16 (nearest even), saturating at +-65504 instead of overflowing to inf."""
    return x.clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
