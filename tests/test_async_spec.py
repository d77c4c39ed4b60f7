"""Speculative steps queued ahead (engine/async_scheduler.py, spec_decode/device_drafts.py): a verify planned
before the previous step's accepted counts are read, its positions moved on the device and its drafts made there,
gives the tokens of the run without speculation (float64), with stops, min_tokens, max_tokens, aborts, failures
and preemption inside an accepted run, and leaks nothing."""

import contextlib
import json
import random
from pathlib import Path

import pytest
import torch

from helpers.engine import random_prompts
from truespec import LLM, SamplingParams
from truespec.assets import DEFAULT_DRAFT_MODEL_DIR, DEFAULT_EAGLE_DIR, DEFAULT_MODEL_DIR
from truespec.layers.rejection_sampler import greedy_verify
from truespec.spec_decode.device_drafts import greedy_accepted
from truespec.spec_decode.interface import DraftRequest
from truespec.spec_decode.ngram import NgramIndex
from truespec.worker.input_builder import ContextRow, build_step, shift_positions

PROMPTS = Path(__file__).resolve().parents[1] / "benchmarks" / "prompts" / "heldout.jsonl"
SPEC = {"mtp": {"method": "mtp", "num_speculative_tokens": 3},
        "eagle": {"method": "eagle", "num_speculative_tokens": 3, "model": str(DEFAULT_EAGLE_DIR)},
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                  "draft_on_device": True},
        "draft_model": {"method": "draft_model", "num_speculative_tokens": 3, "model": str(DEFAULT_DRAFT_MODEL_DIR),
                        "draft_on_device": True}}


def test_device_acceptance_equals_the_host_verify() -> None:
    """Ragged batches of 0..k drafts, each accepted up to a random point: the device's accepted counts and next
    tokens are the host's ``greedy_verify``."""
    rng = random.Random(0)
    for _ in range(200):
        k, num_reqs = rng.randint(0, 5), rng.randint(1, 6)
        input_ids, argmax, qsl, expected = [], [], [0], []
        for _ in range(num_reqs):
            d = rng.randint(0, k)
            target = [rng.randrange(50) for _ in range(d + 1)]  # the argmax of the request's 1 + d rows
            cut = rng.randint(0, d)  # drafts 0 .. cut - 1 equal the target's, then one differs (or none are left)
            drafts = target[:cut] + [(t + 1) % 50 for t in target[cut:d]]
            input_ids += [rng.randrange(50)] + drafts
            argmax += target
            qsl.append(qsl[-1] + d + 1)
            expected.append(greedy_verify(drafts, target))
        num_accepted, next_token = greedy_accepted(torch.tensor(argmax), torch.tensor(input_ids), torch.tensor(qsl), k)
        device = [argmax[q:q + a] + [t] for q, a, t in zip(qsl[:-1], num_accepted.tolist(), next_token.tolist(),
                                                           strict=True)]
        assert device == expected


@pytest.mark.parametrize("pad_to", [None, 16])
def test_moved_positions_equal_building_at_them(pad_to: int | None) -> None:
    """Shifting a built step on the device gives the positions, context lengths, state sources and KV slots of a
    step built at the moved positions; a position past the request's blocks gets slot -1; padding stays inert."""
    block_size, rng = 4, random.Random(1)
    for _ in range(50):
        rows, moved, shifts = [], [], []
        for r in range(rng.randint(1, 4)):
            blocks = rng.sample(range(40), 5)
            start, query_len, shift = rng.randint(0, 8), rng.randint(1, 4), rng.randint(0, 4)
            src = -1 if r == 0 and start == 0 else 10 * r
            rows.append(ContextRow(blocks, start, query_len, src, 10 * r, 0, query_len))
            moved.append(ContextRow(blocks, start + shift, query_len, src + shift if src >= 0 else -1, 10 * r, 0,
                                    query_len))
            shifts.append(shift)
        ids = [rng.randrange(100) for row in rows for _ in range(row.query_len)]
        positions = [row.start + t for row in rows for t in range(row.query_len)]
        inputs = build_step(rows, ids, positions, block_size, torch.device("cpu"), pad_to=pad_to, width=5)
        shift_positions(inputs, torch.tensor(shifts), len(ids), len(rows), block_size)
        expected = build_step(moved, ids, [row.start + t for row in moved for t in range(row.query_len)], block_size,
                              torch.device("cpu"), pad_to=pad_to, width=5)
        for name in ("seq_lens", "slot_mapping", "state_src", "state_dst", "query_start_loc", "block_tables"):
            assert torch.equal(getattr(inputs.ctx, name), getattr(expected.ctx, name)), name
        assert torch.equal(inputs.positions, expected.positions)
    rows = [ContextRow([3], 1, 3, 0, 0, 0, 3)]  # positions 1..3 moved by 2: 4 and 5 lie past the one block of 4
    inputs = build_step(rows, [1, 2, 3], [1, 2, 3], block_size, torch.device("cpu"), width=1)
    shift_positions(inputs, torch.tensor([2]), 3, 1, block_size)
    assert inputs.ctx.slot_mapping.tolist() == [3 * block_size + 3, -1, -1]


