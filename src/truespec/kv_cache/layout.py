"""The cache tensors on the device: their shapes, their bytes, allocating them, and where a token's K/V goes.

- KV of one attention layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` in the model dtype
  (index 0 = K, 1 = V; the shape each ``PagedAttention`` declares in ``kv_cache_shape``), or, in a compressed
  ``kv_cache_dtype`` (``layer_formats``), uint8 ``[num_blocks, block_size, num_kv_heads, bytes per token]``.
  The K/V of position ``p`` of a request with block table ``bt`` sit at flat slot ``bt[p // block_size] *
  block_size + p % block_size`` (``kv_slots``); slot -1 is never written (padded rows, docs/ARCHITECTURE.md
  invariant 3).
- Recurrent state of one GDN layer: ``conv_state [num_state_slots, *conv_shape]`` and ``ssm_state
  [num_state_slots, *ssm_shape]``, in the dtypes the layer declares (``state_shapes`` / ``state_dtypes``).

A drafter with its own layers gets caches of the same block and slot counts: it reads the target's block
tables and state groups (``spec_decode/model_drafter.py``).
"""

import numpy as np
import torch

from truespec.kv_cache.config import CacheConfig
from truespec.kv_cache.formats import FORMATS, KVFormat, compressed_layers, kv_format
from truespec.ops.attention import SparseV


def kv_slots(block_ids: list[int], start: int, end: int, block_size: int) -> list[int]:
    """The flat KV slots of positions ``start .. end - 1`` of a request whose block table is ``block_ids``."""
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]


def layer_formats(model: torch.nn.Module, kv_cache_dtype: str = "auto") -> list[KVFormat]:
    """Per attention layer of ``model``, the format its KV is stored in: ``kv_cache_dtype``'s, except the boundary
    layers a TurboQuant preset keeps in the model dtype on a dense model (kv_cache/formats.py). Hybrid models and
    hidden-state draft heads compress every attention layer. A ValueError names ``kv_cache_dtype`` if a layer's
    head_dim cannot be stored in it."""
    layers, fmt = model.attention_layers(), kv_format(kv_cache_dtype)
    for layer in layers:
        fmt.check_head_dim(layer.head_dim)
    if not fmt.keeps_boundary_layers:
        return [fmt] * len(layers)
    is_hybrid = bool(model.gdn_layers()) or bool(getattr(model, "uses_target_hidden", False))
    kept = set(compressed_layers(len(layers), is_hybrid))
    return [fmt if i in kept else FORMATS["auto"] for i in range(len(layers))]


def kv_bytes_per_token(model: torch.nn.Module, kv_cache_dtype: str = "auto") -> int:
    """K and V bytes one token takes over all of the model's attention layers."""
    elem = _element_size(model.dtype)
    return sum(layer.num_kv_heads * fmt.bytes_per_token(layer.head_dim, elem)
               for layer, fmt in zip(model.attention_layers(), layer_formats(model, kv_cache_dtype), strict=True))


def state_bytes_per_slot(model: torch.nn.Module) -> int:
    """Conv and SSM state bytes of one state slot over all of the model's GDN layers."""
    total = 0
    for layer in model.gdn_layers():
        for shape, dtype in zip(layer.state_shapes(), layer.state_dtypes(), strict=True):
            total += _numel(shape) * _element_size(dtype)
    return total


def set_sparse_v(model: torch.nn.Module, cache: CacheConfig) -> None:
    """Bind the cache config's sparse-V tile skip to every attention layer of a model or drafter (before any graph
    is captured: the kernels' threshold is a launch argument)."""
    min_keys = cache.sparse_v_min_keys
    sparse_v = None if min_keys is None else SparseV.of(cache.sparse_v_threshold, min_keys)
    for layer in model.attention_layers():
        layer.sparse_v = sparse_v


def allocate_caches(model: torch.nn.Module, num_blocks: int, block_size: int, num_state_slots: int,
                    device: torch.device, kv_cache_dtype: str = "auto") -> None:
    """Bind zeroed caches to a model's (or drafter's) layers: paged KV for its attention layers (with their
    ``layer_formats``), state slots for its GDN layers."""
    for layer, fmt in zip(model.attention_layers(), layer_formats(model, kv_cache_dtype), strict=True):
        if fmt.name == "auto":
            layer.kv_format = None
            layer.kv_cache = zeros(layer.kv_cache_shape(num_blocks, block_size), model.dtype, device)
        else:  # one slot per token and KV head: its key part, then its value part
            layer.kv_format = fmt
            layer.kv_cache = zeros((num_blocks, block_size, layer.num_kv_heads, fmt.bytes_per_token(layer.head_dim)),
                                   torch.uint8, device)
    for layer in model.gdn_layers():
        (conv_shape, ssm_shape), (conv_dtype, ssm_dtype) = layer.state_shapes(), layer.state_dtypes()
        layer.conv_state = zeros((num_state_slots, *conv_shape), conv_dtype, device)
        layer.ssm_state = zeros((num_state_slots, *ssm_shape), ssm_dtype, device)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed cache tensor. On the CPU its pages come zeroed from the OS on first touch (numpy's calloc of a
    large buffer maps fresh pages) instead of being written up front: the default 4 GiB CPU pool costs neither
    seconds of ``LLM()`` nor memory its requests never reach."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    num_bytes = _numel(shape) * _element_size(dtype)
    return torch.from_numpy(np.zeros(num_bytes, dtype=np.uint8)).view(dtype).view(shape)


def copy_state_slots(gdn_layers: list[torch.nn.Module], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy the conv and SSM state of the GDN layers from flat slots ``src`` to ``dst`` ([n] int64 on the device,
    ``dst`` without repeats): prefix caching's checkpoint saves and restores (core/prefix_planner.py). Queued in
    stream order, outside any captured graph (the tensors never move)."""
    for layer in gdn_layers:
        for state in (layer.conv_state, layer.ssm_state):
            state.index_copy_(0, dst, state.index_select(0, src))


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
