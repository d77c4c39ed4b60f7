"""How many KV blocks the pool gets, and the longest sequence the engine accepts."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from truespec.kv_cache.config import CacheConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def resolve_max_model_len(max_model_len: int | None, hf_config: PretrainedConfig) -> int:
    model_max = getattr(hf_config, "max_position_embeddings", None)
    if max_model_len is None:
        return model_max or 2048
    if model_max is not None and max_model_len > model_max:
        raise ValueError(f"max_model_len={max_model_len} is larger than the model's "
                         f"max_position_embeddings={model_max}")
    return max_model_len


def num_kv_blocks(cache: CacheConfig, kv_bytes_per_token: int, state_bytes: int, max_model_len: int,
                  max_num_seqs: int, device: torch.device) -> int:
    """The override, else what memory allows after ``state_bytes`` of recurrent state (never more blocks
    than ``max_num_seqs`` requests of ``max_model_len`` tokens can use)."""
    bs = cache.block_size
    useful = max_num_seqs * -(-max_model_len // bs)
    bytes_per_block = kv_bytes_per_token * bs
    if cache.num_gpu_blocks_override is not None:
        num_blocks = cache.num_gpu_blocks_override
    elif bytes_per_block == 0:
        num_blocks = useful
    else:
        num_blocks = min(useful, max(0, _budget_bytes(cache, device) - state_bytes) // bytes_per_block)
    if num_blocks * bs < max_model_len:
        raise ValueError(f"the KV cache holds {num_blocks} blocks x {bs} tokens = {num_blocks * bs} tokens, "
                         f"fewer than max_model_len={max_model_len}: lower max_model_len or give the cache "
                         "more room (num_gpu_blocks_override / gpu_memory_utilization)")
    return num_blocks


def _budget_bytes(cache: CacheConfig, device: torch.device) -> int:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(total * cache.gpu_memory_utilization) - (total - free)
    return int(cache.cpu_kv_cache_space_gib * 2**30)
