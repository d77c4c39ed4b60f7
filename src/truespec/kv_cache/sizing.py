"""How many KV blocks the pool gets, the prefix cache's state checkpoints, and the longest sequence the engine
accepts; ``make_kv_cache`` puts them together into the engine's cache manager."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from truespec.kv_cache.config import CacheConfig
from truespec.kv_cache.manager import KVCacheManager, PrefixSettings

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


def make_kv_cache(cache: CacheConfig, kv_bytes_per_token: int, state_bytes_per_slot: int, max_model_len: int,
                  max_num_seqs: int, num_speculative_tokens: int, device: torch.device, extra_tokens: int | None,
                  has_drafter_cache: bool = False) -> KVCacheManager:
    """The engine's cache manager: a state group of ``1 + num_speculative_tokens`` slots per request, the KV pool
    what memory allows after them and the state checkpoints (``num_kv_blocks``), the prefix cache's settings
    (``prefix_settings``: ``extra_tokens`` None when the drafter cannot share a cache)."""
    n, k = max_num_seqs, num_speculative_tokens
    state_bytes = state_bytes_per_slot * n * (1 + k)
    share = checkpoint_share(cache, state_bytes_per_slot, extra_tokens is not None)
    num_blocks = num_kv_blocks(cache, kv_bytes_per_token, state_bytes, max_model_len, n, device, share)
    prefix = prefix_settings(cache, num_blocks, kv_bytes_per_token, state_bytes_per_slot, state_bytes, device,
                             extra_tokens, has_drafter_cache)
    return KVCacheManager(num_blocks, cache.block_size, num_state_groups=n, slots_per_group=1 + k, prefix=prefix)


def num_kv_blocks(cache: CacheConfig, kv_bytes_per_token: int, state_bytes: int, max_model_len: int,
                  max_num_seqs: int, device: torch.device, checkpoint_share: float = 0.0) -> int:
    """The override, else what memory allows after ``state_bytes`` of recurrent state and ``checkpoint_share`` of
    the rest for state checkpoints (never more blocks than ``max_num_seqs`` requests of ``max_model_len`` tokens
    can use)."""
    bs = cache.block_size
    useful = max_num_seqs * -(-max_model_len // bs)
    bytes_per_block = kv_bytes_per_token * bs
    if cache.num_gpu_blocks_override is not None:
        num_blocks = cache.num_gpu_blocks_override
    elif bytes_per_block == 0:
        num_blocks = useful
    else:
        room = int(max(0, _budget_bytes(cache, device) - state_bytes) * (1 - checkpoint_share))
        num_blocks = min(useful, room // bytes_per_block)
    if num_blocks * bs < max_model_len:
        raise ValueError(f"the KV cache holds {num_blocks} blocks x {bs} tokens = {num_blocks * bs} tokens, "
                         f"fewer than max_model_len={max_model_len}: lower max_model_len or give the cache "
                         "more room (num_gpu_blocks_override / gpu_memory_utilization)")
    return num_blocks


def checkpoint_share(cache: CacheConfig, state_bytes_per_slot: int, can_cache: bool = True) -> float:
    """The share of the cache memory state checkpoints take: ``prefix_state_budget`` on a model with recurrent state
    and prefix caching on (and possible: ``can_cache``), else 0."""
    is_on = cache.enable_prefix_caching and can_cache and state_bytes_per_slot
    return cache.prefix_state_budget if is_on else 0.0


def prefix_settings(cache: CacheConfig, num_blocks: int, kv_bytes_per_token: int, state_bytes_per_slot: int,
                    state_bytes: int, device: torch.device, extra_tokens: int | None,
                    has_drafter_cache: bool = False) -> PrefixSettings | None:
    """The prefix cache's settings, None when it is off (``extra_tokens`` None: the drafter cannot share a cache;
    ``has_drafter_cache``: a model drafter keeps KV of its own in the same blocks).

    State checkpoints (models with recurrent state) take ``prefix_state_budget`` of the cache memory left after the
    running requests' ``state_bytes`` (``num_kv_blocks`` leaves it out of the KV pool), and never more than one per
    KV block (a checkpoint is useless without a cached block of its own). The default interval is the fewest blocks
    whose KV costs at least one checkpoint, rounded up to a power of two: interval checkpoints then at most double
    the memory of the prefix they cover (Qwen3.5-0.8B: 19.5 MB per checkpoint, 192 KiB per block -> 2048 tokens)."""
    if not cache.enable_prefix_caching or extra_tokens is None:
        return None
    if not state_bytes_per_slot:
        return PrefixSettings(extra_tokens, has_drafter_cache=has_drafter_cache)
    bs, share = cache.block_size, cache.prefix_state_budget
    checkpoint_bytes = share * max(0, _budget_bytes(cache, device) - state_bytes)
    num_checkpoints = min(num_blocks, int(checkpoint_bytes // state_bytes_per_slot))
    interval = cache.prefix_state_interval
    if interval is None:
        blocks = max(1, -(-state_bytes_per_slot // max(1, bs * kv_bytes_per_token)))
        interval = bs * (1 << (blocks - 1).bit_length())
    return PrefixSettings(extra_tokens, num_checkpoints, True, interval, has_drafter_cache)


def _budget_bytes(cache: CacheConfig, device: torch.device) -> int:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(total * cache.gpu_memory_utilization) - (total - free)
    return int(cache.cpu_kv_cache_space_gib * 2**30)
