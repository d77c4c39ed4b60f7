"""The incremental n-gram index drafts exactly what a full backward scan of the history drafts, whatever the
chunks the tokens arrive in, the steps a request skips, the prompt / output split, the hash collisions; and a
finished request leaves nothing behind."""

import random

import pytest

from truespec.sampling_params import SamplingParams
from truespec.spec_decode import ngram
from truespec.spec_decode.interface import DraftRequest
from truespec.spec_decode.ngram import NgramProposer

# (k, min_n, max_n, max_drafts): min_n == max_n, min_n == 1, max_drafts 0 and 1, max_drafts above k
COMBOS = [(4, 1, 3, 4), (3, 2, 2, 3), (8, 1, 1, 8), (5, 5, 5, 5), (2, 1, 6, 1), (4, 2, 4, 0), (3, 3, 8, 9)]


def reference_lookup(token_ids: list[int], k: int, min_n: int, max_n: int, max_drafts: int) -> list[int]:
    """The O(len) scan the index replaces (NgramProposer.lookup before the index): for n from max_n down to
    min_n, the tokens after the last occurrence of the suffix n-gram that starts before ``len - n``, repeated while
    fewer than the limit follow it (they run to the end: the text repeats with that period)."""
    limit = min(k, max_drafts)
    if limit <= 0:
        return []
    n_tokens = len(token_ids)
    for n in range(min(max_n, n_tokens - 1), min_n - 1, -1):
        suffix = token_ids[n_tokens - n:]
        for start in range(n_tokens - n - 1, -1, -1):
            if token_ids[start] == suffix[0] and token_ids[start:start + n] == suffix:
                follow = token_ids[start + n:]
                return [follow[j % len(follow)] for j in range(limit)]
    return []


def draft_request(request_id: str, prompt: list[int], output: list[int], max_drafts: int,
                  is_drafting: bool = True) -> DraftRequest:
    """A request as the engine hands it over: its own (growing) lists, not copies."""
    num_tokens = len(prompt) + len(output)
    return DraftRequest(request_id, SamplingParams(), prompt, output, num_tokens - 1, num_tokens, 0, [], 0,
                        is_drafting, max_drafts if is_drafting else 0)


def repetitive_tokens(rng: random.Random, length: int) -> list[int]:
    """Tokens from a small vocabulary, often copying a stretch of themselves (what prompt lookup feeds on)."""
    vocab = rng.randint(3, 20)
    tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
    while len(tokens) < length:
        if rng.random() < 0.5:
            start = rng.randrange(len(tokens))
            tokens += tokens[start:start + rng.randint(1, 30)]
        else:
            tokens += [rng.randrange(vocab) for _ in range(rng.randint(1, 8))]
    return tokens[:length]


def grow_and_compare(proposer: NgramProposer, rng: random.Random, tokens: list[int], prompt_len: int,
                     max_drafts: int, request_id: str = "r") -> int:
    """Feed ``tokens[prompt_len:]`` to the request 1..10 at a time, skipping some steps (not drafting); at every
    drafting step the drafts equal the reference scan's. The number of drafting steps."""
    prompt, output = tokens[:prompt_len], []
    num_checked = 0
    while True:
        num_tokens = len(prompt) + len(output)
        is_drafting = rng.random() < 0.7
        r = draft_request(request_id, prompt, output, max_drafts, is_drafting)
        drafts = proposer.propose([r], None, [])
        if is_drafting:
            want = reference_lookup(tokens[:num_tokens], proposer.k, proposer.min_n, proposer.max_n, max_drafts)
            assert drafts[request_id].token_ids == want, (num_tokens, prompt_len)
            num_checked += 1
        else:
            assert request_id not in drafts
        if num_tokens == len(tokens):
            return num_checked
        output += tokens[num_tokens:num_tokens + rng.randint(1, 10)]


@pytest.mark.parametrize(("k", "min_n", "max_n", "max_drafts"), COMBOS)
def test_incremental_drafts_equal_full_scan(k: int, min_n: int, max_n: int, max_drafts: int) -> None:
    rng = random.Random(f"{k}-{min_n}-{max_n}-{max_drafts}")
    for _ in range(6):
        tokens = repetitive_tokens(rng, rng.randint(1, 2000))
        proposer = NgramProposer(k, min_n, max_n)
        assert grow_and_compare(proposer, rng, tokens, rng.randint(1, len(tokens)), max_drafts) > 0


def test_drafts_per_step_max_drafts_equal_full_scan() -> None:
    """max_drafts changes every step (the draft-length policy): each step's drafts are cut to it."""
    rng, proposer = random.Random(1), NgramProposer(6, 1, 4)
    tokens = repetitive_tokens(rng, 800)
    prompt, output = tokens[:1], []
    for num_tokens in range(1, len(tokens) + 1):
        output[:] = tokens[1:num_tokens]  # in place: the same list object, as in the engine
        max_drafts = rng.randint(0, 8)
        drafts = proposer.propose([draft_request("r", prompt, output, max_drafts)], None, [])
        assert drafts["r"].token_ids == reference_lookup(tokens[:num_tokens], 6, 1, 4, max_drafts)


