"""The adaptive draft length ("never slower" speculation, spec_decode/draft_length.py): per request, drafts shrink
to what pays and to none when drafts keep failing, come back when the text turns predictable, and never change
a token: adaptive, fixed and no speculation give the same output, token for token."""

from pathlib import Path

import pytest

from helpers import VOCAB_SIZE
from helpers.engine import BATCH_LENGTHS, generate, random_prompts, spec_config, spec_llm
from truespec import LLM, SamplingParams
from truespec.config import DEFAULT_MIN_DRAFT_ACCEPTANCE, SpeculativeConfig
from truespec.spec_decode.draft_length import PROBE_INTERVAL_MAX, PROBE_INTERVAL_MIN, DraftLengthPolicy
from truespec.spec_decode.interface import DraftRequest, Drafts
from truespec.spec_decode.model_drafter import ModelDrafter
from truespec.worker.runner_output import ModelRunnerOutput

K = 4


def step(policy: DraftLengthPolicy, request_id: str, num_accepted: int | None) -> int:
    """One step of a request: ask for its draft length, verify that many drafts with ``num_accepted`` of them
    accepted (None: all). Returns the draft length."""
    d = policy.num_drafts(request_id)
    if d:
        policy.observe(request_id, d, d if num_accepted is None else min(num_accepted, d))
    return d


def test_a_new_request_drafts_the_full_k() -> None:
    policy = DraftLengthPolicy(K, 0.2)
    assert [policy.num_drafts(r) for r in "abc"] == [K] * 3
    assert [step(policy, "d", None) for _ in range(50)] == [K] * 50  # and keeps it while everything is accepted


def test_fixed_always_drafts_the_full_k() -> None:
    policy = DraftLengthPolicy(K, None)
    assert [step(policy, "a", 0) for _ in range(50)] == [K] * 50


def test_repeated_rejections_stop_drafting() -> None:
    policy = DraftLengthPolicy(K, 0.2)
    lengths = [step(policy, "a", 0) for _ in range(10)]
    # 4 rejections of position 1 (r_1 = 0.16 < 0.2), then none until the first probe of 1 draft
    assert lengths[:8] == [K] * 4 + [0] * (PROBE_INTERVAL_MIN - 1) + [1], lengths


def test_draft_length_settles_where_the_product_of_rates_crosses_the_threshold() -> None:
    """Positions 1 and 2 always accepted, position 3 always rejected: d settles at 2, whatever the threshold."""
    for threshold in (0.1, 0.5, 0.9):
        policy = DraftLengthPolicy(K, threshold)
        lengths = [step(policy, "a", 2) for _ in range(80)]
        tail = lengths[-2 * PROBE_INTERVAL_MAX:]
        assert set(tail) == {2, 3} and tail.count(3) == 2, lengths  # 2, probing position 3 every 16 steps


def test_probes_back_off_while_they_fail_and_drafting_returns_when_text_is_predictable() -> None:
    """An edit request: free text first (every draft rejected), then copying (every draft accepted)."""
    policy = DraftLengthPolicy(K, 0.2)
    lengths = [step(policy, "a", 0) for _ in range(200)]
    probes = [i for i, d in enumerate(lengths) if d and i > lengths.index(0)]
    assert all(lengths[i] == 1 for i in probes)  # a probe drafts d + 1
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert gaps == sorted(gaps) and gaps[-1] == PROBE_INTERVAL_MAX, gaps  # growing, capped
    assert sum(lengths[100:]) <= 100 / PROBE_INTERVAL_MAX + 1  # a failing request pays for ~1 position / 16 steps
    lengths = [step(policy, "a", None) for _ in range(PROBE_INTERVAL_MAX + 10)]
    back = lengths.index(K)  # the first good probe raises d to the full k at once
    assert back <= PROBE_INTERVAL_MAX and lengths[back:] == [K] * (len(lengths) - back), lengths


def test_requests_are_independent() -> None:
    policy = DraftLengthPolicy(K, 0.2)
    bad = []
    for _ in range(60):
        assert step(policy, "good", None) == K
        bad.append(step(policy, "bad", 0))
    assert sum(bad[20:]) <= 40 / PROBE_INTERVAL_MAX + 1 and policy.num_drafts("new") == K


def test_finished_requests_are_forgotten() -> None:
    policy = DraftLengthPolicy(K, 0.2)
    for _ in range(10):
        step(policy, "a", 0)
        step(policy, "b", 0)
    policy.forget(["a", "never-seen"])
    assert policy.num_drafts("a") == K and policy.num_drafts("b") == 0
    policy.forget(["a", "b"])
    assert not policy._stats


