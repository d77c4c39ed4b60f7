"""The scheduler/runner contract: a ``SchedulerOutput`` built by hand runs through the ``ModelRunner`` alone (no
engine, no scheduler) and gives the engine's tokens, for prefill chunks, decodes and verifies of drafts in one
step (invariants 1, 2 and 4), in float64 on CPU."""

from pathlib import Path

import torch

from helpers.engine import random_prompts
from truespec import LLM, SamplingParams
from truespec.core.scheduler_output import ScheduledRequest, SchedulerOutput
from truespec.models.loader import load_model
from truespec.worker.graph_runner import GraphSettings
from truespec.worker.model_runner import ModelRunner

BLOCK_SIZE = 4
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def request(request_id: str, tokens: list[int], start: int, n: int, group: int, state_index: int = 0,
            drafts: list[int] | None = None, num_output_tokens: int = 0) -> ScheduledRequest:
    """Request ``request_id`` computing ``tokens[start:start + n]`` (then ``drafts``) with blocks 8*group.. and
    state group ``group`` (3 slots each); ``tokens`` is its prompt and its ``num_output_tokens`` outputs."""
    drafts = drafts or []
    end = start + n + len(drafts)
    blocks = list(range(8 * group, 8 * group + -(-end // BLOCK_SIZE)))
    return ScheduledRequest(request_id, GREEDY, start, n + len(drafts), tokens[start:start + n] + drafts, drafts, None,
                            blocks, 3 * group, state_index, num_output_tokens, start + n == len(tokens),
                            len(tokens) - num_output_tokens)


def test_a_hand_built_scheduler_output_runs_without_the_engine(tiny_models: dict[str, Path]) -> None:
    model_dir = tiny_models["hybrid"]
    a, b = (p["prompt_token_ids"] for p in random_prompts([9, 6], seed=5))
    reference = [o.outputs[0].token_ids for o in LLM(str(model_dir), dtype="float64", device="cpu").generate(
        [{"prompt_token_ids": a}, {"prompt_token_ids": b}], GREEDY, use_tqdm=False)]
    loaded = load_model(model_dir, "float64", torch.device("cpu"))
    runner = ModelRunner(loaded.model, torch.device("cpu"), loaded.dtype, seed=0, eos_token_ids=set())
    runner.allocate_caches(num_blocks=24, block_size=BLOCK_SIZE, num_state_slots=6)
    runner.init_graphs(GraphSettings(block_size=BLOCK_SIZE))  # eager on CPU

    # step 1: a's whole prompt, b's first chunk (no token sampled for it)
    out = runner.execute(SchedulerOutput([request("a", a, 0, 9, 0), request("b", b, 0, 4, 1)]))
    assert out.req_ids == ["a", "b"] and out.sampled_token_ids == [[reference[0][0]], []]
    assert out.hidden_states.shape[0] == 13 and out.query_start_loc == [0, 9, 13]

    # step 2: a verifies two drafts (the first right, the second wrong) beside b's last chunk
    a += [reference[0][0]]
    drafts = [reference[0][1], (reference[0][2] + 1) % 300]
    out = runner.execute(SchedulerOutput([request("a", a, 9, 1, 0, drafts=drafts, num_output_tokens=1),
                                          request("b", b, 4, 2, 1)]))
    assert out.sampled_token_ids == [reference[0][1:3], [reference[1][0]]] and out.num_accepted(0) == 1

    # step 3: a decodes from the state after its accepted draft (slot 1 of its group), b decodes
    a += reference[0][1:3]
    b += [reference[1][0]]
    out = runner.execute(SchedulerOutput([request("a", a, 11, 1, 0, state_index=1, num_output_tokens=3),
                                          request("b", b, 6, 1, 1, num_output_tokens=1)]))
    assert out.sampled_token_ids == [[reference[0][3]], [reference[1][1]]]
