"""The kv_cache package: reference-counted ids, per-request tables, the KV layout (invariant 6)."""

import pytest
import torch

from truespec.kv_cache.block_pool import BlockPool
from truespec.kv_cache.config import CacheConfig
from truespec.kv_cache.layout import kv_slots
from truespec.kv_cache.manager import KVCacheManager
from truespec.worker.input_builder import ContextRow, build_forward_context


def test_block_pool_reference_counts_free_an_id_only_when_the_last_holder_lets_go() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.incref(a[:1])  # shared by a second holder
    pool.free(a)
    assert pool.num_free == 3 and pool.ref_count(a[0]) == 1
    pool.free(a[:1])
    assert pool.num_free == 4
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free(a[:1])
    with pytest.raises(RuntimeError, match="is free"):
        pool.incref(a[:1])
    with pytest.raises(RuntimeError, match="5 needed, 4 free"):
        pool.allocate(5)


def test_manager_grows_block_tables_and_returns_everything() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, num_state_groups=2, slots_per_group=3)
    kv.allocate("x", 3)  # so that "a" gets blocks other than 0
    kv.allocate("a", 6)
    kv.allocate_state("a")
    assert len(kv.block_ids("a")) == 2 and kv.num_blocks_needed("a", 9) == 1
    assert kv.first_state_slot("a") % 3 == 0 and kv.num_state_slots == 6
    with pytest.raises(RuntimeError, match="already holds"):
        kv.allocate_state("a")
    with pytest.raises(RuntimeError):
        kv.allocate("a", 100)
    kv.free("a")
    kv.free("x")
    kv.free("never-seen")
    info = kv.cache_info()
    assert info["num_free_blocks"] == info["num_blocks"] == 8
    assert info["num_free_state_slots"] == info["num_state_slots"] == 2


def test_kv_slots_follow_the_block_table() -> None:
    kv = KVCacheManager(8, 4, 1, 1)
    kv.allocate("x", 3)
    kv.allocate("a", 6)
    b0, b1 = kv.block_ids("a")
    expected = [b0 * 4, b0 * 4 + 1, b0 * 4 + 2, b0 * 4 + 3, b1 * 4, b1 * 4 + 1]
    assert kv_slots([b0, b1], 0, 6, 4) == expected
    ctx = build_forward_context([ContextRow([b0, b1], 0, 6, -1, 0, 5, 1)], 4, torch.device("cpu"))
    assert ctx.slot_mapping.tolist() == expected


@pytest.mark.parametrize(("field", "value"), [("block_size", 0), ("kv_cache_dtype", "int3"),
                                              ("num_gpu_blocks_override", -1), ("gpu_memory_utilization", 1.5),
                                              ("cpu_kv_cache_space_gib", 0)])
def test_cache_config_errors_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        CacheConfig(**{field: value})
