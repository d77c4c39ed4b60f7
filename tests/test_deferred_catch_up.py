"""A model drafter's deferred catch-up (spec_decode/deferred_catch_up.py): while a request's drafting is off, its
plain decode steps skip the drafter and run as steps without speculation do (queued ahead); when it drafts again, or
``DeferredCatchUp.limit`` positions are due, the drafter catches up on all of them in one forward. The tokens are
those without speculation, and the drafts are those of catching up after every step (the drafter's cache ends up the
same), for MTP, EAGLE and a draft model, float64, queued ahead and host-planned, with preemption, aborts and nothing
leaked; a request whose drafts merely do not pay is not deferred."""

from pathlib import Path

import pytest

from helpers.engine import generate, random_prompts
from helpers.heldout import flip_every, heldout_reference
from truespec import LLM, SamplingParams
from truespec.assets import DEFAULT_DRAFT_MODEL_DIR, DEFAULT_EAGLE_DIR, DEFAULT_MODEL_DIR

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
SPEC = {"mtp": {"method": "mtp", "num_speculative_tokens": 3},
        "eagle": {"method": "eagle", "num_speculative_tokens": 3, "model": str(DEFAULT_EAGLE_DIR)},
        "draft_model": {"method": "draft_model", "num_speculative_tokens": 3, "model": str(DEFAULT_DRAFT_MODEL_DIR)}}


@pytest.fixture(scope="module")
def embedded() -> tuple[list[str], list[list[int]]]:
    """Four held-out prompts and the embedded model's greedy tokens for each, without speculation."""
    return heldout_reference(GREEDY)


def run(llm: LLM, prompts: list[str], params: list[SamplingParams] | SamplingParams,
        defer_limit: int) -> tuple[list[list[int]], dict[str, list[int]], int]:
    """Tokens, each request's accepted drafts per step, and the sum over proposer calls of the requests left behind
    (with deferred positions) after it."""
    engine = llm.llm_engine
    drafter = engine.proposer
    drafter.deferred.limit = defer_limit
    accepted: dict[str, list[int]] = {}
    engine.update_hooks.append(lambda seq, n: accepted.setdefault(seq.request_id, []).append(n))
    deferred = [0]
    propose = drafter.propose

    def counting(*args: object) -> object:
        drafts = propose(*args)
        deferred[0] += len(drafter.deferred.behind)
        return drafts

    drafter.propose = counting
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    engine.step()  # nothing to run: it reports the last finishes to the drafter
    assert not drafter.deferred.behind and not drafter.deferred.held  # nothing kept for finished requests
    info = llm.cache_info()
    assert info["num_free_blocks"] == info["num_blocks"] and info["num_free_state_slots"] == info["num_state_slots"]
    return tokens, list(accepted.values()), deferred[0]


@pytest.mark.parametrize("method, async_scheduling", [("mtp", True), ("eagle", True), ("draft_model", True),
                                                      ("mtp", False)])
def test_deferred_catch_up_gives_the_drafts_of_catching_up_every_step(embedded: tuple, method: str,
                                                                      async_scheduling: bool) -> None:
    """Drafting switched off and on every 5 steps; deferring up to 3 positions (so some catch-ups come from the
    limit, some from drafting resuming) gives the same tokens and the same accepted drafts in every step as deferring
    up to 64 and, host-planned (where the steps are the same either way), as catching up after each step; the steps
    that drafted nothing were queued ahead. (Queued ahead without deferring, the steps after drafting resumes are
    planned at other times, so their drafts are compared with the tokens only.)"""
    prompts, reference = embedded
    results = {}
    for limit in (0, 3, 64):
        llm = LLM(str(DEFAULT_MODEL_DIR), dtype="float64", device="cpu", max_model_len=2048,
                  async_scheduling=async_scheduling, speculative_config=SPEC[method] | {"governor": "auto"})
        flip_every(llm.llm_engine.governor, 5)
        results[limit] = tokens, accepted, deferred = run(llm, prompts, GREEDY, limit)
        assert tokens == reference, limit
        assert (deferred > 0) == (limit > 0), limit
        m = llm.get_metrics()
        assert m["num_accepted_tokens"] > 0 and m["num_steps_without_drafts"] > 0
        if async_scheduling and limit:
            assert llm.llm_engine.overlap.num_async_steps >= 0.3 * m["num_steps"]
    assert results[3][1] == results[64][1]
    if not async_scheduling:
        assert results[0][1] == results[64][1]


