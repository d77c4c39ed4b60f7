"""Scheduler and KV-cache accounting: plain Python, no model, no tensors (invariants 1 and 6)."""

from truespec.core.scheduler import Scheduler
from truespec.core.scheduler_output import SchedulerOutput
from truespec.core.sequence import Sequence, SequenceStatus
from truespec.kv_cache.manager import KVCacheManager
from truespec.sampling_params import SamplingParams


def make(num_blocks: int = 16, block_size: int = 4, max_num_seqs: int = 4, budget: int = 8,
         lookahead: int = 0) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, block_size, max_num_seqs, 1), max_num_seqs, budget, lookahead)


def seq(name: str, prompt_len: int, max_output_len: int = 100) -> Sequence:
    return Sequence(name, None, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=100), max_output_len)


def run_step(sched: Scheduler, token: int = 7) -> list[tuple[str, int]]:
    """Schedule, pretend the model ran, append a token for each request that finished its prefill."""
    out = sched.schedule()
    seqs = {s.request_id: s for s in sched.running}
    for r in out.scheduled:
        seqs[r.request_id].num_computed_tokens += r.num_new_tokens
        if r.is_last_chunk:
            seqs[r.request_id].output_token_ids.append(token)
    return [(r.request_id, r.num_new_tokens) for r in out.scheduled]


def test_chunked_prefill_mixes_with_decodes_within_budget() -> None:
    sched = make(budget=8)
    sched.add(seq("a", 3))
    sched.add(seq("b", 13))
    assert run_step(sched) == [("a", 3), ("b", 5)]
    assert run_step(sched) == [("a", 1), ("b", 7)]
    assert run_step(sched) == [("a", 1), ("b", 1)]  # b finished its prefill last step: both decode


def test_scheduler_output_carries_everything_the_runner_reads() -> None:
    sched = make(budget=8)
    a = seq("a", 3)
    sched.add(a)
    run_step(sched)
    a.draft_token_ids = [11, 12]
    (r,) = sched.schedule().scheduled
    assert (r.request_id, r.num_computed_tokens, r.num_scheduled_tokens, r.num_new_tokens) == ("a", 3, 3, 1)
    assert r.token_ids == [7, 11, 12] and r.draft_token_ids == [11, 12] and r.is_last_chunk and r.num_logits == 3
    assert r.block_ids == sched.kv.block_ids("a") and len(r.block_ids) == 2  # positions 0..5: two blocks of 4
    assert r.state_src == r.first_state_slot + a.state_index and r.num_output_tokens == 1


def test_max_num_seqs_bounds_running() -> None:
    sched = make(max_num_seqs=2, budget=100)
    for i in range(3):
        sched.add(seq(f"r{i}", 2))
    assert [name for name, _ in run_step(sched)] == ["r0", "r1"]
    assert len(sched.waiting) == 1


def test_preemption_frees_everything_and_recomputes() -> None:
    sched = make(num_blocks=4, block_size=4, budget=100)
    sched.add(seq("a", 7))
    sched.add(seq("b", 8))
    run_step(sched)  # a: 2 blocks, b: 2 blocks, pool empty
    b = sched.running[1]
    assert sched.kv.blocks.num_free == 0
    scheduled = run_step(sched)  # a has 8 tokens -> fits its 2 blocks; b needs a 3rd block: b is preempted
    assert ("a", 1) in scheduled
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert sched.kv.block_ids("b") == [] and "b" not in sched.kv._groups
    assert sched.waiting[0] is b


def test_accounting_returns_to_initial_counts() -> None:
    sched = make(num_blocks=6, block_size=4, budget=5)
    seqs = [seq(f"r{i}", n) for i, n in enumerate([3, 9, 1, 6])]
    for s in seqs:
        sched.add(s)
    for _ in range(6):
        run_step(sched)
    for s in seqs:
        sched.finish(s, "abort")
    assert sched.kv.blocks.num_free == 6
    assert sched.kv.state_groups.num_free == 4
    assert not sched.has_unfinished()
    assert sched.schedule().finished_req_ids == []  # an empty step is never launched: nothing is reported with it
    sched.add(seq("r4", 2))
    assert sorted(sched.schedule().finished_req_ids) == ["r0", "r1", "r2", "r3"]  # with the next step that runs
    assert sched.schedule().finished_req_ids == []  # once


def test_lookahead_blocks_cover_a_drafters_writes_and_stop_at_the_longest_length() -> None:
    """A model drafter writes drafts past a step's query: the scheduler holds blocks for them (num_lookahead)."""
    sched = make(num_blocks=16, block_size=4, budget=100, lookahead=3)
    sched.add(seq("a", 5, max_output_len=100))
    sched.add(seq("b", 5, max_output_len=2))
    run_step(sched)
    assert len(sched.kv.block_ids("a")) == 2  # positions 0..7: the prompt (5) and 3 lookahead
    assert len(sched.kv.block_ids("b")) == 2  # capped at prompt + max_output_len = 7 positions


