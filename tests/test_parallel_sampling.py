"""Parallel sampling (SamplingParams.n > 1) on the embedded model in float64: one RequestOutput per prompt holding n
completions (index 0..n-1), child i equal to a separate n=1 request seeded seed + i, greedy children equal to the
n=1 output, streamed outputs that add up to the final one, an abort of the parent that frees every block and state
slot (invariant 6), and the same tokens with n-gram speculation as without."""

from dataclasses import replace

import pytest

from truespec import LLM, RequestOutputKind, SamplingParams
from truespec.assets import DEFAULT_MODEL_DIR
from truespec.engine.parallel_sampling import child_params

PROMPTS = ["def fib(n):", "import os\n"]
SEEDED = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def embedded_llm(**kw: object) -> LLM:
    return LLM(str(DEFAULT_MODEL_DIR), dtype="float64", device="cpu", max_model_len=256, **kw)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return embedded_llm()


def tokens(llm: LLM, prompt: str, params: SamplingParams) -> list[list[int]]:
    """Each completion's tokens, by index."""
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == list(range(params.n))
    return [c.token_ids for c in out.outputs]


def assert_all_free(llm: LLM) -> None:
    info = llm.cache_info()
    assert info["num_free_blocks"] == info["num_blocks"]
    assert info["num_free_state_slots"] == info["num_state_slots"]


def test_n_gives_one_output_per_prompt_with_n_indexed_completions(llm: LLM) -> None:
    outs = llm.generate(PROMPTS, SEEDED, use_tqdm=False)
    assert len(outs) == 2 and outs[0].request_id != outs[1].request_id
    for out in outs:
        assert out.finished and [c.index for c in out.outputs] == [0, 1, 2]
        assert [len(c.token_ids) for c in out.outputs] == [6, 6, 6]
        assert [c.finish_reason for c in out.outputs] == ["length"] * 3
        assert len(out.metrics.token_times) == 18  # every choice's tokens
    assert_all_free(llm)


def test_seeded_child_i_equals_a_separate_request_seeded_seed_plus_i(llm: LLM) -> None:
    children = tokens(llm, PROMPTS[0], SEEDED)
    alone = [tokens(llm, PROMPTS[0], SamplingParams(temperature=1.0, seed=11 + i, max_tokens=6, ignore_eos=True))[0]
             for i in range(3)]
    assert children == alone
    assert len({tuple(t) for t in children}) == 3  # distinct
    assert tokens(llm, PROMPTS[0], SEEDED) == children  # reproducible


def test_child_seed_wraps_past_the_largest_seed() -> None:
    """seed + i past 2**64 - 1 wraps by 2**64: the same random stream (a generator takes its seed mod 2**64)."""
    params = SamplingParams(n=3, seed=2**64 - 2, temperature=1.0)
    assert [child_params(params, i).seed for i in range(3)] == [2**64 - 2, 2**64 - 1, 0]
    assert [child_params(params, i).n for i in range(3)] == [1, 1, 1]
    assert child_params(SamplingParams(n=2), 1).seed is None


def test_greedy_children_equal_the_n1_output(llm: LLM) -> None:
    reference = tokens(llm, PROMPTS[1], GREEDY)[0]
    params = SamplingParams(n=3, temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=1)
    out = llm.generate(PROMPTS[1], params, use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [reference] * 3
    alone = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
                         use_tqdm=False)[0].prompt_logprobs
    assert len(out.prompt_logprobs) == len(alone) == len(out.prompt_token_ids)  # one copy, not one per child
    for mine, ref in zip(out.prompt_logprobs[1:], alone[1:], strict=True):  # a batch of 3 rounds differently
        assert mine.keys() == ref.keys() and list(mine.values()) == pytest.approx(list(ref.values()), rel=1e-9)


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_streamed_parent_outputs_add_up_to_generate(llm: LLM, kind: RequestOutputKind) -> None:
    """Every output carries the parent's id; DELTA: the choices that produced something in the step (a finished one
    never again), added up per index they are the final completions; CUMULATIVE: every choice so far, the last output
    equal to generate's. Only the last output is finished (the children stop at different steps)."""
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=16, stop="\n")
    final = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    assert [len(c.token_ids) for c in final.outputs] == [15, 9, 12]
    engine = llm.llm_engine
    request_id = engine.add_request(PROMPTS[0], replace(params, output_kind=kind))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert {o.request_id for o in outs} == {request_id}
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    by_index: dict[int, list[int]] = {0: [], 1: [], 2: []}
    finished_at: dict[int, int] = {}
    for step, o in enumerate(outs):
        indexes = [c.index for c in o.outputs]
        assert indexes == sorted(set(indexes))
        for c in o.outputs:
            if kind is RequestOutputKind.DELTA:
                assert c.index not in finished_at  # nothing after a choice's finished output
                by_index[c.index] += c.token_ids
            else:
                by_index[c.index] = c.token_ids
            if c.finish_reason is not None:
                finished_at.setdefault(c.index, step)
    assert [by_index[i] for i in range(3)] == [c.token_ids for c in final.outputs]
    assert finished_at[1] < finished_at[2] < finished_at[0] == len(outs) - 1
    if kind is RequestOutputKind.CUMULATIVE:
        assert outs[-1].outputs == final.outputs
    assert engine.parents._parents == {}
    assert_all_free(llm)


def test_aborting_the_parent_aborts_every_child_and_frees_every_block(llm: LLM) -> None:
    engine = llm.llm_engine
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=200, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    parent = engine.make_request(PROMPTS[0], params)
    engine.add(parent)
    for _ in range(4):
        assert engine.step() == []  # FINAL_ONLY: nothing before the end
    assert engine.cache_info()["num_free_blocks"] < engine.cache_info()["num_blocks"]
    assert len(engine.scheduler.running) == 3
    engine.abort_request(parent.request_id)
    assert parent.is_finished and not engine.has_unfinished_requests()
    assert engine.seqs == {} and engine.parents._parents == {} and engine.parents._parent_of == {}
    assert_all_free(llm)
    out = engine.final_output(parent)  # what LLM.generate hands out for a request aborted from elsewhere
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
    assert [c.finish_reason for c in out.outputs] == ["abort"] * 3
    assert [c.token_ids for c in out.outputs] == [child.output_token_ids for child in parent.children]
    assert all(len(c.token_ids) == 4 for c in out.outputs)


def test_n_with_ngram_speculation_gives_the_tokens_without_it(llm: LLM) -> None:
    spec = embedded_llm(speculative_config=NGRAM)
    greedy = SamplingParams(n=2, temperature=0, max_tokens=12, ignore_eos=True)
    prompt = "a = [1, 2, 3]\nb = [1, 2, 3]\nc = [1, 2,"
    assert tokens(spec, prompt, greedy) == tokens(llm, prompt, greedy)
    assert spec.get_metrics()["num_accepted_tokens"] > 0
    seeded = tokens(spec, PROMPTS[0], SEEDED)
    assert seeded == [tokens(spec, PROMPTS[0], child_params(SEEDED, i))[0] for i in range(3)]
    assert_all_free(spec)
