"""``SamplingParams(prompt_logprobs=n)`` (vLLM's): per prompt token, None for the first, then the log-softmax of the
target's raw logits given the tokens before it, for the prompt token and the n most likely ones. In float64 they
equal transformers' own teacher-forced log-softmax, and each entry comes exactly once and unchanged whether the
prompt is prefilled in one step or in chunks, is preempted and recomputed, or runs beside speculation (invariants
1 and 5)."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.engine import BATCH_LENGTHS, random_prompts, spec_llm
from helpers.models import hf_logits
from truespec import LLM, RequestOutputKind, SamplingParams
from truespec.sampling_params import MAX_LOGPROBS

# Bounds of tests/test_model_parity.py: vs transformers computing in float64 throughout (measured here <= 1e-13
# on the log-softmax), and truespec vs itself over other batch shapes (chunking changes matmul row counts only).
UPCAST_BOUND = 1e-11
SELF_BOUND = 1e-12
NUM = 3


def prompt_logprobs(llm: LLM, prompts: list[dict], num: int = NUM, max_tokens: int = 4) -> list[list]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=num)
    return [o.prompt_logprobs for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_same(a: list[list], b: list[list], bound: float = SELF_BOUND) -> None:
    """Entry by entry: the same tokens, the same values within ``bound``."""
    assert [len(x) for x in a] == [len(x) for x in b]
    for x, y in zip(a, b, strict=True):
        assert x[0] is None and y[0] is None
        for ex, ey in zip(x[1:], y[1:], strict=True):
            assert ex.keys() == ey.keys()
            assert max(abs(ex[t] - ey[t]) for t in ex) <= bound


@pytest.fixture(scope="module")
def reference(tiny_models: dict[str, Path]) -> tuple[list[dict], list[list]]:
    """The hybrid's prompt logprobs for prompts of 1 to 300 tokens, each prompt prefilled in one step."""
    prompts = random_prompts(BATCH_LENGTHS, seed=11)
    llm = LLM(str(tiny_models["hybrid"]), dtype="float64", device="cpu", max_model_len=400)
    return prompts, prompt_logprobs(llm, prompts)


@pytest.mark.parametrize("arch", ["hybrid", "qwen3", "llama"])
def test_prompt_logprobs_equal_transformers_teacher_forcing(tiny_models: dict[str, Path], arch: str) -> None:
    prompts = random_prompts([1, 2, 9, 70], seed=12)
    ours = prompt_logprobs(LLM(str(tiny_models[arch]), dtype="float64", device="cpu"), prompts)
    hf = AutoModelForCausalLM.from_pretrained(tiny_models[arch], dtype=torch.float64).eval()
    for prompt, entries in zip(prompts, ours, strict=True):
        ids = prompt["prompt_token_ids"]
        expected = torch.log_softmax(hf_logits(hf, ids, upcast=True), dim=-1)  # row i predicts token i + 1
        assert len(entries) == len(ids) and entries[0] is None
        for i, entry in enumerate(entries[1:], start=1):
            top = torch.topk(expected[i - 1], NUM).indices.tolist()
            assert entry.keys() == set(top) | {ids[i]}
            assert all(abs(v - expected[i - 1, t].item()) <= UPCAST_BOUND for t, v in entry.items()), (i, entry)


def test_chunked_prefill_gives_the_same_prompt_logprobs(tiny_models: dict[str, Path], reference: tuple) -> None:
    """Chunks of at most 7 tokens beside other requests' chunks and decodes: each chunk's rows give their entries,
    the list is complete once the prefill is."""
    prompts, expected = reference
    llm = LLM(str(tiny_models["hybrid"]), dtype="float64", device="cpu", max_model_len=400, max_num_batched_tokens=7)
    assert_same(prompt_logprobs(llm, prompts), expected)


def test_preemption_gives_each_entry_once(tiny_models: dict[str, Path], reference: tuple) -> None:
    prompts, expected = reference
    llm = LLM(str(tiny_models["hybrid"]), dtype="float64", device="cpu", max_model_len=400,
              num_gpu_blocks_override=26, max_num_batched_tokens=64)
    assert_same(prompt_logprobs(llm, prompts), expected)
    assert llm.llm_engine.scheduler.num_preemptions > 0, "the pool was meant to be small enough to preempt"
    info = llm.cache_info()
    assert info["num_free_blocks"] == info["num_blocks"]


