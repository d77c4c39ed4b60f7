"""Grammar masks (structured outputs) row by row: the packed bitmask unpacks in xgrammar's layout and an all-ones
row changes no logit bit; a verify's row j allows what the grammar allows after drafts 0..j-1, rows past a draft
the grammar rejects are unconstrained, and the matcher is left as it was; EOS is allowed exactly where the grammar
may end; a draft the grammar forbids is never accepted, greedy or random."""

import logging

import pytest
import torch
from transformers import AutoTokenizer

from truespec.assets import DEFAULT_MODEL_DIR
from truespec.core.scheduler_output import ScheduledRequest
from truespec.layers.rejection_sampler import emitted_tokens, greedy_verify, rejection_sample_draws
from truespec.layers.token_bitmask import allowed_tokens, apply_token_bitmask_
from truespec.sampling_params import SamplingParams, StructuredOutputsParams
from truespec.structured_output.manager import StructuredOutputManager

VOCAB = 2048  # the embedded model's
EOS = {0, 2}  # its config's eos_token_id list: <|endoftext|>, <|im_end|>
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
PARAMS = SamplingParams(temperature=0, structured_outputs=StructuredOutputsParams(json=SCHEMA,
                                                                                  disable_any_whitespace=True))


@pytest.fixture(scope="module")
def tokenizer() -> AutoTokenizer:
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)


def manager_with(tokenizer: AutoTokenizer, *request_ids: str) -> StructuredOutputManager:
    manager = StructuredOutputManager(tokenizer, VOCAB, EOS)
    for request_id in request_ids:
        manager.check(PARAMS)
        manager.add(request_id, PARAMS)
    return manager


def scheduled(request_id: str, drafts: list[int], is_last_chunk: bool = True) -> ScheduledRequest:
    return ScheduledRequest(request_id, PARAMS, 4, 1 + len(drafts), [7] + drafts, drafts, None, [0], 0, 0, 0,
                            is_last_chunk, 4)


def allowed(mask: torch.Tensor, row: int) -> set[int]:
    return set(torch.nonzero(allowed_tokens(mask[row:row + 1], VOCAB)[0]).flatten().tolist())


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 320, 2048, 2050])
def test_bitmask_unpacks_in_xgrammar_layout_and_all_ones_changes_nothing(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    words = -(-vocab // 32)
    mask = torch.randint(-2**31, 2**31 - 1, (3, words), dtype=torch.int32, generator=g)
    expected = torch.tensor([[bool((int(mask[r, t // 32]) >> (t % 32)) & 1) for t in range(vocab)] for r in range(3)])
    assert torch.equal(allowed_tokens(mask, vocab), expected)
    for dtype in (torch.float32, torch.float64):
        logits = torch.randn(3, vocab, dtype=dtype, generator=g)
        masked = logits.clone()
        apply_token_bitmask_(masked, mask)
        assert torch.equal(masked, torch.where(expected, logits, float("-inf")))
        unchanged = logits.clone()
        apply_token_bitmask_(unchanged, torch.full((3, words), -1, dtype=torch.int32))
        assert torch.equal(unchanged, logits)


def test_verify_rows_follow_the_drafts_and_stop_at_a_rejected_one(tokenizer: AutoTokenizer) -> None:
    manager = manager_with(tokenizer, "c", "d")
    ids = tokenizer.encode('{"a": 12}')
    bad = tokenizer.encode("x")[0]  # no JSON object goes on with a bare letter here
    steps = [scheduled("free", [ids[0]]), scheduled("c", ids[:2] + [bad, ids[2]]),
             scheduled("d", [], is_last_chunk=False), scheduled("d2", [])]
    assert manager.bitmask([steps[0], steps[2], steps[3]]) is None  # no constrained row: the runner fills ones
    mask = manager.bitmask(steps)
    assert mask.shape == (2 + 5 + 0 + 1, 64) and mask.dtype == torch.int32
    fresh = manager_with(tokenizer, "ref")
    expected = []
    for j in range(3):  # rows after drafts[:0], [:1], [:2]
        expected.append(allowed(fresh.bitmask([scheduled("ref", [])]), 0))
        fresh.accept("ref", ids[j:j + 1])
    everything = set(range(VOCAB))
    assert [allowed(mask, r) for r in range(8)] == [everything, everything, *expected, everything, everything,
                                                    everything]
    assert bad not in expected[2] and ids[2] in expected[2]
    assert torch.equal(manager.bitmask([scheduled("c", [])]), mask[2:3])  # the drafts were rolled back


def test_eos_is_allowed_only_where_the_grammar_may_end(tokenizer: AutoTokenizer) -> None:
    manager = manager_with(tokenizer, "r")
    ids = tokenizer.encode('{"a": 12}')
    for i, token in enumerate(ids):
        row = allowed(manager.bitmask([scheduled("r", [])]), 0)
        assert not EOS & row and token in row, i
        manager.accept("r", [token])
    assert allowed(manager.bitmask([scheduled("r", [])]), 0) == EOS  # the object is complete: only EOS
    manager.accept("r", [2, 5, 6])  # EOS ends the grammar; what follows (ignore_eos) is not constrained
    assert manager.bitmask([scheduled("r", [])]) is not None
    assert allowed(manager.bitmask([scheduled("r", [])]), 0) == set(range(VOCAB))


def test_a_token_the_grammar_refuses_drops_the_constraint(tokenizer: AutoTokenizer,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    manager = manager_with(tokenizer, "r")
    with caplog.at_level(logging.WARNING, logger="truespec"):
        manager.accept("r", tokenizer.encode("x"))
    assert not manager.is_constrained("r") and "does not allow" in caplog.text


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_a_draft_the_grammar_forbids_is_never_accepted(with_draft_probs: bool) -> None:
    """The draft is the unmasked argmax and, for the draft model's q, its most likely token: masked out, greedy
    rejects it and the random verify's accept flag is 0 for every seed; the token emitted instead is allowed."""
    g = torch.Generator().manual_seed(0)
    vocab, draft = 64, 9
    logits = torch.randn(2, vocab, dtype=torch.float64, generator=g)
    logits[:, draft] = 10.0
    mask = torch.full((2, 2), -1, dtype=torch.int32)
    mask[0, 0] = ~(1 << draft)  # row 0 forbids the draft; row 1 (after it) is unconstrained
    apply_token_bitmask_(logits, mask)
    assert greedy_verify([draft], logits.argmax(dim=-1).tolist())[0] != draft
    q = torch.softmax(torch.randn(1, vocab, dtype=torch.float64, generator=g) + 5 * torch.eye(vocab)[draft], -1)
    for seed in range(200):
        params = SamplingParams(temperature=1.0, seed=seed)
        draws = rejection_sample_draws(logits, [draft], q if with_draft_probs else None, params,
                                       torch.Generator().manual_seed(seed)).tolist()
        assert draws[0] == 0
        (token,) = emitted_tokens([draft], draws)
        assert token != draft and bool(allowed_tokens(mask[:1], vocab)[0, token])
