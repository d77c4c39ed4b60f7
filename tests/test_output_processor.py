"""The output processor: streamed outputs (DELTA, CUMULATIVE) add up to what LLM.generate returns, text deltas
never split a character, a stop string never leaks out of a delta, and each request carries its timestamps."""

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from helpers.engine import random_prompts
from truespec import LLM, RequestOutputKind, SamplingParams
from truespec.core.sequence import Sequence
from truespec.engine.detokenizer import INCOMPLETE, IncrementalDetokenizer
from truespec.engine.output_processor import OutputProcessor
from truespec.engine.stop_checker import StopChecker


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


def test_a_steps_tokens_stop_where_one_by_one_checks_would(tmp_path: Path) -> None:
    """``process`` appends a step's tokens at once when ``StopChecker.can_stop`` says none can stop the request: the
    tokens, times and finish reason are those of appending and checking them one by one (EOS, stop tokens,
    ignore_eos, min_tokens, max tokens), on random cases."""
    rng = random.Random(0)
    checker = StopChecker(None, SimpleNamespace(eos_token_id=[2, 3]), str(tmp_path))
    processor = OutputProcessor(None, checker)
    for _ in range(3000):
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=rng.random() < 0.3,
                                min_tokens=rng.choice([0, 0, 3, 9]), stop_token_ids=rng.choice([[], [5], [4, 7]]))
        output = [rng.randrange(2, 12) for _ in range(rng.randrange(0, 8))]
        tokens = [rng.randrange(2, 40) for _ in range(rng.randrange(1, 10))]
        fast, slow = (Sequence("r", None, [1, 2, 3], params, rng.randrange(len(output) + 1, 20)) for _ in range(2))
        slow.max_output_len = fast.max_output_len
        for seq in (fast, slow):
            seq.output_token_ids, seq.token_times = list(output), [0.0] * len(output)
        reason = None
        for token in tokens:  # the reference: one token, one check
            slow.output_token_ids.append(token)
            slow.token_times.append(1.0)
            if (reason := checker.check(slow)) is not None:
                break
        assert processor.process(fast, tokens, None, 1.0) == reason
        assert (fast.output_token_ids, fast.token_times) == (slow.output_token_ids, slow.token_times)
