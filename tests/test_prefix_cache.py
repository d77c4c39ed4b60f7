"""Prefix caching's plain-Python parts (no model): the chained block keys, the LRU of cached blocks and their
reference counts, state checkpoints kept consistent with their blocks, and what the scheduler does with them
(docs/ARCHITECTURE.md, "Prefix caching"; invariant 6: free counts return to their initial values)."""

import pytest

from truespec.core.scheduler import Scheduler
from truespec.core.sequence import Sequence
from truespec.kv_cache.config import CacheConfig
from truespec.kv_cache.manager import KVCacheManager, PrefixSettings
from truespec.kv_cache.prefix_cache import block_keys
from truespec.kv_cache.state_checkpoints import is_checkpoint_position, next_checkpoint_position
from truespec.sampling_params import SamplingParams

BS = 4


def manager(num_blocks: int = 16, checkpoints: int = 0, interval: int = 8, extra: int = 0) -> KVCacheManager:
    settings = PrefixSettings(extra, checkpoints, checkpoints > 0, interval)
    return KVCacheManager(num_blocks, BS, num_state_groups=2, slots_per_group=3, prefix=settings)


def run(kv: KVCacheManager, request_id: str, tokens: list[int], computed: int | None = None) -> list[int]:
    """A request that computed ``tokens`` (or the first ``computed``) from what the cache gave it; its table."""
    hit = kv.find_prefix(request_id, tokens)
    assert kv.can_allocate(request_id, len(tokens), hit)
    kv.take_prefix(request_id, hit, len(tokens))
    table = kv.allocate(request_id, len(tokens))
    kv.cache_blocks(request_id, tokens, len(tokens) if computed is None else computed)
    return table


def test_block_keys_chain_every_token_before_them() -> None:
    a, b = list(range(12)), list(range(12))
    b[1] = 99  # differs in block 0 only: every later key differs too
    ka, kb = block_keys(a, BS, 3), block_keys(b, BS, 3)
    assert all(x != y for x, y in zip(ka, kb, strict=True))
    assert block_keys(a + [5], BS, 3) == ka  # tokens past the blocks do not matter
    assert block_keys(a, BS, 2, extra_tokens=1) != ka[:2]  # with one token past each block, they do
    assert block_keys(a, BS, 2, extra_tokens=1) != block_keys(a[:8] + [7], BS, 2, extra_tokens=1)
    assert block_keys(a, BS, 3, parent_keys=ka[:1]) == ka
    with pytest.raises(ValueError, match="needs 5 token ids"):
        block_keys(a[:8], BS, 2, extra_tokens=1)


def test_longest_cached_chain_is_shared_and_leaves_one_token_to_compute() -> None:
    kv = manager()
    first = run(kv, "a", list(range(10)))  # blocks 0, 1 full and cached; block 2 partial
    assert kv.cache.num_cached_blocks == 2
    assert kv.find_prefix("b", list(range(8))).num_tokens == 4  # a whole-prompt hit keeps its last token
    hit = kv.find_prefix("c", list(range(9)) + [50])
    assert hit.num_tokens == 8 and hit.block_ids == first[:2]
    kv.take_prefix("c", hit, 10)
    assert kv.blocks.ref_count(first[0]) == 3  # the cache, "a", "c"
    assert kv.num_queried_tokens == 20 and kv.num_hit_tokens == 8  # "a" (0 of 10) and "c" (8 of 10)
    assert not kv.reset_prefix_cache()  # in use


def test_unused_cached_blocks_count_as_free_and_are_evicted_least_recently_used_tail_first() -> None:
    kv = manager(num_blocks=7)
    run(kv, "a", list(range(13)))  # 3 cached blocks + 1 partial
    run(kv, "b", [100 + t for t in range(9)])  # 2 cached + 1 partial
    kv.forget("a")
    kv.forget("b")
    info = kv.cache_info()
    assert info["num_free_blocks"] == 7 and info["num_cached_blocks"] == 5
    # 2 never-cached blocks are free; 1 more evicts the oldest unused cached one: "a"'s last block
    kv.allocate("c", 12)
    assert kv.find_prefix("d", list(range(13))).num_tokens == 8
    assert kv.find_prefix("e", [100 + t for t in range(9)]).num_tokens == 8
    kv.forget("c")
    assert kv.reset_prefix_cache() and kv.cache_info()["num_cached_blocks"] == 0
    assert kv.blocks.num_free == 7


def test_a_hybrid_prefix_ends_at_a_checkpoint_and_a_checkpoint_goes_with_its_block() -> None:
    kv = manager(num_blocks=8, checkpoints=2, interval=8)
    tokens = list(range(14))
    run(kv, "a", tokens)  # blocks 0..2 cached
    assert kv.find_prefix("b", tokens).num_tokens == 0  # no checkpoint yet: no usable prefix
    assert kv.add_checkpoint("a", 8) is not None and kv.add_checkpoint("a", 8) is None  # once per prefix
    assert kv.add_checkpoint("a", 16) is None  # block 3 is not cached
    hit = kv.find_prefix("b", tokens)
    assert (hit.num_tokens, hit.checkpoint_slot) == (8, kv.checkpoints.first_slot)
    assert kv.num_state_slots == 2 * 3 + 2  # the groups', then the checkpoints'
    kv.forget("a")
    kv.allocate("big", 7 * BS)  # evicts every cached block but one; block 1 goes, so its checkpoint goes
    assert kv.checkpoints.num_checkpoints == 0 and kv.find_prefix("b", tokens).num_tokens == 0


