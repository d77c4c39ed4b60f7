"""Scheduler, block manager and state manager: plain Python, no model (invariants 1 and 6)."""

import pytest
import torch

from truespec.engine.block_manager import BlockManager
from truespec.engine.context_builder import ContextRow, build_forward_context
from truespec.engine.scheduler import Scheduler
from truespec.engine.sequence import Sequence, SequenceStatus
from truespec.engine.state_manager import StateManager
from truespec.sampling_params import SamplingParams


def make(num_blocks: int = 16, block_size: int = 4, max_num_seqs: int = 4, budget: int = 8) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), StateManager(max_num_seqs, 1), max_num_seqs, budget)


def seq(name: str, prompt_len: int) -> Sequence:
    return Sequence(name, None, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=100), 100)


def run_step(sched: Scheduler, token: int = 7) -> list[tuple[str, int]]:
    """Schedule, pretend the model ran, append a token for each request that finished its prefill."""
    out = sched.schedule()
    for s in out.scheduled:
        last = s.is_last_chunk
        s.seq.num_computed_tokens += s.num_new_tokens
        if last:
            s.seq.output_token_ids.append(token)
    return [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled]


def test_chunked_prefill_mixes_with_decodes_within_budget() -> None:
    sched = make(budget=8)
    sched.add(seq("a", 3))
    sched.add(seq("b", 13))
    assert run_step(sched) == [("a", 3), ("b", 5)]
    assert run_step(sched) == [("a", 1), ("b", 7)]
    assert run_step(sched) == [("a", 1), ("b", 1)]  # b finished its prefill last step: both decode


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
    assert sched.block_manager.num_free_blocks == 0
    scheduled = run_step(sched)  # a needs a 3rd block at token 8? a has 8 tokens -> fits; b needs block 3
    assert ("a", 1) in scheduled
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert b.block_ids == [] and b.state_group is None
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
    assert sched.block_manager.num_free_blocks == 6
    assert sched.state_manager.num_free_groups == 4
    assert not sched.has_unfinished()


def test_block_manager_slots_follow_block_table() -> None:
    bm = BlockManager(8, 4)
    bm.allocate(seq("x", 3), 3)  # so that "a" gets blocks other than 0, 1
    s = seq("a", 6)
    bm.allocate(s, 6)
    assert len(s.block_ids) == 2
    ctx = build_forward_context([ContextRow(s.block_ids, 0, 6, -1, 0, 5, 1)], 4, torch.device("cpu"))
    b0, b1 = s.block_ids
    assert ctx.slot_mapping.tolist() == [b0 * 4, b0 * 4 + 1, b0 * 4 + 2, b0 * 4 + 3, b1 * 4, b1 * 4 + 1]
    with pytest.raises(RuntimeError):
        bm.allocate(s, 100)


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
