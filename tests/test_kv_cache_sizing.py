"""The engine's KV cache manager as kv_cache/sizing.py builds it: the recurrent state of every request first, the
state checkpoints' share of what is left, the KV pool after them, never more blocks than the requests can use."""

import pytest
import torch

from truespec.kv_cache.config import CacheConfig
from truespec.kv_cache.sizing import make_kv_cache

CPU = torch.device("cpu")
GIB = 2**30


def test_state_groups_then_checkpoints_then_the_kv_pool() -> None:
    """1 GiB on CPU, 4 requests with 3 drafts (4 state slots each) of 2 MiB: 32 MiB of state; the checkpoints take
    10% of the remaining 992 MiB (~49 checkpoints of 2 MiB), the pool the rest at 16 KiB a block (1 KiB a token)."""
    cache = CacheConfig(cpu_kv_cache_space_gib=1.0, prefix_state_budget=0.1)
    kv = make_kv_cache(cache, kv_bytes_per_token=1024, state_bytes_per_slot=2 * 2**20, max_model_len=500_000,
                       max_num_seqs=4, num_speculative_tokens=3, device=CPU, extra_tokens=0)
    info = kv.cache_info()
    room = GIB - 4 * 4 * 2 * 2**20
    assert info["num_state_slots"] == 4 and kv.slots_per_group == 4
    assert info["num_blocks"] == int(room * 0.9) // (16 * 1024)
    assert kv.checkpoints.num_slots == int(room * 0.1 // (2 * 2**20))
    assert kv.prefix.checkpoint_interval == 2048  # the fewest blocks whose KV costs one checkpoint, a power of two


def test_no_state_no_checkpoints_and_no_more_blocks_than_requests_use() -> None:
    """A model without recurrent state: no checkpoints; 2 requests of 100 tokens use 2 x 7 blocks of 16, however much
    memory there is. A drafter that cannot share a cache (``extra_tokens`` None) turns prefix caching off."""
    cache = CacheConfig(cpu_kv_cache_space_gib=1.0)
    kv = make_kv_cache(cache, 1024, 0, 100, 2, 0, CPU, extra_tokens=0)
    assert kv.cache_info()["num_blocks"] == 14 and not kv.prefix.needs_checkpoints and kv.checkpoints.num_slots == 0
    off = make_kv_cache(cache, 1024, 2 * 2**20, 100, 2, 0, CPU, extra_tokens=None)
    assert off.prefix is None and off.checkpoints is None
    assert off.cache_info()["num_blocks"] == 14  # no checkpoint share taken from a pool that has room anyway


def test_a_pool_that_cannot_hold_one_request_is_refused() -> None:
    cache = CacheConfig(num_gpu_blocks_override=4)
    with pytest.raises(ValueError, match="fewer than max_model_len=100"):
        make_kv_cache(cache, 1024, 0, 100, 1, 0, CPU, extra_tokens=0)
