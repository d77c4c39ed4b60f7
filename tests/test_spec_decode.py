"""Speculative decoding is lossless: in float64, every configuration gives the tokens of the run
without speculation (invariants 1, 2, 4), including mixed steps where some requests verify drafts,
some have none and some are still prefilling, and under preemption."""

import random
from pathlib import Path

import pytest
import torch

from helpers.engine import BATCH_LENGTHS, OracleProposer, generate, random_prompts, set_eos_token_ids, spec_llm
from truespec import LLM, SamplingParams
from truespec.spec_decode.interface import DraftRequest, Drafts
from truespec.spec_decode.metrics import SpecDecodeMetrics
from truespec.worker.runner_output import ModelRunnerOutput

MAX_TOKENS = 24


def greedy(max_tokens: int = MAX_TOKENS, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def references(tiny_models: dict[str, Path]) -> dict[str, tuple[list[dict], list[list[int]]]]:
    prompts = random_prompts(BATCH_LENGTHS, seed=4)
    refs = {}
    for arch in ("hybrid", "qwen3"):
        llm = LLM(str(tiny_models[arch]), dtype="float64", device="cpu", max_model_len=400)
        refs[arch] = (prompts, generate(llm, prompts, greedy()))
    return refs


@pytest.mark.parametrize("arch", ["hybrid", "qwen3"])
@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("pool", ["roomy", "preempting"])
def test_mixed_batch_state_after_acceptance(tiny_models: dict[str, Path], references: dict, arch: str, k: int,
                                            pool: str) -> None:
    prompts, ref = references[arch]
    kw = {"num_gpu_blocks_override": 28, "max_num_batched_tokens": 48} if pool == "preempting" else \
        {"max_num_batched_tokens": 12}  # 1 + k fits, so a verify of every length can run beside prefill chunks
    llm = spec_llm(tiny_models[arch], k, **kw)
    oracle = OracleProposer({tuple(p["prompt_token_ids"]): r for p, r in zip(prompts, ref, strict=True)}, k, 300)
    llm.llm_engine.proposer = oracle
    assert generate(llm, prompts, greedy()) == ref
    metrics = llm.get_metrics()
    assert all(n > 0 for n in metrics["num_accepted_tokens_per_pos"]), metrics  # every prefix length accepted
    assert metrics["num_drafts"] < oracle.calls  # some steps had no drafts
    if pool == "preempting":
        assert llm.llm_engine.scheduler.num_preemptions > 0
    info = llm.cache_info()
    assert info["num_free_blocks"] == info["num_blocks"] and info["num_free_state_slots"] == info["num_state_slots"]


@pytest.mark.parametrize("arch", ["hybrid", "qwen3"])
def test_prompt_chunks_capped_beside_verifies_keep_the_tokens(tiny_models: dict[str, Path], references: dict,
                                                              arch: str) -> None:
    """long_prefill_token_threshold=5: every prompt is cut into 5-token chunks that run beside decodes and verifies
    of every length; each request's tokens are the reference's (no speculation, no cap)."""
    prompts, ref = references[arch]
    llm = spec_llm(tiny_models[arch], 3, max_num_batched_tokens=64, long_prefill_token_threshold=5)
    oracle = OracleProposer({tuple(p["prompt_token_ids"]): r for p, r in zip(prompts, ref, strict=True)}, 3, 300)
    llm.llm_engine.proposer = oracle
    assert generate(llm, prompts, greedy()) == ref
    assert llm.get_metrics()["num_accepted_tokens"] > 0


@pytest.mark.parametrize("arch", ["hybrid", "qwen3"])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_ngram_is_lossless(tiny_models: dict[str, Path], arch: str, k: int) -> None:
    g = torch.Generator().manual_seed(k)
    prompts = [{"prompt_token_ids": (torch.randint(1, 300, (max(2, n // 3),), generator=g).tolist() * 4)[:n]}
               for n in BATCH_LENGTHS]
    base = LLM(str(tiny_models[arch]), dtype="float64", device="cpu", max_model_len=400)
    llm = spec_llm(tiny_models[arch], k, max_num_batched_tokens=8)
    assert generate(llm, prompts, greedy()) == generate(base, prompts, greedy())
    assert llm.get_metrics()["num_drafts"] > 0


def oracle_all_accepted(tiny_models: dict[str, Path], references: dict) -> tuple[LLM, list[dict], list[list[int]]]:
    prompts, ref = references["hybrid"]
    llm = spec_llm(tiny_models["hybrid"], 8)

    class FullOracle(OracleProposer):
        def propose(self, requests: list[DraftRequest], output: ModelRunnerOutput,
                    finished_req_ids: list[str]) -> dict[str, Drafts]:
            return {r.request_id: Drafts(self.continuation(r)[:8]) for r in requests if r.is_drafting}

    llm.llm_engine.proposer = FullOracle({tuple(p["prompt_token_ids"]): r for p, r in zip(prompts, ref, strict=True)},
                                         8, 300)
    return llm, prompts[:4], ref[:4]


def test_max_tokens_inside_an_accepted_run(tiny_models: dict[str, Path], references: dict) -> None:
    llm, prompts, ref = oracle_all_accepted(tiny_models, references)
    for m in range(1, 12):
        assert generate(llm, prompts, greedy(max_tokens=m)) == [r[:m] for r in ref]


def test_stop_token_and_eos_inside_an_accepted_run(tiny_models: dict[str, Path], references: dict) -> None:
    llm, prompts, ref = oracle_all_accepted(tiny_models, references)
    base = LLM(str(tiny_models["hybrid"]), dtype="float64", device="cpu", max_model_len=400)
    for j in range(1, 12):
        params = [greedy(stop_token_ids=[r[j]]) for r in ref]
        assert generate(llm, prompts, params) == generate(base, prompts, params)
        ours = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        assert all(o.finish_reason == "stop" for o in ours)
    for j in range(1, 12):  # EOS: the engine's EOS set, not ignored
        for engine in (llm.llm_engine, base.llm_engine):
            set_eos_token_ids(engine, {ref[0][j]})
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        assert generate(llm, prompts[:1], params) == generate(base, prompts[:1], params)


def test_stop_string_inside_an_accepted_run(tiny_models: dict[str, Path], references: dict) -> None:
    llm, prompts, ref = oracle_all_accepted(tiny_models, references)
    base = LLM(str(tiny_models["hybrid"]), dtype="float64", device="cpu", max_model_len=400)
    tokenizer = llm.get_tokenizer()
    text = tokenizer.decode(ref[0])
    for start in range(0, min(len(text) - 2, 30), 3):
        params = greedy(stop=text[start:start + 2])
        a = llm.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0]
        b = base.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0]
        assert (a.text, a.token_ids, a.finish_reason) == (b.text, b.token_ids, b.finish_reason)


def test_seeded_random_sampling_with_speculation_is_batch_invariant(tiny_models: dict[str, Path],
                                                                    references: dict) -> None:
    prompts, _ = references["hybrid"]
    params = [SamplingParams(temperature=1.0, seed=7 + i, max_tokens=16, ignore_eos=True) for i in range(len(prompts))]
    llm = spec_llm(tiny_models["hybrid"], 3, max_num_batched_tokens=16)
    together = generate(llm, prompts, params)
    solo = [generate(llm, [p], sp)[0] for p, sp in zip(prompts, params, strict=True)]
    assert together == solo


def test_sixty_four_drafts_like_fast_apply(tiny_models: dict[str, Path], references: dict) -> None:
    """k = 64 (the fast-apply workload of vLLM #40738: k = 64 ngram drafts): long accepted runs, partial ones, none."""
    prompts, ref = references["hybrid"]
    llm = spec_llm(tiny_models["hybrid"], 64, max_num_batched_tokens=80)
    llm.llm_engine.proposer = OracleProposer({tuple(p["prompt_token_ids"]): r for p, r in zip(prompts, ref,
                                                                                             strict=True)}, 64, 300)
    assert generate(llm, prompts, greedy()) == ref
    assert max(i for i, n in enumerate(llm.get_metrics()["num_accepted_tokens_per_pos"]) if n) >= 16


def test_per_position_counts_are_those_of_each_verify() -> None:
    """SpecDecodeMetrics keeps how many verifies had each draft / accepted count; its per-position counts are what
    counting every verify's positions one by one gives."""
    rng, metrics = random.Random(0), SpecDecodeMetrics(5)
    drafted, accepted = [0] * 5, [0] * 5
    for _ in range(500):
        num_drafts = rng.randrange(0, 6)
        num_accepted = rng.randrange(0, num_drafts + 1)
        metrics.observe(num_drafts, num_accepted)
        for pos in range(num_drafts):
            drafted[pos] += 1
        for pos in range(num_accepted):
            accepted[pos] += 1
    m = metrics.as_dict()
    assert (m["num_draft_tokens_per_pos"], m["num_accepted_tokens_per_pos"]) == (drafted, accepted)
    assert m["num_draft_tokens"] == sum(drafted) and m["num_accepted_tokens"] == sum(accepted)