def test_checkpoints_are_evicted_least_recently_used() -> None:
    kv = manager(num_blocks=16, checkpoints=2, interval=4)
    for i, name in enumerate("abc"):
        run(kv, name, [10 * i + 1] * 9)
        kv.add_checkpoint(name, 8)
    assert kv.checkpoints.num_checkpoints == 2
    assert kv.find_prefix("x", [1] * 9).num_tokens == 0  # "a"'s was the oldest
    assert kv.find_prefix("y", [21] * 9).num_tokens == 8


def test_checkpoint_positions_are_interval_multiples_and_the_prompt_end() -> None:
    assert [p for p in range(1, 60) if is_checkpoint_position(p, 37, 16, 4)] == [16, 32, 36, 48]
    assert [p for p in range(1, 60) if is_checkpoint_position(p, 40, 16, 4)] == [16, 32, 36, 40, 48]
    assert next_checkpoint_position(0, 37, 16, 4) == 16
    assert next_checkpoint_position(32, 37, 16, 4) == 36
    assert next_checkpoint_position(36, 37, 16, 4) == 48


@pytest.mark.parametrize(("interval", "budget"), [(6, 0.1), (0, 0.1), (True, 0.1), (8, 1.0), (8, -0.1), (8, "x"),
                                                  (8, float("nan"))])
def test_bad_prefix_state_settings_name_their_field(interval: int, budget: object) -> None:
    field = "prefix_state_interval" if budget == 0.1 else "prefix_state_budget"
    with pytest.raises(ValueError, match=field):
        CacheConfig(block_size=4, prefix_state_interval=interval, prefix_state_budget=budget)


def test_enable_prefix_caching_must_be_a_bool() -> None:
    from truespec.config import EngineConfig

    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(model="m", enable_prefix_caching="yes")


def test_prefix_caching_is_on_by_default_and_can_be_turned_off() -> None:
    from truespec.config import EngineConfig

    default, off = EngineConfig(model="m"), EngineConfig(model="m", enable_prefix_caching=False)
    assert CacheConfig.from_engine_config(default).enable_prefix_caching
    assert not CacheConfig.from_engine_config(off).enable_prefix_caching


# ---- the scheduler ----------------------------------------------------------------------------------------
def scheduler(checkpoints: int = 0, interval: int = 8, budget: int = 64) -> Scheduler:
    return Scheduler(manager(num_blocks=32, checkpoints=checkpoints, interval=interval), 2, budget)


def request(name: str, tokens: list[int]) -> Sequence:
    return Sequence(name, None, tokens, SamplingParams(max_tokens=4), 4)


def finish_prefill(sched: Scheduler, seq: Sequence) -> list[tuple[int, int]]:
    """Run ``seq``'s prefill to its first token; the chunk lengths and every state save of the steps."""
    chunks, saves = [], []
    while not seq.output_token_ids:
        out = sched.schedule()
        saves += out.state_saves
        (r,) = out.scheduled
        chunks.append(r.num_new_tokens)
        seq.advance(r.num_new_tokens, 0)
        if r.is_last_chunk:
            seq.output_token_ids.append(7)
    sched.finish(seq, "stop")
    saves += sched.schedule().state_saves or sched.prefix.take_saves()
    return chunks, saves


def test_hybrid_chunks_end_at_checkpoints_which_are_saved_and_restored() -> None:
    sched = scheduler(checkpoints=8, interval=8)
    a = request("a", list(range(1, 23)))  # 22 tokens: checkpoints at 8, 16 and 20 (the prompt's end, aligned)
    sched.add(a)
    chunks, saves = finish_prefill(sched, a)
    assert chunks == [8, 8, 4, 2]
    first = sched.kv.checkpoints.first_slot
    assert sorted(dst for _, dst in saves) == [first, first + 1, first + 2]
    b = request("b", list(range(1, 23)) + [5])
    sched.add(b)
    out = sched.schedule()
    assert b.num_cached_tokens == b.num_computed_tokens == 20
    assert out.scheduled[0].num_computed_tokens == 20 and out.scheduled[0].num_new_tokens == 3
    assert out.state_restores == [(sched.kv.checkpoints.get(sched.kv._keys["b"][4]), sched.kv.first_state_slot("b"))]


def test_everything_comes_back_after_finish_and_preemption() -> None:
    sched = scheduler()
    for name in "ab":
        s = request(name, list(range(1, 30)))
        sched.add(s)
        finish_prefill(sched, s)
    c = request("c", list(range(1, 30)))
    sched.add(c)
    sched.schedule()
    assert c.num_computed_tokens == 28
    sched.preempt(c)
    sched.finish(c, "abort")
    info = sched.kv.cache_info()
    assert info["num_free_blocks"] == info["num_blocks"] and info["num_free_state_slots"] == info["num_state_slots"]
    assert sched.kv.reset_prefix_cache() and sched.kv.blocks.num_free == info["num_blocks"]


