"""The output processor: streamed outputs (DELTA, CUMULATIVE) add up to what LLM.generate returns, text deltas
never split a character, a stop string never leaks out of a delta, and each request carries its timestamps."""

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from helpers.engine import random_prompts
from truespec import LLM, RequestOutputKind, SamplingParams
from truespec.engine.detokenizer import INCOMPLETE, IncrementalDetokenizer


def stream(llm: LLM, prompts: list[dict], params: SamplingParams) -> dict[str, list]:
    """request id -> the outputs engine.step() handed out for it, in order."""
    engine = llm.llm_engine
    ids = [engine.add_request(p, params) for p in prompts]
    seen: dict[str, list] = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    return seen


@pytest.mark.parametrize("stop, min_tokens", [(None, 0), ("e", 0), ("e", 12), (" ", 12), ("a", 12)])
def test_deltas_add_up_to_the_final_output(tiny_models: dict[str, Path], stop: str | None, min_tokens: int) -> None:
    """With min_tokens, stop strings are not searched in the first min_tokens tokens' text, so what was streamed
    before min_tokens is never cut back."""
    llm = LLM(str(tiny_models["hybrid"]), dtype="float64", device="cpu", max_model_len=256)
    prompts = random_prompts([3, 20, 7], seed=2)
    final = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, stop=stop, min_tokens=min_tokens),
                         use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=24, stop=stop, min_tokens=min_tokens,
                            output_kind=RequestOutputKind.DELTA)
    for outs, ref in zip(stream(llm, prompts, params).values(), final, strict=True):
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert "".join(o.outputs[0].text for o in outs) == ref.outputs[0].text
        assert sum((o.outputs[0].token_ids for o in outs), []) == ref.outputs[0].token_ids
        assert outs[-1].outputs[0].finish_reason == ref.outputs[0].finish_reason
        if stop is not None and min_tokens == 0:  # never handed out, even before the step that completes it
            assert all(stop not in o.outputs[0].text for o in outs)


def test_cumulative_outputs_grow_and_end_as_generate(tiny_models: dict[str, Path]) -> None:
    llm = LLM(str(tiny_models["qwen3"]), dtype="float64", device="cpu", max_model_len=256)
    prompts = random_prompts([5, 11], seed=4)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    final = llm.generate(prompts, params, use_tqdm=False)
    for outs, ref in zip(stream(llm, prompts, params).values(), final, strict=True):
        tokens = [o.outputs[0].token_ids for o in outs]
        assert all(a == b[:len(a)] for a, b in zip(tokens, tokens[1:], strict=False))  # each extends the last
        assert tokens[-1] == ref.outputs[0].token_ids and outs[-1].outputs[0].text == ref.outputs[0].text
        m = outs[-1].metrics
        assert m.arrival_time <= m.first_token_time <= m.last_token_time <= m.finished_time
        assert len(m.token_times) == 12 and m.time_to_first_token > 0 and m.time_per_output_token >= 0


def test_incremental_detokenizer_waits_for_a_whole_character(tiny_models: dict[str, Path]) -> None:
    """A character split over byte-level tokens comes out only once its last byte is there."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["hybrid"])
    text = "aé€😀b"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text)  # some character is split over several byte tokens
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    deltas = [detok.update(ids[:n]) for n in range(1, len(ids) + 1)]
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert all(INCOMPLETE not in d for d in deltas) and "" in deltas  # it waited while a character was partial
    assert detok.finish(text) == ""