@pytest.fixture(scope="module")
def embedded() -> tuple[list[str], list[list[int]]]:
    """Six held-out prompts (two of each kind) and the embedded model's 32 greedy tokens for each, no speculation."""
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    prompts = [p for kind in ("edit", "completion", "chat")
               for p in [r["prompt"] for r in rows if r["kind"] == kind][:2]]
    base = LLM(str(DEFAULT_MODEL_DIR), dtype="float64", device="cpu", max_model_len=2048)
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    return prompts, [o.outputs[0].token_ids for o in base.generate(prompts, greedy, use_tqdm=False)]


def varied_params(reference: list[list[int]]) -> list[SamplingParams]:
    """A stop token midway (the request stops inside an accepted run), min_tokens, a short max_tokens."""
    return [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop_token_ids=[reference[0][13]]),
            SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, min_tokens=9),
            SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop_token_ids=[reference[3][20]]),
            SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=19, ignore_eos=True)]


def expected_tokens(reference: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    """The reference cut where each request's params stop it."""
    out = []
    for tokens, p in zip(reference, params, strict=True):
        tokens = tokens[:p.max_tokens]
        stops = [i for i, t in enumerate(tokens) if t in p.stop_token_ids and i >= p.min_tokens]
        out.append(tokens[:stops[0] + 1] if stops else tokens)
    return out


def spec_engine(method: str, async_scheduling: bool, **kwargs: object) -> LLM:
    settings = dict(dtype="float64", device="cpu", max_model_len=2048) | kwargs
    return LLM(str(DEFAULT_MODEL_DIR), speculative_config=SPEC[method], async_scheduling=async_scheduling,
               **settings)


def assert_all_free(llm: LLM) -> None:
    info = llm.cache_info()
    assert info["num_free_blocks"] == info["num_blocks"]
    assert info["num_free_state_slots"] == info["num_state_slots"]
    assert llm.llm_engine.overlap.inflight is None
    proposer = llm.llm_engine.proposer
    if hasattr(proposer, "on_device"):  # ngram: after an idle step (the last finishes reach it) it holds nothing
        llm.llm_engine.step()
        assert not proposer.on_device.rows and not proposer.indexes


@pytest.mark.parametrize("method, max_num_seqs", [("mtp", 1), ("mtp", 4), ("mtp", 6), ("eagle", 4), ("ngram", 1),
                                                 ("ngram", 6), ("draft_model", 1), ("draft_model", 4)])
def test_queued_verifies_give_the_tokens_without_speculation(embedded: tuple, method: str,
                                                             max_num_seqs: int) -> None:
    prompts, reference = embedded
    params = varied_params(reference)
    # max_num_seqs 4 (two of six wait) and MTP: prefix caching off, so a joining prompt is one chunk, drafted behind
    # on the device (on a hybrid model with prefix caching a prompt's chunks end at its state checkpoints: with the
    # draft model, its first chunk joins a queued verify and the proposer drafts on the host after it)
    llm = spec_engine(method, True, max_num_seqs=max_num_seqs, max_num_batched_tokens=256,
                      enable_prefix_caching=(method, max_num_seqs) != ("mtp", 4))
    drafter, behind_prompts = llm.llm_engine.proposer, []
    real = drafter.draft_on_device
    drafter.draft_on_device = lambda step, *args: behind_prompts.append(
        any(row.num_logits < row.query_len for row in step.rows)) or real(step, *args)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert out == expected_tokens(reference, params)
    # a model drafter drafted behind prompt chunks on the device too (each request joining, with max_num_seqs 1),
    # and with 4 running of 6, one left waiting joined a verify queued ahead (no host-planned step between; EAGLE's
    # acceptance ends these requests at steps where another refuses to be queued ahead, e.g. min_tokens due)
    assert sum(behind_prompts) >= (0 if method == "ngram" else 6 if max_num_seqs == 1 else 1)
    assert llm.llm_engine.overlap.num_admitted_ahead >= (method != "eagle" and max_num_seqs == 4)
    metrics = llm.get_metrics()
    # accepted runs, not just rejections (ngram: its drafts past a match are guesses, often rejected)
    assert metrics["num_accepted_tokens"] > (0.2 if method == "ngram" else 0.5) * metrics["num_drafts"]
    # verifies really were queued ahead (not while a request waits for room, nor after one finishes)
    assert llm.llm_engine.overlap.num_async_steps >= 0.3 * metrics["num_steps"]
    assert_all_free(llm)


@pytest.mark.parametrize("method", ["mtp", "ngram", "draft_model"])
def test_abort_and_failure_while_a_verify_is_queued(embedded: tuple, monkeypatch: pytest.MonkeyPatch,
                                                    method: str) -> None:
    """An abort, then a failing step, while a verify is queued: the others' tokens are unchanged, nothing leaks."""
    prompts, reference = embedded
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    llm = spec_engine(method, True)
    engine = llm.llm_engine
    ids = [engine.add_request(p, greedy) for p in prompts[:3]]
    seqs = [engine.seqs[i] for i in ids]
    for _ in range(4):
        engine.step()
    assert engine.overlap.inflight is not None and engine.overlap.inflight.shift is not None
    engine.abort_request(ids[1])
    for _ in range(3):  # the step after the abort is planned on the host, then they are queued again
        engine.step()
    assert engine.overlap.inflight is not None
    real = engine.runner.collect

    def fail(*args: object, **kwargs: object) -> object:
        real(*args, **kwargs)
        raise RuntimeError("injected failure")

    monkeypatch.setattr(engine.runner, "collect", fail)
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    monkeypatch.undo()
    while engine.has_unfinished_requests():
        engine.step()
    assert seqs[1].finish_reason == "abort"
    assert [seqs[0].output_token_ids, seqs[2].output_token_ids] == [reference[0], reference[2]]
    assert_all_free(llm)


@pytest.mark.parametrize("method", ["mtp", "ngram", "draft_model"])
def test_queued_verifies_under_kv_pressure_and_arrivals(tiny_models: dict[str, Path],
                                                        hybrid_with_heads: dict[str, Path], method: str) -> None:
    """A random MTP head (few accepted drafts; or ngram, or the random tiny dense draft model drafting on the device)
    on the tiny hybrid, too few KV blocks (preemption; a verify is not queued when its worst-case blocks do not fit),
    and requests arriving while verifies are queued."""
    target = str(hybrid_with_heads["target"])
    prompts = random_prompts([50, 8, 120, 30, 70, 12], seed=7)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    base = LLM(target, dtype="float64", device="cpu", max_model_len=256)
    reference = [o.outputs[0].token_ids for o in base.generate(prompts, greedy, use_tqdm=False)]
    spec = SPEC[method] | ({"model": str(tiny_models["qwen3"])} if method == "draft_model" else {})
    llm = LLM(target, dtype="float64", device="cpu", max_model_len=256, async_scheduling=True,
              speculative_config=spec, num_gpu_blocks_override=24, max_num_batched_tokens=32)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == reference
    assert llm.llm_engine.scheduler.num_preemptions > 0 and llm.llm_engine.overlap.num_async_steps > 0
    assert_all_free(llm)

    engine = llm.llm_engine
    ids, outputs, step = [engine.add_request(prompts[0], greedy)], {}, 0
    while engine.has_unfinished_requests():
        if step in (3, 5, 9, 14, 20):
            ids.append(engine.add_request(prompts[len(ids)], greedy))
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0].token_ids
        step += 1
    assert [outputs[i] for i in ids] == reference
    assert_all_free(llm)