def test_a_request_finishing_with_a_model_drafter_caches_only_what_the_drafter_caught_up_on() -> None:
    """The drafter writes its KV of a step's positions after the step, which a request finishing in it never gets:
    blocks the last step completed are not cached (without a drafter they are)."""
    cached = []
    for has_drafter in (False, True):
        settings = PrefixSettings(has_drafter_cache=has_drafter)
        sched = Scheduler(KVCacheManager(32, BS, 2, 1, prefix=settings), 2, 64)
        a = request("a", list(range(1, 7)))
        sched.add(a)
        finish_prefill(sched, a)  # 6 tokens in one step: block 0 completed by it, then finished
        cached.append(sched.kv.cache.num_cached_blocks)
    assert cached == [1, 0]


# ---- a GdnPrefillRule: long prompts (fla) and short ones (token loop) never share, and hit on fla's grid ----------
def ruled_scheduler(interval: int = 40) -> Scheduler:
    from truespec.core.gdn_prefill_rule import GdnPrefillRule

    return Scheduler(manager(num_blocks=160, checkpoints=16, interval=interval), 2, 1000,
                     gdn_rule=GdnPrefillRule(128))  # long: prompts of 128+ tokens; grid lcm(4, 64) = 64


def test_block_keys_root_salts_every_key_and_defaults_to_todays() -> None:
    from truespec.kv_cache.prefix_cache import ROOT_KEY

    a = list(range(12))
    assert block_keys(a, BS, 3, root=ROOT_KEY) == block_keys(a, BS, 3)
    salted = block_keys(a, BS, 3, root=ROOT_KEY + b"fla")
    assert all(s != k for s, k in zip(salted, block_keys(a, BS, 3), strict=True))


def test_long_prompt_checkpoints_sit_on_the_fla_grid_and_its_hits_start_there() -> None:
    """Interval positions (40, 80, ...) off the 64-grid and the prompt's end aligned to 64 (not to a block): a 200-token
    prompt runs chunks of 192 and 8 and leaves one checkpoint, at 192, where the same prompt's next turn resumes."""
    sched = ruled_scheduler()
    tokens = list(range(1, 201))
    a = request("a", tokens)
    sched.add(a)
    chunks, saves = finish_prefill(sched, a)
    assert chunks == [192, 8] and len(saves) == 1 and sched.kv.checkpoints.num_checkpoints == 1
    b = request("b", tokens + [7, 9])
    sched.add(b)
    sched.schedule()
    assert b.num_cached_tokens == 192
    sched.finish(b, "stop")
    assert [p for p in range(1, 400) if is_checkpoint_position(p, 200, *sched.prefix._checkpoint_grid(b))] == \
        [192, 320]


def test_long_and_short_prompts_share_no_block_and_no_checkpoint() -> None:
    """A short prompt's blocks hold the token loop's states, a long one's fla's: each looks up under its own root, so
    neither hits the other's cache (each would hit at 64 or more with one root), while the same path hits as before."""
    from truespec.kv_cache.prefix_cache import ROOT_KEY

    sched = ruled_scheduler(interval=64)  # checkpoints every 64 tokens, for long and short prompts alike
    long_tokens, short_tokens = list(range(1, 201)), list(range(1000, 1100))
    for name, prompt in (("long", long_tokens), ("short", short_tokens)):  # computed in turn, both cached
        seq = request(name, prompt)
        sched.add(seq)
        finish_prefill(sched, seq)
    kv = sched.kv
    assert all(map(kv.cache.contains, block_keys(short_tokens, BS, 25)))  # a short prompt's keys are today's
    assert all(map(kv.cache.contains, block_keys(long_tokens, BS, 50, root=ROOT_KEY + b"fla")))
    assert not any(map(kv.cache.contains, block_keys(long_tokens, BS, 50)))
    cached = {}
    for name, prompt in (("short_after_long", long_tokens[:100] + [3]), ("long_after_short", short_tokens + [3] * 60),
                         ("short_after_short", short_tokens + [3]), ("long_after_long", long_tokens + [3])):
        seq = cached[name] = request(name, prompt)
        sched.add(seq)
        sched.schedule()
        sched.finish(seq, "abort")
    assert {name: seq.num_cached_tokens for name, seq in cached.items()} == \
        {"short_after_long": 0, "long_after_short": 0, "short_after_short": 100, "long_after_long": 192}


def test_without_a_rule_long_prompts_key_and_checkpoint_as_before() -> None:
    sched = Scheduler(manager(num_blocks=160, checkpoints=8, interval=8), 2, 1000)
    a = request("a", list(range(1, 201)))
    sched.add(a)
    chunks, _ = finish_prefill(sched, a)
    assert chunks == [8] * 24 + [4, 4] and all(map(sched.kv.cache.contains, block_keys(a.prompt_token_ids, BS, 50)))