def test_a_prefill_preempted_midway_resumes_its_entries(tiny_models: dict[str, Path], reference: tuple) -> None:
    """Preempted after two of its chunks: the recomputed prefill adds only the entries still missing."""
    prompts, expected = reference
    llm = LLM(str(tiny_models["hybrid"]), dtype="float64", device="cpu", max_model_len=400, max_num_batched_tokens=16)
    engine, i = llm.llm_engine, BATCH_LENGTHS.index(129)
    request_id = engine.add_request(prompts[i], SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=NUM))
    seq = engine.seqs[request_id]
    engine.step()
    engine.step()
    assert len(seq.prompt_logprobs) == 1 + 32 and not seq.output_token_ids
    engine.scheduler.preempt(seq)
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert_same([outs[0].prompt_logprobs], [expected[i]])


def test_speculation_does_not_change_prompt_logprobs(tiny_models: dict[str, Path], reference: tuple) -> None:
    """ngram drafts verified beside prefill chunks, and re-prefills (with their drafts) after preemption."""
    prompts, expected = reference
    for kw in ({"max_num_batched_tokens": 12}, {"num_gpu_blocks_override": 28, "max_num_batched_tokens": 48}):
        llm = spec_llm(tiny_models["hybrid"], 3, **kw)
        assert_same(prompt_logprobs(llm, prompts, max_tokens=16), expected)
        assert llm.get_metrics()["num_drafts"] > 0


def test_async_scheduling_waits_for_prompt_logprobs(tiny_models: dict[str, Path], reference: tuple) -> None:
    prompts, expected = reference
    llm = LLM(str(tiny_models["hybrid"]), dtype="float64", device="cpu", max_model_len=400, async_scheduling=True,
              max_num_batched_tokens=64)
    assert_same(prompt_logprobs(llm, prompts), expected)
    assert llm.llm_engine.overlap.num_async_steps > 0


def test_zero_gives_the_prompt_token_alone_and_none_unless_asked(tiny_models: dict[str, Path]) -> None:
    prompts = random_prompts([1, 12], seed=13)
    llm = LLM(str(tiny_models["qwen3"]), dtype="float64", device="cpu")
    for prompt, entries in zip(prompts, prompt_logprobs(llm, prompts, num=0), strict=True):
        ids = prompt["prompt_token_ids"]
        assert entries[0] is None and [list(e) for e in entries[1:]] == [[t] for t in ids[1:]]
        assert all(v < 0 for e in entries[1:] for v in e.values())
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert all(o.prompt_logprobs is None for o in outs)


def test_streams_carry_the_whole_list_once(tiny_models: dict[str, Path], reference: tuple) -> None:
    """CUMULATIVE: every output holds the complete list; DELTA: the first output holds it, later ones [] (vLLM)."""
    prompts, expected = reference
    llm = LLM(str(tiny_models["hybrid"]), dtype="float64", device="cpu", max_model_len=400, max_num_batched_tokens=16)
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
        engine = llm.llm_engine
        request_id = engine.add_request(prompts[6], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                                                                   prompt_logprobs=NUM, output_kind=kind))
        seen = []
        while engine.has_unfinished_requests():
            seen += [o.prompt_logprobs for o in engine.step() if o.request_id == request_id]
        assert len(seen) == 3
        assert_same([seen[0]], [expected[6]])
        assert seen[1:] == ([seen[0]] * 2 if kind is RequestOutputKind.CUMULATIVE else [[], []])


@pytest.mark.parametrize("value", [-1, MAX_LOGPROBS + 1, 1.5, True, "2"])
def test_invalid_prompt_logprobs_name_the_field(value: object) -> None:
    with pytest.raises(ValueError, match="SamplingParams.prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["FULL", "FULL_DECODE_ONLY"])
def test_cuda_graphs_change_no_prompt_logprob(mode: str) -> None:
    """Prefill chunks replayed from graphs (FULL) or run eagerly beside replayed decodes, async scheduling on (the
    CUDA default): every entry bit for bit as the eager engine's (batch-invariant projections, float32)."""
    from truespec.assets import DEFAULT_MODEL_DIR

    prompts = random_prompts([1, 40, 300, 700, 1500], seed=14, vocab=2000)
    runs = []
    for kwargs in ({"enforce_eager": True}, {"compilation_config": {"cudagraph_mode": mode}}):
        llm = LLM(str(DEFAULT_MODEL_DIR), dtype="float32", device="cuda", max_model_len=2048,
                  max_num_batched_tokens=256, **kwargs)
        runs.append(prompt_logprobs(llm, prompts, max_tokens=32))
        stats = llm.llm_engine.runner.graphs.stats
        assert (stats.get("graph", 0) > 0) == ("compilation_config" in kwargs)
        del llm
        torch.cuda.empty_cache()
    assert_same(runs[1], runs[0], bound=0.0)
