"""Async scheduling (engine/async_scheduler.py): queueing step N+1 before step N's tokens are read
changes no output, finish reason or text, in any batch mix, and leaks nothing, also when a request stops, is
aborted or a step fails while the next one is queued."""

from pathlib import Path

import pytest

from helpers.engine import random_prompts
from truespec import LLM, SamplingParams


def make_llm(tiny_models: dict[str, Path], async_scheduling: bool, name: str = "hybrid", **kwargs: object) -> LLM:
    settings = dict(dtype="float64", device="cpu", max_model_len=256, max_num_batched_tokens=64) | kwargs
    return LLM(str(tiny_models[name]), async_scheduling=async_scheduling, **settings)


def run(llm: LLM, prompts: list[dict], params: list[SamplingParams]) -> list[tuple]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text) for o in outs]


def assert_all_free(llm: LLM) -> None:
    info = llm.cache_info()
    assert info["num_free_blocks"] == info["num_blocks"]
    assert info["num_free_state_slots"] == info["num_state_slots"]
    assert llm.llm_engine.overlap.inflight is None


def stopping_params(reference: list[list[int]], lengths: list[int]) -> list[SamplingParams]:
    """Per request: a stop token it emits midway (from the reference run), so it stops while a step is queued."""
    params = []
    for i, (tokens, n) in enumerate(zip(reference, lengths, strict=True)):
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0, max_tokens=n, stop_token_ids=[tokens[len(tokens) // 2]]))
        elif i % 3 == 1:
            params.append(SamplingParams(temperature=0, max_tokens=n, min_tokens=3, ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=n))
    return params


@pytest.mark.parametrize("name", ["hybrid", "qwen3"])
def test_async_changes_no_output_and_overlaps(tiny_models: dict[str, Path], name: str) -> None:
    prompts = random_prompts([3, 17, 40, 9, 60, 25, 5, 33], seed=3)
    lengths = [20, 7, 31, 2, 16, 24, 1, 12]
    sync = make_llm(tiny_models, False, name)
    first = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    params = stopping_params([t for t, _, _ in run(sync, prompts, first)], lengths)
    reference = run(sync, prompts, params)
    llm = make_llm(tiny_models, True, name)
    assert run(llm, prompts, params) == reference
    assert llm.llm_engine.overlap.num_async_steps > 10  # the overlap really ran
    assert any(reason == "stop" for _, reason, _ in reference)  # some stopped while a step was queued
    assert_all_free(llm)


def test_async_with_sampled_requests_kv_pressure_and_arrivals(tiny_models: dict[str, Path]) -> None:
    """Seeded sampled requests (never overlapped) beside greedy ones, too few KV blocks (preemption), and
    requests arriving while others decode: outputs as without async."""
    prompts = random_prompts([50, 8, 120, 30, 70, 12], seed=7)
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, max_tokens=16, ignore_eos=True)] * 3
    kwargs = dict(num_gpu_blocks_override=20, max_num_batched_tokens=32)  # preempts with prefix caching too
    reference = run(make_llm(tiny_models, False, **kwargs), prompts, params)
    llm = make_llm(tiny_models, True, **kwargs)
    assert run(llm, prompts, params) == reference
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert_all_free(llm)

    engine, greedy = llm.llm_engine, params[0]  # arrivals while a step is queued
    only_greedy = run(make_llm(tiny_models, False), prompts, [greedy] * 6)
    ids = [engine.add_request(prompts[0], greedy)]
    outputs: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished_requests():
        if step in (3, 5, 9, 14, 20):
            ids.append(engine.add_request(prompts[len(ids)], greedy))
        for out in engine.step():  # cumulative outputs: the last one holds every token
            outputs[out.request_id] = out.outputs[0].token_ids
        step += 1
    assert [outputs[i] for i in ids] == [t for t, _, _ in only_greedy]
    assert_all_free(llm)


def test_async_overlaps_while_requests_wait_for_a_full_batch(tiny_models: dict[str, Path]) -> None:
    """With more requests than max_num_seqs the waiting ones cannot be admitted until one finishes: steps are
    still queued ahead (a saturated server), and outputs are as without async."""
    prompts = random_prompts([7, 19, 31, 4, 12, 25, 9], seed=17)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (9, 14, 5, 20, 11, 3, 16)]
    reference = run(make_llm(tiny_models, False, max_num_seqs=3), prompts, params)
    llm = make_llm(tiny_models, True, max_num_seqs=3)
    assert run(llm, prompts, params) == reference
    assert llm.llm_engine.overlap.num_async_steps > 20
    assert_all_free(llm)


def test_abort_while_a_step_is_queued(tiny_models: dict[str, Path]) -> None:
    prompts = random_prompts([10, 30, 20], seed=11)
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    reference = run(make_llm(tiny_models, False), prompts, [greedy] * 3)
    llm = make_llm(tiny_models, True)
    engine = llm.llm_engine
    ids = [engine.add_request(p, greedy) for p in prompts]
    seqs = [engine.seqs[i] for i in ids]
    for _ in range(6):
        engine.step()
    assert engine.overlap.inflight is not None
    engine.abort_request(ids[1])
    while engine.has_unfinished_requests():
        engine.step()
    assert seqs[1].finish_reason == "abort"
    assert [seqs[0].output_token_ids, seqs[2].output_token_ids] == [reference[0][0], reference[2][0]]
    assert -1 not in seqs[1].output_token_ids
    assert_all_free(llm)