def test_disabled_steps_skip_the_drafter_then_drafting_resumes_as_requests_finish(embedded: tuple) -> None:
    """disable_by_batch_size 3 with four requests of different lengths: while three or more run nobody drafts and
    the steps are queued ahead as plain decodes; once fewer run, they draft again after catching up."""
    prompts, reference = embedded
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 40, 20, 40)]
    expected = [r[:p.max_tokens] for r, p in zip(reference, params, strict=True)]
    for limit in (0, 64):
        llm = LLM(str(DEFAULT_MODEL_DIR), dtype="float64", device="cpu", max_model_len=2048, async_scheduling=True,
                  speculative_config=SPEC["mtp"] | {"disable_by_batch_size": 3})
        tokens, accepted, deferred = run(llm, prompts, params, limit)
        assert tokens == expected
        assert (deferred >= 3 * 10) == (limit > 0)  # 3+ requests ran >= 10 steps together
        assert any(n > 0 for per_request in accepted for n in per_request)  # drafting resumed
        m = llm.get_metrics()
        if limit:  # all but the prefill steps and those after which a request finished or drafting resumed
            assert llm.llm_engine.overlap.num_async_steps >= 0.6 * m["num_steps_without_drafts"], m


def test_preemption_and_aborts_while_behind(tiny_models: dict[str, Path],
                                            hybrid_with_heads: dict[str, Path]) -> None:
    """Too few KV blocks: requests are preempted while their catch-up is deferred (their re-prefill recomputes the
    deferred positions, nothing stale is caught up later); an abort while behind leaves nothing kept."""
    target = str(hybrid_with_heads["target"])
    prompts = random_prompts([50, 8, 120, 30, 70, 12], seed=11)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reference = generate(LLM(target, dtype="float64", device="cpu", max_model_len=256), prompts, greedy)
    llm = LLM(target, dtype="float64", device="cpu", max_model_len=256, async_scheduling=True,
              speculative_config=SPEC["mtp"] | {"disable_by_batch_size": 3}, num_gpu_blocks_override=24,
              max_num_batched_tokens=32)
    tokens, _, deferred = run(llm, prompts, greedy, 64)
    assert tokens == reference and deferred > 0 and llm.llm_engine.scheduler.num_preemptions > 0

    engine = llm.llm_engine
    ids = [engine.add_request(p, greedy) for p in prompts[:4]]
    for _ in range(12):
        engine.step()
    assert engine.proposer.deferred.behind  # some are behind now
    for request_id in ids[:3]:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()  # a step that reports the last finish to the drafter (there is nothing to run)
    assert not engine.proposer.deferred.behind and not engine.proposer.deferred.held


def test_requests_whose_drafts_do_not_pay_still_catch_up_at_once(tiny_models: dict[str, Path],
                                                                 hybrid_with_heads: dict[str, Path]) -> None:
    """A random MTP head: few drafts are accepted, so the draft-length policy gives requests 0 drafts, but drafting
    is on: their catch-up is not deferred (it would hold their batch on host-planned steps: a request behind cannot
    draft on the device), and the verifies stay queued ahead."""
    target = str(hybrid_with_heads["target"])
    prompts = random_prompts([40, 12, 60, 25], seed=3)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    reference = generate(LLM(target, dtype="float64", device="cpu", max_model_len=256), prompts, greedy)
    llm = LLM(target, dtype="float64", device="cpu", max_model_len=256, async_scheduling=True,
              speculative_config=SPEC["mtp"])
    tokens, _, deferred = run(llm, prompts, greedy, 64)
    m = llm.get_metrics()
    assert tokens == reference and m["num_draft_skips"] > 0 and deferred == 0, m
    assert llm.llm_engine.overlap.num_async_steps >= 0.3 * m["num_steps"], m


def test_seeded_random_requests_draw_the_same_tokens_with_a_deferred_catch_up(embedded: tuple) -> None:
    """disable_by_batch_size gates random requests too: their catch-up is deferred while three or more run. The
    drafter's KV after catching up is the one of catching up every step and its draws come from the request's own
    stream, so seeded requests draw the same tokens with and without deferring (host-planned: the same steps)."""
    prompts, reference = embedded
    params = [GREEDY, SamplingParams(temperature=0.8, seed=7, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.9, seed=8, max_tokens=30, ignore_eos=True)]
    runs = {}
    for limit in (0, 64):
        llm = LLM(str(DEFAULT_MODEL_DIR), dtype="float64", device="cpu", max_model_len=2048,
                  speculative_config=SPEC["mtp"] | {"disable_by_batch_size": 3})
        runs[limit] = run(llm, prompts, params, limit)
    assert runs[64][0] == runs[0][0] and runs[64][1] == runs[0][1]
    assert runs[64][0][0] == reference[0]
    assert runs[64][2] > 0 and runs[0][2] == 0  # deferred with the limit, not without