@pytest.mark.parametrize(("k", "min_n", "max_n", "max_drafts"), [(4, 1, 3, 4), (3, 2, 5, 3)])
def test_prompt_output_split_does_not_change_drafts(k: int, min_n: int, max_n: int, max_drafts: int) -> None:
    rng = random.Random(2)
    tokens = repetitive_tokens(rng, 120)
    for prompt_len in range(1, len(tokens) + 1):
        grow_and_compare(NgramProposer(k, min_n, max_n), rng, tokens, prompt_len, max_drafts)
        whole = NgramProposer(k, min_n, max_n)  # the whole output in one step
        r = draft_request("r", tokens[:prompt_len], tokens[prompt_len:], max_drafts)
        assert whole.propose([r], None, [])["r"].token_ids == reference_lookup(tokens, k, min_n, max_n, max_drafts)


def test_hash_collisions_do_not_change_drafts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every n-gram in one bucket: the chains' token comparison alone picks the occurrence."""
    monkeypatch.setattr(ngram, "hash", lambda key: 7, raising=False)
    rng = random.Random(3)
    for k, min_n, max_n, max_drafts in COMBOS:
        tokens = repetitive_tokens(rng, 400)
        grow_and_compare(NgramProposer(k, min_n, max_n), rng, tokens, rng.randint(1, 50), max_drafts)


def test_batch_of_requests_each_drafts_from_its_own_tokens() -> None:
    rng, proposer = random.Random(4), NgramProposer(4, 1, 3)
    streams = {f"r{i}": repetitive_tokens(rng, 300) for i in range(8)}
    prompts = {rid: tokens[:20] for rid, tokens in streams.items()}
    outputs: dict[str, list[int]] = {rid: [] for rid in streams}
    for step in range(40):
        requests = [draft_request(rid, prompts[rid], outputs[rid], 4, (step + i) % 3 != 0)
                    for i, rid in enumerate(streams)]
        drafts = proposer.propose(requests, None, [])
        for r in requests:
            if r.is_drafting:
                want = reference_lookup(streams[r.request_id][:r.num_tokens], 4, 1, 3, 4)
                assert drafts[r.request_id].token_ids == want
            outputs[r.request_id] += streams[r.request_id][r.num_tokens:r.num_tokens + rng.randint(1, 4)]


def test_finished_requests_are_forgotten() -> None:
    rng, proposer = random.Random(5), NgramProposer(4, 1, 3)
    tokens = {f"r{i}": repetitive_tokens(rng, 200) for i in range(5)}
    requests = [draft_request(rid, t[:150], t[150:], 4) for rid, t in tokens.items()]
    proposer.propose(requests, None, [])
    assert len(proposer.indexes) == 5
    proposer.propose([], None, ["r0", "r1"])
    assert sorted(proposer.indexes) == ["r2", "r3", "r4"]
    proposer.propose([], None, ["r2", "r3", "r4", "r2", "r9"])  # repeated and unknown ids: no error
    assert len(proposer.indexes) == 0


def test_not_drafting_requests_are_not_indexed() -> None:
    proposer = NgramProposer(4, 1, 3)
    assert proposer.propose([draft_request("r", [1, 2, 1, 2], [], 4, is_drafting=False)], None, []) == {}
    assert len(proposer.indexes) == 0


def test_reused_request_id_drafts_from_the_new_request() -> None:
    """A new request under a finished one's id: its own index, whether or not the old one was reported finished
    first, and even when the new tokens are longer and agree with the old at the last indexed position."""
    rng = random.Random(6)
    new = repetitive_tokens(rng, 300)
    old = [t + 1 for t in new[:100]]
    old[-1] = new[99]
    for finished in ([], ["r"]):
        for length in (2, 101, 102, 103, 105, 110, 300):  # fewer tokens than indexed, and more
            proposer = NgramProposer(4, 1, 3)
            proposer.propose([draft_request("r", old[:10], old[10:], 4)], None, [])
            drafts = proposer.propose([draft_request("r", new[:1], new[1:length], 4)], None, finished)
            assert drafts["r"].token_ids == reference_lookup(new[:length], 4, 1, 3, 4)


def test_changed_or_shortened_tokens_rebuild_the_index() -> None:
    """The engine only appends; were a token replaced or removed, the index rebuilds rather than draft stale."""
    rng, proposer = random.Random(7), NgramProposer(4, 1, 3)
    tokens = repetitive_tokens(rng, 300)
    prompt, output = tokens[:100], tokens[100:]
    proposer.propose([draft_request("r", prompt, output, 4)], None, [])
    output[-1] = 99  # same length, new last token
    assert proposer.propose([draft_request("r", prompt, output, 4)], None, [])["r"].token_ids == \
        reference_lookup(prompt + output, 4, 1, 3, 4)
    del output[-50:]
    assert proposer.propose([draft_request("r", prompt, output, 4)], None, [])["r"].token_ids == \
        reference_lookup(prompt + output, 4, 1, 3, 4)