@pytest.mark.parametrize("where", ["launch", "collect"])
def test_failure_while_a_step_is_queued_changes_no_output(tiny_models: dict[str, Path], where: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that fails while the next is queued (in the queued launch, or reading the step's tokens): both
    steps' requests restart from their tokens (no placeholder left), and their output is unchanged."""
    prompts = random_prompts([12, 40], seed=13)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    reference = [t for t, _, _ in run(make_llm(tiny_models, False), prompts, [greedy] * 2)]
    llm = make_llm(tiny_models, True)
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    ids = [engine.add_request(p, greedy) for p in prompts]
    seqs = [engine.seqs[i] for i in ids]
    for _ in range(5):
        engine.step()
    assert engine.overlap.inflight is not None
    real = getattr(runner, where)

    def fail(*args: object, **kwargs: object) -> object:
        real(*args, **kwargs)  # the forward ran and wrote KV and state slots
        raise RuntimeError("injected failure")

    monkeypatch.setattr(runner, where, fail)
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    monkeypatch.undo()
    assert engine.overlap.inflight is None and all(-1 not in s.output_token_ids for s in seqs)
    while engine.has_unfinished_requests():
        engine.step()
    assert [s.output_token_ids for s in seqs] == reference
    assert_all_free(llm)


def test_async_scheduling_is_checked() -> None:
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM("unused", async_scheduling="yes")


@pytest.mark.parametrize("async_scheduling, device, proposer, expected", [
    (None, "cuda", None, (True, False)),  # the default on CUDA: decodes queued ahead
    # ngram: its non-drafting steps as decodes; its verifies queued ahead only with draft_on_device (session 17)
    (None, "cuda", "ngram", (True, False)),
    (None, "cuda", "ngram on device", (True, True)),
    # model drafters: verifies queued ahead by default (session 15), and their non-drafting steps as decodes (the
    # catch-up deferred, session 16)
    (None, "cuda", "model", (True, True)),
    (None, "cpu", "model", (False, False)),  # off by default on CPU
    (False, "cuda", "model", (False, False)),  # off when asked
    (True, "cpu", "model", (True, True)),  # on when asked, also on CPU (the float64 tests' path)
    (True, "cpu", None, (True, False)),
])
def test_which_steps_are_queued_ahead(async_scheduling: bool | None, device: str, proposer: str | None,
                                      expected: tuple[bool, bool]) -> None:
    """``queued_steps``: decodes and MTP / EAGLE / ngram verifies go ahead of the previous step's read exactly where the
    README says (async scheduling on by default on CUDA, verifies of model drafters included)."""
    from truespec.engine.async_scheduler import queued_steps
    from truespec.spec_decode.model_drafter import ModelDrafter
    from truespec.spec_decode.ngram import NgramProposer

    made = {None: None, "ngram": NgramProposer(3, 2, 2), "ngram on device": NgramProposer(3, 2, 2, True),
            "model": object.__new__(ModelDrafter)}[proposer]
    assert queued_steps(async_scheduling, device, made) == expected


def test_draft_on_device_without_async_scheduling_says_it_has_no_effect(caplog: pytest.LogCaptureFixture) -> None:
    from truespec.engine.async_scheduler import queued_steps
    from truespec.spec_decode.ngram import NgramProposer

    assert queued_steps(None, "cpu", NgramProposer(3, 2, 2, True), asked_on_device=True) == (False, False)
    assert "speculative_config.draft_on_device has no effect" in caplog.text
    caplog.clear()  # a draft model drafts on the device by default: without the key set, nothing to say
    assert queued_steps(None, "cpu", NgramProposer(3, 2, 2, True)) == (False, False)
    assert "draft_on_device" not in caplog.text


def test_a_dropped_queued_step_reports_its_finished_requests_again() -> None:
    """A queued step whose requests all stopped is dropped unread; the requests that finished before it was planned
    (reported with it) are reported with the next step, so the runner and proposer forget them (no leak)."""
    from types import SimpleNamespace

    from truespec.engine.async_scheduler import AsyncScheduler

    reported: list[str] = []
    scheduler = SimpleNamespace(report_finished=reported.extend)
    stopped = SimpleNamespace(is_finished=True)
    overlap = AsyncScheduler(scheduler, None, {"a": stopped}, enabled=True)
    step = SimpleNamespace(sched=SimpleNamespace(scheduled=[SimpleNamespace(request_id="a")],
                                                 finished_req_ids=["b", "c"]))
    overlap.inflight = step
    overlap.drop_if_finished()
    assert overlap.inflight is None and reported == ["b", "c"]
    overlap.seqs["a"] = SimpleNamespace(is_finished=False)  # still running: the step stays, nothing re-reported
    overlap.inflight = step
    overlap.drop_if_finished()
    assert overlap.inflight is step and reported == ["b", "c"]