# ---- engine ----------------------------------------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts() -> list[dict]:
    return random_prompts(BATCH_LENGTHS, seed=21)


@pytest.fixture(scope="module")
def reference(hybrid_with_heads: dict[str, Path], prompts: list[dict]) -> list[list[int]]:
    base = LLM(str(hybrid_with_heads["target"]), dtype="float64", device="cpu", max_model_len=400)
    return generate(base, prompts, GREEDY)


@pytest.mark.parametrize("method", ["ngram", "draft_model", "mtp", "eagle"])
def test_adaptive_fixed_and_no_speculation_give_the_same_tokens(hybrid_with_heads: dict[str, Path],
                                                                tiny_models: dict[str, Path], prompts: list[dict],
                                                                reference: list[list[int]], method: str) -> None:
    """Mixed steps (prefill chunks beside verifies of 0..k drafts and catch-up-only requests): the random tiny
    drafters are mostly wrong, so adaptive requests stop drafting, probe and draft again."""
    models = {"draft": tiny_models["qwen3"], "eagle": hybrid_with_heads["eagle"]}
    metrics = {}
    for draft_length in ("adaptive", "fixed"):
        config = spec_config(method, 3, models, draft_length=draft_length)
        llm = LLM(str(hybrid_with_heads["target"]), dtype="float64", device="cpu", max_model_len=400,
                  max_num_batched_tokens=16, speculative_config=config)
        assert generate(llm, prompts, GREEDY) == reference, draft_length
        metrics[draft_length] = llm.get_metrics()
        info = llm.cache_info()
        assert info["num_free_blocks"] == info["num_blocks"]
    assert metrics["fixed"]["num_draft_skips"] == 0
    assert metrics["adaptive"]["num_draft_skips"] > 0 and metrics["adaptive"]["num_drafts"] > 0
    assert metrics["adaptive"]["num_draft_tokens"] < metrics["fixed"]["num_draft_tokens"]


class WrongThenRight:
    """Drafts the reference continuation with its first token changed (always rejected) while a request has fewer
    than ``switch`` output tokens, the exact continuation after that (always accepted). Respects ``max_drafts``."""

    catches_up = False  # keeps nothing per request (spec_decode/interface.py)

    def __init__(self, prompts: list[dict], reference: list[list[int]], switch: int) -> None:
        self.reference = {tuple(p["prompt_token_ids"]): r for p, r in zip(prompts, reference, strict=True)}
        self.switch, self.max_drafts = switch, []

    def forget(self, request_ids: list[str]) -> None:
        pass

    def propose(self, requests: list[DraftRequest], output: ModelRunnerOutput,
                finished_req_ids: list[str]) -> dict[str, Drafts]:
        drafts = {}
        for r in requests:
            if not r.is_drafting:
                continue
            self.max_drafts.append(r.max_drafts)
            ids = self.reference[tuple(r.prompt_token_ids)][len(r.output_token_ids):][:r.max_drafts]
            if ids and len(r.output_token_ids) < self.switch:
                ids[0] = (ids[0] + 1) % VOCAB_SIZE
            drafts[r.request_id] = Drafts(ids)
        return drafts


def test_always_wrong_drafts_end_up_drafted_rarely(tiny_models: dict[str, Path]) -> None:
    prompts = random_prompts(BATCH_LENGTHS[:4], seed=22)
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    base = LLM(str(tiny_models["hybrid"]), dtype="float64", device="cpu", max_model_len=400)
    ref = generate(base, prompts, params)
    metrics = {}
    for draft_length in ("adaptive", "fixed"):
        llm = LLM(str(tiny_models["hybrid"]), dtype="float64", device="cpu", max_model_len=400,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 4, "draft_length": draft_length})
        llm.llm_engine.proposer = WrongThenRight(prompts, ref, switch=1000)
        assert generate(llm, prompts, params) == ref
        metrics[draft_length] = m = llm.get_metrics()
        assert m["num_accepted_tokens"] == 0
    adaptive, fixed = metrics["adaptive"], metrics["fixed"]
    assert fixed["num_drafts"] == len(prompts) * (96 - 2)  # every verify but the last one's (1 token left)
    assert adaptive["num_drafts"] * 4 < fixed["num_drafts"], adaptive
    assert adaptive["num_draft_tokens"] * 10 < fixed["num_draft_tokens"], adaptive
    assert adaptive["num_draft_skips"] > fixed["num_drafts"] / 2