def test_a_verify_that_waited_goes_first_next_step() -> None:
    """Drafts are never cut by the batch, so a verify that does not fit waits whole; it must not starve."""
    sched = make(num_blocks=64, budget=8)
    for name in ("a", "b", "c"):
        sched.add(seq(name, 1))
    run_step(sched)  # three 1-token prefills, each gets a token
    for s in sched.running:
        s.draft_token_ids = [5] * 5  # 1 + 5 = 6 tokens each: only one verify fits a step of 8
    first = run_step(sched)
    second = run_step(sched)
    assert first[0] == ("a", 1) and second[0][0] in ("b", "c")  # the waiting ones are served first


def test_token_slice_equals_slicing_the_whole_token_list() -> None:
    s = seq("a", 5)
    s.output_token_ids += [50, 51, 52]
    for start in range(0, 10):
        for end in range(start, 11):
            assert s.token_slice(start, end) == s.token_ids[start:end]


def test_prompt_logprob_rows_cover_each_prompt_token_once() -> None:
    """Chunk by chunk, token t comes from the row of position t - 1; after a preemption midway the re-prefill lists
    only the tokens still missing, and nothing once the prompt's are all given."""
    sched = make(budget=5)
    a = Sequence("a", None, list(range(1, 13)), SamplingParams(max_tokens=100, prompt_logprobs=1), 100)
    sched.add(a)
    seen = []
    for step in range(6):
        if step == 2:  # after two chunks (positions 0..9)
            sched.preempt(a)
        (r,) = sched.schedule().scheduled
        positions = [r.num_computed_tokens + i for i in r.prompt_logprobs_rows]
        assert r.prompt_logprob_token_ids == [a.prompt_token_ids[p + 1] for p in positions]
        seen += r.prompt_logprob_token_ids
        a.prompt_logprobs += [{t: 0.0} for t in r.prompt_logprob_token_ids]  # as the output processor does
        a.num_computed_tokens += r.num_new_tokens
        if r.is_last_chunk:
            a.output_token_ids.append(7)
    assert seen == a.prompt_token_ids[1:] and a.output_token_ids == [7, 7]


def make_capped(threshold: int | None, budget: int = 5000) -> Scheduler:
    kv = KVCacheManager(2048, 4, 4, 1)
    return Scheduler(kv, 4, budget, 0, long_prefill_token_threshold=threshold)


def test_a_long_prompt_alone_takes_the_whole_budget_but_is_capped_beside_decodes() -> None:
    """Default (None): the cap (AUTO_LONG_PREFILL_TOKENS) applies only while a running request decodes."""
    from truespec.core.chunk_planner import AUTO_LONG_PREFILL_TOKENS

    sched = make_capped(None)
    sched.add(seq("alone", 6000))
    assert run_step(sched) == [("alone", 5000)]
    sched = make_capped(None)
    sched.add(seq("short", 3))
    run_step(sched)  # short is decoding from now on
    sched.add(seq("long", 6000))
    assert run_step(sched) == [("short", 1), ("long", AUTO_LONG_PREFILL_TOKENS)]
    assert run_step(sched) == [("short", 1), ("long", AUTO_LONG_PREFILL_TOKENS)]
    assert run_step(sched) == [("short", 1), ("long", 6000 - 2 * AUTO_LONG_PREFILL_TOKENS)]  # its last chunk


def test_long_prefill_token_threshold_caps_always_and_zero_never() -> None:
    sched = make_capped(100)
    sched.add(seq("a", 250))
    assert [run_step(sched) for _ in range(3)] == [[("a", 100)], [("a", 100)], [("a", 50)]]
    sched = make_capped(0)
    sched.add(seq("short", 3))
    run_step(sched)
    sched.add(seq("long", 4000))
    assert run_step(sched) == [("short", 1), ("long", 4000)]


def test_long_prefill_token_threshold_is_validated() -> None:
    import pytest

    from truespec.config import EngineConfig

    for bad in (-1, 1.5, True, "2048"):
        with pytest.raises(ValueError, match="long_prefill_token_threshold"):
            EngineConfig(model="m", long_prefill_token_threshold=bad)


# ---- a GdnPrefillRule: long prompts' chunks cut on fla's 64-token grid (core/gdn_prefill_rule.py) ----------------
def make_ruled(budget: int, threshold: int | None = None, ruled: bool = True) -> Scheduler:
    from truespec.core.gdn_prefill_rule import GdnPrefillRule

    rule = GdnPrefillRule(1024) if ruled else None
    return Scheduler(KVCacheManager(2048, 4, 4, 1), 4, budget, 0, long_prefill_token_threshold=threshold,
                     gdn_rule=rule)


