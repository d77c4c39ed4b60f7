"""The KV cache formats a user picks with ``kv_cache_dtype``: what each stores per token and KV head, and its bytes.

Names and contents follow vLLM. The math of each encoding lives in ops/kv_quant.py (the reference of the kernels).
One token's slot for one KV head is its key part followed by its value part; multi-byte fields are little-endian:

- ``auto``: K then V, D elements each in the model dtype.
- ``fp8``: K then V, D float8_e4m3fn bytes each (k_scale / v_scale are per layer, 1.0 unless calibrated).
- ``turboquant_k8v4``: K = D fp8 bytes (per-tensor scale); V = ceil(4D / 8) code bytes, fp16 scale, fp16 zero.
- ``turboquant_4bit_nc`` / ``turboquant_k3v4_nc`` / ``turboquant_3bit_nc``: K = ceil(bD / 8) Lloyd-Max code bytes
  (Hadamard-rotated basis) then the key's fp16 scale (||k|| / ||c||: the norm correction applied when the key is
  stored, ops/kv_quant.py); V = ceil(bD / 8) uniform code bytes, fp16 scale, fp16 zero.

At head_dim 128 that is 196 / 134 / 118 / 102 bytes for the four TurboQuant presets (bf16: 512), at 256 it is
388 / 262 / 230 / 198 (bf16: 1024). The TurboQuant presets keep the first and last two attention layers of a
dense model in the model dtype (``compressed_layers``); ``fp8`` compresses every attention layer, as in vLLM.
``KVFormat.encode`` / ``decode`` turn K/V into a slot's bytes and back: the store and read of the torch reference
attention (layers/attention.py: CPU and float64 models), which the Triton kernels (kernels/kv_store_packed.py,
kernels/paged_attention_packed.py) must match.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from truespec.kv_cache.config import KV_CACHE_DTYPES
from truespec.ops.kv_quant import (
    QuantizedKeys,
    QuantizedValues,
    dequantize_keys,
    dequantize_values,
    fp8_load,
    fp8_store,
    packed_size,
    quantize_keys,
    quantize_values,
)
from truespec.ops.precision import compute_dtype

# what a key or value vector is stored as
MODEL = "model"  # the model's dtype, unchanged
FP8 = "fp8"  # float8_e4m3fn with a per-tensor scale
LLOYD_MAX = "lloyd_max"  # TurboQuant MSE codes of the rotated unit key + fp16 scale
UNIFORM = "uniform"  # asymmetric min/max codes + fp16 scale and zero

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "attention")
_NORM_BYTES = 2  # fp16 ||k||
_SCALE_ZERO_BYTES = 4  # fp16 scale + fp16 zero


@dataclass(frozen=True)
class KVFormat:
    """One ``kv_cache_dtype``: how keys and values are stored, and what that costs per token per KV head."""

    name: str
    key_encoding: str  # MODEL | FP8 | LLOYD_MAX
    value_encoding: str  # MODEL | FP8 | UNIFORM
    key_bits: int | None = None  # code bits of LLOYD_MAX keys
    value_bits: int | None = None  # code bits of UNIFORM values
    norm_correction: bool = False  # LLOYD_MAX keys: centroid vector rescaled to unit length ("nc"), in the stored scale
    is_lossy: bool = True
    keeps_boundary_layers: bool = False  # dense models keep their first / last attention layers unquantised

    @property
    def is_rotated(self) -> bool:
        """Keys live in the Hadamard-rotated basis: the query must be rotated before scoring."""
        return self.key_encoding == LLOYD_MAX

    def key_bytes(self, head_dim: int, model_dtype_bytes: int = 2) -> int:
        """Bytes of one token's key for one KV head (``model_dtype_bytes`` matters only for ``auto``)."""
        return _vector_bytes(self.key_encoding, self.key_bits, head_dim, model_dtype_bytes)

    def value_bytes(self, head_dim: int, model_dtype_bytes: int = 2) -> int:
        """Bytes of one token's value for one KV head."""
        return _vector_bytes(self.value_encoding, self.value_bits, head_dim, model_dtype_bytes)

    def bytes_per_token(self, head_dim: int, model_dtype_bytes: int = 2) -> int:
        """Bytes one token takes per KV head in a layer of this format: key + value (per-layer scales excluded)."""
        return self.key_bytes(head_dim, model_dtype_bytes) + self.value_bytes(head_dim, model_dtype_bytes)

    # ---- one slot's bytes (the torch reference of the store and the read; formats other than auto) ------------
    def encode(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """k, v [T, H, D] -> uint8 [T, H, bytes_per_token]: each (token, head)'s key part, then its value part."""
        return torch.cat([_encode(self.key_encoding, self.key_bits, k, norm_correction=self.norm_correction),
                          _encode(self.value_encoding, self.value_bits, v)], dim=-1)

    def decode(self, slots: torch.Tensor, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 [S, H, bytes_per_token] -> k, v [S, H, D] in ``dtype`` (keys back in the original basis)."""
        key_bytes = self.key_bytes(head_dim)
        keys = _decode(self.key_encoding, self.key_bits, slots[..., :key_bytes], head_dim, dtype)
        return keys, _decode(self.value_encoding, self.value_bits, slots[..., key_bytes:], head_dim, dtype)

    def check_head_dim(self, head_dim: int) -> None:
        """Raise a ValueError naming ``kv_cache_dtype`` if this format cannot store heads of ``head_dim``."""
        if self.is_rotated and (head_dim < 4 or head_dim & (head_dim - 1)):
            raise ValueError(f"kv_cache_dtype {self.name!r} needs a power-of-two head_dim >= 4 (Hadamard rotation), "
                             f"got {head_dim}")


FORMATS: dict[str, KVFormat] = {
    "auto": KVFormat("auto", MODEL, MODEL, is_lossy=False),
    "fp8": KVFormat("fp8", FP8, FP8),
    "turboquant_k8v4": KVFormat("turboquant_k8v4", FP8, UNIFORM, value_bits=4, keeps_boundary_layers=True),
    "turboquant_4bit_nc": KVFormat("turboquant_4bit_nc", LLOYD_MAX, UNIFORM, key_bits=4, value_bits=4,
                                   norm_correction=True, keeps_boundary_layers=True),
    "turboquant_k3v4_nc": KVFormat("turboquant_k3v4_nc", LLOYD_MAX, UNIFORM, key_bits=3, value_bits=4,
                                   norm_correction=True, keeps_boundary_layers=True),
    "turboquant_3bit_nc": KVFormat("turboquant_3bit_nc", LLOYD_MAX, UNIFORM, key_bits=3, value_bits=3,
                                   norm_correction=True, keeps_boundary_layers=True),
}


def kv_format(name: str) -> KVFormat:
    """The format a ``kv_cache_dtype`` names; a ValueError naming the field for anything else."""
    if name not in FORMATS:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {name!r}")
    return FORMATS[name]


def bytes_per_token(kv_cache_dtype: str, head_dim: int, model_dtype_bytes: int = 2) -> int:
    """K + V bytes per token per KV head of a layer stored as ``kv_cache_dtype`` (for sizing the pool)."""
    return kv_format(kv_cache_dtype).bytes_per_token(head_dim, model_dtype_bytes)


def compressed_layers(layer_types_or_count: Sequence[str] | int, is_hybrid: bool, skip_first: int = 2,
                      skip_last: int = 2) -> tuple[int, ...]:
    """Indices of the layers whose KV a TurboQuant preset compresses (the rest stay in the model dtype).

    ``layer_types_or_count``: the config's ``layer_types`` (indices are positions in it; only attention layers
    count) or the number of attention layers (indices 0..n-1). Hybrid models compress every attention layer:
    they have few, and the boundary rule would leave a large share of them uncompressed. Dense models keep their
    first ``skip_first`` and last ``skip_last`` attention layers unquantised, as vLLM does.
    """
    for field, value in (("skip_first", skip_first), ("skip_last", skip_last)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{field} must be an int >= 0, got {value!r}")
    if isinstance(layer_types_or_count, int) and not isinstance(layer_types_or_count, bool):
        if layer_types_or_count < 0:
            raise ValueError(f"the number of attention layers must be >= 0, got {layer_types_or_count}")
        attention = list(range(layer_types_or_count))
    else:
        attention = [i for i, kind in enumerate(layer_types_or_count) if kind in ATTENTION_LAYER_TYPES]
    if is_hybrid:
        return tuple(attention)
    return tuple(attention[skip_first:max(0, len(attention) - skip_last)])


def _encode(encoding: str, bits: int | None, x: torch.Tensor, *, norm_correction: bool = False) -> torch.Tensor:
    """x [T, H, D] -> uint8 [T, H, vector bytes] (fp16 fields little-endian, as the device stores them);
    ``norm_correction``: Lloyd-Max keys' (their scale is ||k|| / ||c||)."""
    if encoding == FP8:
        return fp8_store(x).view(torch.uint8)
    if encoding == LLOYD_MAX:
        keys = quantize_keys(x, bits, norm_correction=norm_correction)
        return torch.cat([keys.codes, _fp16_bytes(keys.scales)], dim=-1)
    values = quantize_values(x, bits)
    return torch.cat([values.codes, _fp16_bytes(values.scales), _fp16_bytes(values.zeros)], dim=-1)


def _decode(encoding: str, bits: int | None, raw: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Computed in ``dtype``'s compute dtype (fp32 for 16-bit models: the rotation back is not rounded to 16 bits
    midway), then rounded to ``dtype`` once."""
    wide = compute_dtype(dtype)
    if encoding == FP8:
        return fp8_load(raw.contiguous().view(torch.float8_e4m3fn), dtype=wide).to(dtype)
    num_code_bytes = packed_size(head_dim, bits)
    codes, fields = raw[..., :num_code_bytes], raw[..., num_code_bytes:].contiguous().view(torch.float16)
    if encoding == LLOYD_MAX:
        return dequantize_keys(QuantizedKeys(codes, fields[..., 0], bits, head_dim), wide).to(dtype)
    return dequantize_values(QuantizedValues(codes, fields[..., 0], fields[..., 1], bits, head_dim), wide).to(dtype)


def _fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """float16 [T, H] -> uint8 [T, H, 2]."""
    return x.contiguous().view(torch.uint8).view(*x.shape, 2)


def _vector_bytes(encoding: str, bits: int | None, head_dim: int, model_dtype_bytes: int) -> int:
    if encoding == MODEL:
        return head_dim * model_dtype_bytes
    if encoding == FP8:
        return head_dim
    assert bits is not None
    extra = _NORM_BYTES if encoding == LLOYD_MAX else _SCALE_ZERO_BYTES
    return packed_size(head_dim, bits) + extra
