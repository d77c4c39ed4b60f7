"""core/gdn_prefill_rule.py: which prompts' GDN prefill runs fla's chunk kernel, where their chunks are cut, and when
the engine has a rule at all (only where fla runs: never on CPU, so the float64 tests keep today's schedules).

The scheduler's and the prefix cache's use of the rule are in test_scheduler.py and test_prefix_cache.py; the
routing in the layer and kernels/gdn_chunked.py in test_gdn_chunked.py; on a GPU, test_gpu_gdn_prefill_rule.py.
"""

from pathlib import Path

import pytest
import torch

from truespec import LLM, SamplingParams
from truespec.core.gdn_prefill_rule import GdnPrefillRule
from truespec.core.scheduler_output import SchedulerOutput


def test_the_rule_exists_only_with_fla_and_room_for_two_aligned_chunks() -> None:
    assert GdnPrefillRule.create(None, 8192) is None  # fla does not run GDN prefill here
    assert GdnPrefillRule.create(1024, 127) is None
    assert GdnPrefillRule.create(1024, 128) == GdnPrefillRule(1024, 64)
    with pytest.raises(ValueError, match="alignment"):
        GdnPrefillRule(32)


def test_chunk_cuts_fall_on_the_grid_or_at_the_prompt_end() -> None:
    rule = GdnPrefillRule(1024)
    assert rule.is_long(1024) and not rule.is_long(1023)
    assert rule.chunk_len(0, 100, 1100) == 64  # down to a multiple of 64
    assert rule.chunk_len(64, 37, 1100) == 0  # nothing aligned fits: the request waits
    assert rule.chunk_len(1088, 12, 1100) == 12  # the prompt's end, not aligned
    assert rule.chunk_len(1024, 200, 1100) == 76  # a re-prefill crossing the prompt's end stops there
    assert rule.chunk_len(1100, 7, 1100) == 7  # output positions: any cut (the token loop)
    assert rule.prefill_cap(37) == 64 and rule.prefill_cap(2048) == 2048
    assert rule.checkpoint_grid(16) == 64 and rule.checkpoint_grid(48) == 192 and rule.checkpoint_grid(128) == 128


def test_a_cpu_engine_has_no_rule_and_no_request_is_flagged(tiny_models: dict[str, Path]) -> None:
    """On CPU fla never runs: no rule, no flag on any request (gdn_chunked None), so every schedule is as before."""
    from truespec.layers.gdn import chunked_prefill_min_len

    llm = LLM(str(tiny_models["hybrid"]), dtype="float64", device="cpu", max_num_batched_tokens=200)
    engine = llm.llm_engine
    assert engine.gdn_rule is None and engine.scheduler.gdn_rule is None and engine.scheduler.prefix.gdn_rule is None
    assert chunked_prefill_min_len(engine.loaded.model, torch.device("cpu")) is None
    seen = []
    schedule = engine.scheduler.schedule

    def recording_schedule() -> SchedulerOutput:
        out = schedule()
        seen.extend(r.gdn_chunked for r in out.scheduled)
        return out

    engine.scheduler.schedule = recording_schedule
    llm.generate([{"prompt_token_ids": [5] * 1000}], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(seen) >= 6 and set(seen) == {None}  # 5 chunks of the prompt, then a decode