@pytest.mark.parametrize("method", ["mtp", "eagle", "draft_model"])
def test_draft_chain_gives_the_drafts_of_the_launches(embedded: tuple, method: str) -> None:
    """The one-replay drafting of a uniform step (spec_decode/draft_chain.py), run op by op on CPU in float64:
    the tokens of the run without speculation, and it really drafted (captured, it is the same code)."""
    from truespec.spec_decode.draft_chain import DraftChain

    prompts, reference = embedded
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    llm = spec_engine(method, True, max_num_seqs=4, max_num_batched_tokens=256)
    drafter = llm.llm_engine.proposer
    width = -(-(2048 + 3 + 1) // 16)
    drafter.chain = DraftChain(drafter.head, 3, [1, 2, 4, 8], width, 16, llm.llm_engine.hf_config.hidden_size,
                               torch.device("cpu"), reads_tokens=not drafter.uses_target_hidden)
    real_run, calls = drafter.chain.run, []
    drafter.chain.run = lambda *args: calls.append(len(args[4]) - 1) or real_run(*args)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert out == reference
    assert len(calls) > 10 and max(calls) > 1  # batches of several requests went through the chain
    assert_all_free(llm)


def test_ngram_drafts_on_device_are_the_host_proposers(embedded: tuple) -> None:
    """Behind every queued ngram step, the device's copy of each request's tokens is the request's true history
    (prompt + the tokens of the run without speculation) through its new token, and its drafts start with what the
    host proposer (ngram.py) drafts from those tokens: host copies, on-device writes and moved positions agree."""
    prompts, reference = embedded
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    llm = spec_engine("ngram", True, max_num_seqs=4, max_num_batched_tokens=256)
    engine = llm.llm_engine
    on_device, spec = engine.proposer.on_device, SPEC["ngram"]
    truth = {}  # request id -> prompt + reference output
    real, checked = on_device.draft_on_device, []

    def checked_draft(step: object, num_drafts: int, seqs: dict) -> object:
        drafts = real(step, num_drafts, seqs)
        qsl = step.inputs.ctx.query_start_loc[:len(step.rows) + 1]
        lengths = (step.inputs.positions[qsl[:-1]] + drafts.num_accepted + 2).tolist()
        for r, length, ids in zip(step.sched.scheduled, lengths, drafts.next_ids.tolist(), strict=True):
            if length > len(truth[r.request_id]):  # it reached max_tokens in the step before: these rows are dropped
                continue
            tokens = truth[r.request_id][:length]
            assert on_device.history[on_device.rows[r.request_id].index, :length].tolist() == tokens
            assert ids[0] == tokens[-1]  # the next token
            request = DraftRequest(r.request_id, r.params, tokens, [], 0, 0, 0, [], 0, True, num_drafts)
            index = NgramIndex(spec["prompt_lookup_min"], spec["prompt_lookup_max"], request)
            assert index.catch_up(request)
            host = index.lookup(num_drafts)
            assert ids[1:1 + len(host)] == host
            checked.append((len(host), step.shift is not None))
        return drafts

    on_device.draft_on_device = checked_draft
    for prompt, ref in zip(prompts, reference, strict=True):
        request_id = engine.add_request(prompt, greedy)
        truth[request_id] = engine.seqs[request_id].prompt_token_ids + ref
    while engine.has_unfinished_requests():
        engine.step()
    assert len(checked) > 50 and sum(n > 0 for n, _ in checked) > 10  # many steps, many with host drafts
    assert sum(shifted for _, shifted in checked) > 20  # many of them behind a verify queued ahead
    engine.step()  # idle: the finishes of the last step are reported to the proposer
    assert not on_device.rows and len(on_device.free) == on_device.history.shape[0]  # every row back


@pytest.mark.parametrize("chain", [False, True], ids=["launches", "chain"])
def test_draft_model_drafts_on_device_are_its_greedy_continuation(embedded: tuple, chain: bool) -> None:
    """Behind every queued draft-model step (``draft_on_device``), each request's next token is the true one and its
    k drafts are what the draft model itself generates greedily from the request's history through that token (its
    catch-up fed the right tokens at the right positions, moved ones included; also behind the last prompt chunk of
    a request joining the batch): drafted by one launch per forward,
    or by the one-replay chain (spec_decode/draft_chain.py) run op by op."""
    from truespec.spec_decode.draft_chain import DraftChain

    prompts, reference = embedded
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    llm = spec_engine("draft_model", True, max_num_seqs=4, max_num_batched_tokens=256)
    engine = llm.llm_engine
    drafter, truth, checked, joined, chunks = engine.proposer, {}, [], [], []
    if chain:
        drafter.chain = DraftChain(drafter.head, 3, [1, 2, 4, 8], -(-(2048 + 3 + 1) // 16), 16, None,
                                   torch.device("cpu"), reads_tokens=True)
        real_run, runs = drafter.chain.run, []
        drafter.chain.run = lambda *args: runs.append(1) or real_run(*args)
    real = drafter.draft_on_device

    def checked_draft(step: object, num_drafts: int, seqs: dict) -> object:
        drafts = real(step, num_drafts, seqs)
        qsl = step.inputs.ctx.query_start_loc[:len(step.rows) + 1]
        prompt_rows = torch.tensor([row.query_len - row.num_logits for row in step.rows])  # a joining request's
        lengths = (step.inputs.positions[qsl[:-1]] + prompt_rows + drafts.num_accepted + 2).tolist()  # + new token
        for r, length, ids, row in zip(step.sched.scheduled, lengths, drafts.next_ids.tolist(), step.rows,
                                       strict=True):
            if not row.num_logits:  # an earlier chunk of a prompt: the drafter only caught up on it
                chunks.append(r.request_id)
                continue
            if length > len(truth[r.request_id]):  # it reached max_tokens in the step before: these rows are dropped
                continue
            tokens = truth[r.request_id][:length]
            assert ids[0] == tokens[-1]  # the next token
            if num_drafts == drafter.k and length + drafter.k <= len(truth[r.request_id]):
                checked.append((tokens, ids[1:], step.shift is not None))
        joined.append(int(prompt_rows.sum()) > 0)
        return drafts

    drafter.draft_on_device = checked_draft
    assert drafter.device_reach == drafter.k  # its catch-up's extra row: one position further than a head's k - 1
    for prompt, ref in zip(prompts, reference, strict=True):
        request_id = engine.add_request(prompt, greedy)
        truth[request_id] = engine.seqs[request_id].prompt_token_ids + ref
    while engine.has_unfinished_requests():
        engine.step()
    assert len(checked) > 30 and sum(shifted for _, _, shifted in checked) > 10  # many queued behind a verify
    assert sum(joined) >= 2  # requests joined the batch (4 running of 6): drafted behind their prompts' last chunks
    assert chunks  # and behind their earlier chunks (with prefix caching, chunks end at state checkpoints)
    assert not chain or len(runs) > 10
    alone = LLM(str(DEFAULT_DRAFT_MODEL_DIR), dtype="float64", device="cpu", max_model_len=2048)
    continued = alone.generate([{"prompt_token_ids": tokens} for tokens, _, _ in checked],
                               SamplingParams(temperature=0, max_tokens=drafter.k, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in continued] == [drafts for _, drafts, _ in checked]
    assert_all_free(llm)


def test_draft_on_device_refuses_a_draft_model_with_recurrent_state(tiny_models: dict[str, Path]) -> None:
    """Drafting on the device keeps no recurrent state per draft position: a hybrid draft model is refused, naming the
    key (without the key it drafts on the host, as before)."""
    hybrid = str(tiny_models["hybrid"])
    spec = {"method": "draft_model", "num_speculative_tokens": 2, "model": hybrid, "draft_on_device": True}
    with pytest.raises(ValueError, match="speculative_config.draft_on_device: the draft model has recurrent state"):
        LLM(hybrid, dtype="float64", device="cpu", max_model_len=256, speculative_config=spec)


def test_drafting_on_the_device_needs_blocks_for_its_reach() -> None:
    """A step planned on the host is drafted behind on the device only if its blocks hold every position the drafter
    writes past the query (``device_reach``); a step queued ahead reserved them when it was planned."""
    from types import SimpleNamespace as NS

    from truespec.engine.async_scheduler import AsyncScheduler

    overlap = object.__new__(AsyncScheduler)
    overlap.scheduler = NS(kv=NS(block_size=16))
    greedy = NS(is_greedy=True, logprobs=None)
    # 2 blocks (positions 0..31); the query is positions 25..28
    step = NS(scheduled=[NS(request_id="a", is_last_chunk=True, num_new_tokens=1, params=greedy,
                            num_computed_tokens=25, num_scheduled_tokens=4, block_ids=[7, 9], num_prompt_rows=0)])
    # a head at k = 4, or a draft model at k = 3
    overlap.drafter = NS(is_behind=lambda ids: False, device_reach=3, drafts_after_prompts=True)
    assert overlap._drafts_on_device(step, is_ahead=False)  # writes up to position 31
    overlap.drafter.device_reach = 4  # a draft model at k = 4: position 32 is past its blocks
    assert not overlap._drafts_on_device(step, is_ahead=False)
    assert overlap._drafts_on_device(step, is_ahead=True)


def test_drafting_on_the_device_behind_a_prompt_chunk() -> None:
    """Behind a request's last prompt chunk (a request joining the batch) a model drafter drafts on the device; ngram
    (``drafts_after_prompts`` False) does not, nor does any drafter behind an earlier chunk or a chunk whose prompt
    logprobs are due."""
    from types import SimpleNamespace as NS

    from truespec.engine.async_scheduler import AsyncScheduler

    overlap = object.__new__(AsyncScheduler)
    overlap.scheduler = NS(kv=NS(block_size=16))
    overlap.drafter = NS(is_behind=lambda ids: False, device_reach=3, drafts_after_prompts=True)
    greedy = NS(is_greedy=True, logprobs=None)

    def chunk(is_last_chunk: bool = True, prompt_logprobs: tuple[int, ...] = ()) -> NS:  # positions 10..19 of 2 blocks
        return NS(scheduled=[NS(request_id="a", is_last_chunk=is_last_chunk, num_new_tokens=10, params=greedy,
                                num_computed_tokens=10, num_scheduled_tokens=10, block_ids=[7, 9],
                                prompt_logprob_token_ids=list(prompt_logprobs), num_prompt_rows=10)])

    assert overlap._drafts_on_device(chunk(), is_ahead=False)
    # joined to a verify queued ahead, a prompt's blocks cover the reach only if its longest length does
    assert overlap._drafts_on_device(chunk(), is_ahead=True)
    overlap.drafter.device_reach = 13  # positions 20..32: past its 2 blocks
    assert not overlap._drafts_on_device(chunk(), is_ahead=True)
    overlap.drafter.device_reach = 3
    # an earlier chunk: drafted behind only beside a request that gets logits, its blocks one position past the reach
    assert not overlap._drafts_on_device(chunk(is_last_chunk=False), is_ahead=False)  # nothing would be drafted
    decode = NS(request_id="b", is_last_chunk=True, num_new_tokens=1, params=greedy, num_computed_tokens=40,
                num_scheduled_tokens=1, block_ids=[3, 4, 5, 6], prompt_logprob_token_ids=[], num_prompt_rows=0)
    beside = chunk(is_last_chunk=False)
    beside.scheduled.insert(0, decode)
    overlap.drafter.device_reach = 11  # its drafts up to position 31: the last of its 2 blocks
    assert overlap._drafts_on_device(beside, is_ahead=False)
    overlap.drafter.device_reach = 12
    assert not overlap._drafts_on_device(beside, is_ahead=False)
    overlap.drafter.device_reach = 3
    assert not overlap._drafts_on_device(chunk(prompt_logprobs=(5, 6)), is_ahead=False)
    overlap.drafter.drafts_after_prompts = False
    assert not overlap._drafts_on_device(chunk(), is_ahead=False)
    assert not overlap._drafts_on_device(beside, is_ahead=False)


@pytest.mark.parametrize("method", ["mtp", "draft_model"])
def test_joining_a_queued_verify_near_max_tokens(method: str) -> None:
    """Requests joining verifies queued ahead with max_tokens 1 or 2: their blocks end at their longest length, closer
    than the drafter's reach past the prompt, so nothing is drafted behind that step on the device (it drafts on the
    host): the tokens of the run without speculation, nothing leaks."""
    prompts = random_prompts([31] * 8, seed=3)  # 31 + 1 or 2 tokens: their blocks end within the drafter's reach
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (24, 1, 2, 1, 1, 2, 1, 24)]
    base = LLM(str(DEFAULT_MODEL_DIR), dtype="float64", device="cpu", max_model_len=256)
    reference = [o.outputs[0].token_ids for o in base.generate(prompts, params, use_tqdm=False)]
    llm = spec_engine(method, True, max_model_len=256, max_num_seqs=2, enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == reference
    assert llm.llm_engine.overlap.num_admitted_ahead > 0
    assert_all_free(llm)


@pytest.mark.parametrize("method", ["mtp", "eagle", "draft_model"])
def test_prompts_in_several_chunks_join_verifies_queued_ahead(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With prefix caching on a hybrid target a prompt's chunks end at its state checkpoints, so a joining prompt
    takes two steps or more. The drafter drafts behind a step with an earlier chunk on the device too (only catching
    up on that request) and the request's next chunk rides the verify queued after it: no step of the run is
    planned on the host after the first and no proposer drafts on the host; the tokens of the run without
    speculation, every block and state slot free at the end."""
    prompts = random_prompts([45, 20, 70, 33, 90, 17, 52, 64], seed=11)  # 2 to 6 chunks each (blocks of 16)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    base = LLM(str(DEFAULT_MODEL_DIR), dtype="float64", device="cpu", max_model_len=256)
    reference = [o.outputs[0].token_ids for o in base.generate(prompts, params, use_tqdm=False)]
    llm = spec_engine(method, True, max_model_len=256, max_num_seqs=3, max_num_batched_tokens=40,
                      prefix_state_interval=32)
    engine = llm.llm_engine
    host_planned, host_drafted, going_on = [], [], []
    schedule, plan_ahead, propose = engine.scheduler.schedule, engine.scheduler.schedule_verify_ahead, \
        engine.handoff.propose

    def recording(plans: list, may_admit: object = None) -> object:
        out = plan_ahead(plans, may_admit)
        if out is not None:
            going_on.extend(r.num_prompt_rows for (*_, hold), r in zip(plans, out.scheduled[:len(plans)], strict=True)
                            if hold is None)
        return out

    monkeypatch.setattr(engine.scheduler, "schedule", lambda: host_planned.append(1) or schedule())
    monkeypatch.setattr(engine.scheduler, "schedule_verify_ahead", recording)
    monkeypatch.setattr(engine.handoff, "propose", lambda sched, *a, **kw: host_drafted.append(
        [r.num_new_tokens for r in sched.scheduled]) or propose(sched, *a, **kw))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == reference
    assert len(going_on) >= 8 and all(going_on)  # chunks of prompts went on in verifies queued ahead
    # the first step (three prompts' first chunks: nothing to draft behind) and the one after it, drafted on the host
    assert len(host_planned) <= 2 and len(host_drafted) <= 1, (host_planned, host_drafted)
    assert_all_free(llm)


@pytest.mark.parametrize("method, max_tokens", [("mtp", 34), ("draft_model", 30)])
def test_a_preempted_request_re_prefills_in_steps_planned_on_the_host(method: str, max_tokens: int,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A request preempted one token before max_tokens (no drafts then) re-prefills prompt and output in chunks: its
    chunks past the prompt hold blocks only up to its longest length, so they go on in steps planned on the host,
    never in a verify queued ahead (whose drafts behind it would write past its blocks); nothing leaks."""
    px, py = random_prompts([64 - max_tokens, 20], seed=5)
    llm = spec_engine(method, True, max_model_len=256, max_num_seqs=2, max_num_batched_tokens=64,
                      prefix_state_interval=16)
    engine = llm.llm_engine
    params = [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)]
    base = LLM(str(DEFAULT_MODEL_DIR), dtype="float64", device="cpu", max_model_len=256)
    reference = [o.outputs[0].token_ids for o in base.generate([px, py], params, use_tqdm=False)]
    ids = [engine.add_request(px, params[0]), engine.add_request(py, params[1])]
    x, outputs = engine.seqs[ids[0]], {}
    launch_verify, schedule = engine.overlap._launch_verify, engine.scheduler.schedule
    done = []
    monkeypatch.setattr(engine.overlap, "_launch_verify",
                        lambda launched: False if not done and len(x.output_token_ids) >= max_tokens - 8 else
                        launch_verify(launched))

    def preempting() -> object:
        if not done and len(x.output_token_ids) == max_tokens - 1 and x in engine.scheduler.running:
            engine.scheduler.preempt(x)
            done.append(1)
        return schedule()

    monkeypatch.setattr(engine.scheduler, "schedule", preempting)
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
    assert done and [outputs[i] for i in ids] == reference
    assert_all_free(llm)


def test_a_failed_launch_of_a_verify_queued_ahead_forgets_its_checkpoint_saves() -> None:
    """A verify queued ahead carries the save of the checkpoint at the end of the prompt chunk before it (a prompt
    going on, with prefix caching); when its launch fails, that save never ran, so the checkpoint is forgotten: the
    restarted request and a later one with the same prompt give the tokens of the run without speculation."""
    py, px = random_prompts([20, 80], seed=4)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    base = LLM(str(DEFAULT_MODEL_DIR), dtype="float64", device="cpu", max_model_len=256)
    reference = [o.outputs[0].token_ids for o in base.generate([py, px, px], params, use_tqdm=False)]
    llm = spec_engine("mtp", True, max_model_len=256, max_num_seqs=3, max_num_batched_tokens=64,
                      prefix_state_interval=16)
    engine, failed, outputs = llm.llm_engine, [], {}
    real = engine.runner.launch

    def launch(sched: object, input_ids_from: object = None, shift: object = None) -> object:
        if not failed and shift is not None and sched.state_saves:
            failed.append(sched.state_saves)
            raise RuntimeError("injected")
        return real(sched, input_ids_from, shift)

    engine.runner.launch = launch
    ids = [engine.add_request(py, params)]
    engine.step()
    engine.step()
    ids.append(engine.add_request(px, params))

    def drain() -> None:
        while engine.has_unfinished_requests():
            with contextlib.suppress(RuntimeError):  # the injected failure
                outputs.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)

    drain()
    ids.append(engine.add_request(px, params))
    drain()
    assert failed
    assert [outputs[i] for i in ids] == reference


def test_long_prompts_under_a_gdn_rule_join_only_steps_planned_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a GdnPrefillRule (fla runs long prompts' GDN prefill; forced here on a CPU engine, whose float64 layers
    keep the token loop) a long prompt never joins a verify queued ahead: a moved step keeps no host copy of the
    positions and state sources fla's call plans from, so its chunk would take the token loop (verify_plan.py).
    Short prompts still join; the tokens are those of the run without speculation; nothing leaks."""
    import truespec.engine.llm_engine as llm_engine

    prompts = random_prompts([20, 90, 30, 130, 25, 70, 40, 100, 35], seed=7)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    base = LLM(str(DEFAULT_MODEL_DIR), dtype="float64", device="cpu", max_model_len=256)
    reference = [o.outputs[0].token_ids for o in base.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setattr(llm_engine, "chunked_prefill_min_len", lambda model, device: 64)  # long: 64+ tokens
    llm = spec_engine("mtp", True, max_model_len=256, max_num_seqs=3, enable_prefix_caching=False)
    scheduler = llm.llm_engine.scheduler
    assert scheduler.gdn_rule is not None and scheduler.gdn_rule.is_long(64)
    joined, plan_ahead = [], scheduler.schedule_verify_ahead

    def recording(plans: list, may_admit: object = None) -> object:
        out = plan_ahead(plans, may_admit)
        if out is not None:
            joined.extend(r.prompt_len for r in out.scheduled[len(plans):])
        return out

    monkeypatch.setattr(scheduler, "schedule_verify_ahead", recording)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == reference
    assert joined and all(n < 64 for n in joined)  # short prompts joined verifies queued ahead, long ones never
    assert_all_free(llm)


def test_prompt_blocks_are_cached_when_the_next_verify_is_queued_ahead() -> None:
    """After a prompt's last chunk the next verify is planned before the step's tokens are read: the prompt's blocks
    are cached all the same (a dense target whose draft model drafts on the device), so the same prompt with two
    more tokens hits them."""
    model = str(DEFAULT_DRAFT_MODEL_DIR)
    llm = LLM(model, dtype="float64", device="cpu", max_model_len=512, async_scheduling=True,
              speculative_config=SPEC["draft_model"] | {"model": model})
    prompt = random_prompts([100], seed=5)[0]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate([prompt], greedy, use_tqdm=False)
    assert llm.llm_engine.overlap.num_async_steps > 0  # its verifies were queued ahead
    llm.generate([{"prompt_token_ids": prompt["prompt_token_ids"] + [11, 12]}], greedy, use_tqdm=False)
    assert llm.get_metrics()["prefix_cache_hits"] >= 96  # six blocks of 16
    assert_all_free(llm)


@pytest.mark.parametrize("seed", range(6))
def test_random_batches_of_joins_and_finishes(seed: int) -> None:
    """Random prompt lengths, output lengths and stops, chunk budgets and batch limits, prefix caching on or off, MTP
    or the draft model, with async scheduling (joins and finishes inside verifies queued ahead): the tokens of the run
    without speculation, and every block and state slot free at the end."""
    rng = random.Random(seed)
    method = ("mtp", "draft_model")[seed % 2]
    prompts = random_prompts([rng.randint(3, 70) for _ in range(9)], seed=seed)
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(1, 30), ignore_eos=True,
                             stop_token_ids=[rng.randrange(1, 300)] if rng.random() < 0.3 else None)
              for _ in prompts]
    base = LLM(str(DEFAULT_MODEL_DIR), dtype="float64", device="cpu", max_model_len=256)
    reference = [o.outputs[0].token_ids for o in base.generate(prompts, params, use_tqdm=False)]
    llm = spec_engine(method, True, max_model_len=256, max_num_seqs=rng.randint(2, 4),
                      max_num_batched_tokens=rng.choice([48, 96, 256]), enable_prefix_caching=rng.random() < 0.5)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == reference
    assert llm.llm_engine.overlap.num_admitted_ahead > 0  # requests joined verifies queued ahead
    assert_all_free(llm)