def test_drafting_returns_when_the_text_becomes_predictable(tiny_models: dict[str, Path]) -> None:
    """Like an edit request that starts copying: wrong drafts for 30 tokens, then exact ones."""
    prompts = random_prompts(BATCH_LENGTHS[:4], seed=23)
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    base = LLM(str(tiny_models["hybrid"]), dtype="float64", device="cpu", max_model_len=400)
    ref = generate(base, prompts, params)
    llm = spec_llm(tiny_models["hybrid"], 4)
    proposer = llm.llm_engine.proposer = WrongThenRight(prompts, ref, switch=30)
    assert generate(llm, prompts, params) == ref
    m = llm.get_metrics()
    assert m["num_draft_skips"] > 0
    # within one probe interval of the switch each request drafts the full k again, and accepts it all (4 of every
    # 5 tokens after that: 192 here; without coming back it would be 0)
    assert m["num_accepted_tokens"] >= len(prompts) * (96 - 30 - PROBE_INTERVAL_MAX) // 2, m
    assert max(proposer.max_drafts) == 4 and 1 in proposer.max_drafts  # probes draft d + 1


def test_model_drafter_runs_only_the_draft_steps_the_longest_request_needs(
        hybrid_with_heads: dict[str, Path], tiny_models: dict[str, Path], prompts: list[dict],
        reference: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    propose, draft_step = ModelDrafter.propose, ModelDrafter._draft_step

    def counting_propose(self: ModelDrafter, requests: list[DraftRequest], *args: object) -> dict[str, Drafts]:
        calls.append([max([r.max_drafts for r in requests if r.is_drafting], default=0), 0])
        return propose(self, requests, *args)

    def counting_draft_step(self: ModelDrafter, *args: object) -> None:
        calls[-1][1] += 1
        draft_step(self, *args)

    monkeypatch.setattr(ModelDrafter, "propose", counting_propose)
    monkeypatch.setattr(ModelDrafter, "_draft_step", counting_draft_step)
    config = spec_config("draft_model", 3, {"draft": tiny_models["qwen3"]})
    llm = LLM(str(hybrid_with_heads["target"]), dtype="float64", device="cpu", max_model_len=400,
              max_num_batched_tokens=16, speculative_config=config)
    assert generate(llm, prompts, GREEDY) == reference
    assert all(steps == max(0, longest - 1) for longest, steps in calls), calls  # the first draft: the catch-up
    assert {longest for longest, _ in calls} >= {0, 1, 3}


# ---- config ----------------------------------------------------------------------------------------------------

def test_draft_length_defaults() -> None:
    for method in ("ngram", "mtp"):
        config = SpeculativeConfig.from_dict({"method": method, "num_speculative_tokens": 2})
        assert (config.draft_length, config.min_draft_acceptance) == ("adaptive", DEFAULT_MIN_DRAFT_ACCEPTANCE[method])
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "draft_length": "fixed"})
    assert config.min_draft_acceptance is None
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2,
                                          "min_draft_acceptance": 0.5})
    assert (config.draft_length, config.min_draft_acceptance) == ("adaptive", 0.5)


@pytest.mark.parametrize("kw, message", [
    ({"draft_length": "auto"}, r"speculative_config\.draft_length must be one of \('adaptive', 'fixed'\)"),
    ({"draft_length": None}, r"speculative_config\.draft_length must be one of"),
    ({"min_draft_acceptance": 0}, r"speculative_config\.min_draft_acceptance must be a number in \(0, 1\)"),
    ({"min_draft_acceptance": 1}, r"speculative_config\.min_draft_acceptance must be a number in \(0, 1\)"),
    ({"min_draft_acceptance": -0.5}, r"speculative_config\.min_draft_acceptance must be a number"),
    ({"min_draft_acceptance": float("nan")}, r"speculative_config\.min_draft_acceptance must be a number"),
    ({"min_draft_acceptance": True}, r"speculative_config\.min_draft_acceptance must be a number"),
    ({"min_draft_acceptance": "0.2"}, r"speculative_config\.min_draft_acceptance must be a number"),
    ({"draft_length": "fixed", "min_draft_acceptance": 0.2},
     r"speculative_config\.min_draft_acceptance is not used with draft_length 'fixed'"),
])
def test_bad_draft_length_settings_name_the_key(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, **kw})