def chunk_ends(sched: Scheduler, seqs: list[Sequence], max_steps: int = 500) -> dict[str, list[int]]:
    """Run the scheduler until every request has its first token; per request, where each of its chunks ended."""
    for s in seqs:
        sched.add(s)
    ends: dict[str, list[int]] = {s.request_id: [] for s in seqs}
    for _ in range(max_steps):
        if all(s.output_token_ids for s in seqs):
            return ends
        out = sched.schedule()
        for r in out.scheduled:
            if r.num_computed_tokens < r.prompt_len:
                ends[r.request_id].append(r.num_computed_tokens + r.num_new_tokens)
        run_step_outputs(sched, out)
    raise AssertionError("the prefills never finished")


def run_step_outputs(sched: Scheduler, out: SchedulerOutput) -> None:
    seqs = {s.request_id: s for s in sched.running}
    for r in out.scheduled:
        seqs[r.request_id].num_computed_tokens += r.num_new_tokens
        if r.is_last_chunk:
            seqs[r.request_id].output_token_ids.append(7)


def test_long_prompt_chunks_end_on_multiples_of_64_or_at_the_prompt_end() -> None:
    for budget, threshold in [(100, None), (1000, None), (8192, None), (1000, 128), (1000, 37), (300, 0)]:
        sched = make_ruled(budget, threshold)
        seqs = [seq("long", 1100), seq("short", 700), seq("long2", 2500)]
        ends = chunk_ends(sched, seqs)
        for name, prompt_len in (("long", 1100), ("long2", 2500)):
            assert ends[name][-1] == prompt_len, (budget, threshold, ends)
            assert all(end % 64 == 0 for end in ends[name][:-1]), (budget, threshold, ends)
            assert ends[name] == sorted(ends[name])
    # a cap under 64 still lets a long prompt progress by one aligned chunk a step
    assert chunk_ends(make_ruled(1000, 37), [seq("long", 1100)])["long"][:2] == [64, 128]


def test_short_prompts_schedule_as_without_a_rule() -> None:
    """The rule changes only long requests' chunks: short ones (and, with no rule, long ones) are cut as before."""
    def workload() -> list[Sequence]:
        return [seq("a", 700), seq("b", 1023), seq("c", 5)]

    for budget, threshold in [(100, None), (300, 128), (1000, None)]:
        assert chunk_ends(make_ruled(budget, threshold), workload()) == \
            chunk_ends(make_ruled(budget, threshold, ruled=False), workload())
    assert chunk_ends(make_ruled(100, ruled=False), [seq("long", 1100)])["long"][:2] == [100, 200]  # no rule: today's


def test_a_waiting_long_prompt_waits_when_less_than_64_tokens_of_budget_are_left() -> None:
    sched = make_ruled(100)
    sched.add(seq("short", 63))
    sched.add(seq("long", 1100))
    assert run_step(sched) == [("short", 63)]  # 37 tokens left: no aligned chunk fits, "long" waits
    assert [s.request_id for s in sched.waiting] == ["long"]
    assert run_step(sched) == [("short", 1), ("long", 64)]  # 99 left: one 64-token chunk


def test_a_long_re_prefill_after_preemption_is_cut_at_the_prompt_end() -> None:
    """The prompt part runs fla and the recomputed outputs the token loop (as they were decoded): one chunk each, and
    the drafts ride on the second (test_model_runner.py: only the first is flagged for fla)."""
    sched = make_ruled(8192)
    a = seq("a", 1100)
    chunk_ends(sched, [a])
    a.output_token_ids += [8, 9, 10, 11]  # 5 outputs in all
    sched.preempt(a)
    a.draft_token_ids = [12, 13]
    first = sched.schedule().scheduled[0]
    assert (first.num_computed_tokens, first.num_scheduled_tokens, first.draft_token_ids) == (0, 1100, [])
    assert first.gdn_chunked
    a.num_computed_tokens = 1100
    second = sched.schedule().scheduled[0]
    assert (second.num_computed_tokens, second.num_new_tokens, second.draft_token_ids) == (1100, 5, [12, 13])
    assert second.gdn_chunked
    short = make_ruled(8192)
    chunk_ends(short, [b := seq("b", 500)])
    assert short.schedule().scheduled[0].gdn_chunked is False and b.output_token_ids == [7]
    none = make_ruled(8192, ruled=False)
    chunk_ends(none, [seq("c", 1100)])
    assert none.schedule().scheduled[0].gdn_chunked is None  # no rule: the layer decides by chunk length
