"""Device-side prompt lookup (ops/ngram_match.py, kernels/ngram_match.py): the reference drafts what the host
proposer's ``NgramIndex.lookup`` drafts, continued periodically to k tokens (the last token when nothing matches); a
step's reference writes its tokens then matches; and the Triton kernel gives exactly the reference's drafts and
history on ragged batches whose histories hold garbage past each length, in unused rows, with requests in permuted
rows and matches far behind the suffix (across block edges), whatever that garbage is."""

import random
from dataclasses import dataclass

import pytest
import torch

from helpers.kernels import DEVICE, gpu, needs_cuda
from truespec.kernels import ngram_match_ref, ngram_step, ngram_step_ref
from truespec.sampling_params import SamplingParams
from truespec.spec_decode.interface import DraftRequest
from truespec.spec_decode.ngram import NgramIndex

N_RANGES = [(1, 1), (2, 2), (1, 3), (2, 4), (3, 5)]  # (min_n, max_n)
KS = [1, 3, 8]
STEP_KS = [0, 1, 3, 8]


def repetitive_tokens(rng: random.Random, length: int, vocab: int) -> list[int]:
    """Tokens of a small vocabulary, often copying a stretch of themselves: matches everywhere."""
    tokens = [rng.randrange(vocab) for _ in range(min(length, rng.randint(1, 4)))]
    while len(tokens) < length:
        if rng.random() < 0.5:
            start = rng.randrange(len(tokens))
            tokens += tokens[start:start + rng.randint(1, 20)]
        else:
            tokens += [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
    return tokens[:length]


def far_match_tokens(rng: random.Random, length: int, max_n: int) -> list[int]:
    """Tokens of a wide vocabulary (few chance matches) ending with a copy of 1 .. max_n + 1 tokens from near the
    start: the most recent occurrence of the suffix lies far back, blocks of candidates before it."""
    tokens = [rng.randrange(1000) for _ in range(length)]
    copy_len = min(rng.randint(1, max_n + 1), length // 2)
    start = rng.randint(0, max(0, length // 8 - copy_len))
    if copy_len:
        tokens[length - copy_len:] = tokens[start:start + copy_len]
    return tokens


def random_batch(rng: random.Random, lengths: list[int], width: int, max_n: int,
                 vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]]]:
    """History [S, width] int32 (S: the requests plus two unused rows of garbage), rows (a permutation), lengths,
    and each request's tokens. Past each length the row holds random tokens of the vocabulary and beyond it."""
    history = [[rng.randrange(vocab + 3) for _ in range(width)] for _ in range(len(lengths) + 2)]
    rows = rng.sample(range(len(history)), len(lengths))
    token_lists = []
    for row, length in zip(rows, lengths, strict=True):
        is_far = rng.random() < 0.3
        tokens = far_match_tokens(rng, length, max_n) if is_far else repetitive_tokens(rng, length, vocab)
        history[row][:length] = tokens
        token_lists.append(tokens)
    return (torch.tensor(history, dtype=torch.int32), torch.tensor(rows), torch.tensor(lengths), token_lists)


def host_lookup(rng: random.Random, tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The host proposer's ``lookup(k)`` from its index over ``tokens`` (split at random into prompt and output):
    k tokens, the ones after the match repeated while fewer follow it ([] when nothing matched)."""
    cut, num_tokens = rng.randint(0, len(tokens)), len(tokens)
    request = DraftRequest(request_id="r", params=SamplingParams(), prompt_token_ids=tokens[:cut],
                           output_token_ids=tokens[cut:], step_start=max(num_tokens - 1, 0),
                           num_computed_tokens=num_tokens, row=0, block_ids=[], first_state_slot=0, is_drafting=True,
                           max_drafts=k)
    index = NgramIndex(min_n, max_n, request)
    assert index.catch_up(request)
    return index.lookup(k)


def match_period(tokens: list[int], min_n: int, max_n: int) -> int:
    """How many tokens follow the most recent earlier occurrence of the longest suffix n-gram, by a plain scan (0:
    none occurred)."""
    for n in range(max_n, min_n - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[len(tokens) - n:]:
                return len(tokens) - start - n
    return 0


def test_reference_drafts_are_the_host_proposers_continued_by_period() -> None:
    rng = random.Random(0)
    num_matched = num_unmatched = num_repeated = 0
    for _ in range(120):
        (min_n, max_n), k, vocab = rng.choice(N_RANGES), rng.choice(KS), rng.randint(2, 6)
        lengths = [rng.randint(0, 200) for _ in range(rng.randint(1, 5))] + [rng.choice([0, 1, max_n, max_n + 1])]
        history, rows, lengths_t, token_lists = random_batch(rng, lengths, 208, max_n, vocab)
        got = ngram_match_ref(history, rows, lengths_t, min_n, max_n, k)
        assert got.dtype == torch.int64 and got.shape == (len(lengths), k)
        for r, tokens in enumerate(token_lists):
            drafts, period = host_lookup(rng, tokens, min_n, max_n, k), match_period(tokens, min_n, max_n)
            assert len(drafts) == (k if period else 0)
            if period:  # the host's drafts: the tokens after the match, again and again
                assert drafts == [tokens[len(tokens) - period + j % period] for j in range(k)]
            expected = drafts if period else [tokens[-1] if tokens else 0] * k
            assert got[r].tolist() == expected, (tokens, min_n, max_n, k)
            num_matched += period > 0
            num_unmatched += period == 0
            num_repeated += 0 < period < k
    assert min(num_matched, num_unmatched, num_repeated) >= 20  # every rule was exercised, not only the easy ones


@dataclass
class Step:
    """A greedy step's arguments to ``ngram_step`` (on the CPU; ``args`` moves them) and its requests' tokens up to
    its first query position plus the verify's target tokens (``token_lists``)."""

    history: torch.Tensor  # [S, W] int32
    rows: torch.Tensor  # [R]
    positions: torch.Tensor  # [T + padding]
    query_start_loc: torch.Tensor  # [R + 1]
    argmax: torch.Tensor  # [T + padding]
    num_accepted: torch.Tensor  # [R]

    def args(self, device: torch.device) -> list[torch.Tensor]:
        return [t.to(device) for t in (self.history, self.rows, self.positions, self.query_start_loc, self.argmax,
                                       self.num_accepted)]


def random_step(rng: random.Random, starts: list[int], query_lens: list[int], max_n: int, vocab: int) -> Step:
    """Request r's first query row at position ``starts[r]``, ``query_lens[r]`` rows (its tokens through that
    position in its row, in permuted rows of a history of garbage), a random accepted count; the target's tokens
    continue the request's tokens through the next token (often repeating them: matches), garbage after it."""
    width = max(p0 + q for p0, q in zip(starts, query_lens, strict=True)) + 1 + rng.randint(0, 5)
    history = [[rng.randrange(vocab + 3) for _ in range(width)] for _ in range(len(starts) + 2)]
    rows = rng.sample(range(len(history)), len(starts))
    positions, argmax, num_accepted, query_start_loc = [], [], [], [0]
    for row, p0, query_len in zip(rows, starts, query_lens, strict=True):
        accepted = rng.randrange(query_len)
        length = p0 + accepted + 2  # through the next token
        is_far = rng.random() < 0.3
        tokens = far_match_tokens(rng, length, max_n) if is_far else repetitive_tokens(rng, length, vocab)
        history[row][:p0 + 1] = tokens[:p0 + 1]
        positions += range(p0, p0 + query_len)
        argmax += tokens[p0 + 1:] + [rng.randrange(vocab + 3) for _ in range(query_len - accepted - 1)]
        num_accepted.append(accepted)
        query_start_loc.append(query_start_loc[-1] + query_len)
    num_padding = rng.randint(0, 3)  # rows past the requests': read by nobody
    positions += [rng.randrange(10**6, 10**7) for _ in range(num_padding)]
    argmax += [rng.randrange(vocab + 3) for _ in range(num_padding)]
    return Step(torch.tensor(history, dtype=torch.int32), torch.tensor(rows), torch.tensor(positions),
                torch.tensor(query_start_loc), torch.tensor(argmax), torch.tensor(num_accepted))


def written_then_matched(step: Step, min_n: int, max_n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's result and history after it, spelled out: every query row's token written after the row's
    position, then the next token and ``ngram_match_ref``'s drafts for each request's new length."""
    history = step.history.clone()
    qsl, positions, argmax = step.query_start_loc.tolist(), step.positions.tolist(), step.argmax.tolist()
    next_tokens, lengths = [], []
    for r, (row, accepted) in enumerate(zip(step.rows.tolist(), step.num_accepted.tolist(), strict=True)):
        for t in range(qsl[r], qsl[r + 1]):
            history[row, positions[t] + 1] = argmax[t]
        next_tokens.append(argmax[qsl[r] + accepted])
        lengths.append(positions[qsl[r]] + accepted + 2)
    drafts = ngram_match_ref(history, step.rows, torch.tensor(lengths), min_n, max_n, k)
    return torch.cat([torch.tensor(next_tokens)[:, None], drafts], dim=1), history


def random_starts(rng: random.Random, num_reqs: int, longest: int) -> list[int]:
    """First query positions: 0, 1 and random ones up to ``longest``."""
    return [0, 1, *(rng.randint(0, longest) for _ in range(num_reqs - 2))]


def test_step_reference_is_the_writes_then_the_match() -> None:
    rng = random.Random(4)
    num_matched = num_accepted = num_rejected_rows = 0
    for _ in range(80):
        (min_n, max_n), k, vocab = rng.choice(N_RANGES), rng.choice(STEP_KS), rng.randint(2, 6)
        num_reqs = rng.randint(2, 7)
        step = random_step(rng, random_starts(rng, num_reqs, 150), [rng.randint(1, 9) for _ in range(num_reqs)],
                           max_n, vocab)
        expected, expected_history = written_then_matched(step, min_n, max_n, k)
        history = step.history.clone()
        got = ngram_step_ref(history, *step.args(torch.device("cpu"))[1:], min_n, max_n, k)
        assert got.dtype == torch.int64 and got.shape == (num_reqs, 1 + k)
        assert torch.equal(got, expected), (min_n, max_n, k)
        assert torch.equal(history, expected_history)
        assert not torch.equal(history, step.history)
        lengths = step.positions[step.query_start_loc[:-1]] + step.num_accepted + 2
        for row, length in zip(step.rows.tolist(), lengths.tolist(), strict=True):
            num_matched += k > 0 and match_period(history[row, :length].tolist(), min_n, max_n) > 0
        num_accepted += int((step.num_accepted > 0).sum())
        num_rejected_rows += int((step.query_start_loc.diff() - step.num_accepted - 1).sum())
    assert min(num_matched, num_accepted, num_rejected_rows) >= 50  # drafts came from matches; rows went unused


def check_step_kernel(device: torch.device, rng: random.Random, starts: list[int], query_lens: list[int], min_n: int,
                      max_n: int, k: int, vocab: int, block: int = 128) -> None:
    step = random_step(rng, starts, query_lens, max_n, vocab)
    expected_history = step.history.clone()
    expected = ngram_step_ref(expected_history, *step.args(torch.device("cpu"))[1:], min_n, max_n, k)
    args = step.args(device)
    got = ngram_step(*args, min_n, max_n, k, block=block)
    assert got.device.type == device.type
    assert torch.equal(got.cpu(), expected), (starts, query_lens, min_n, max_n, k, block)
    assert torch.equal(args[0].cpu(), expected_history), (starts, query_lens, min_n, max_n, k, block)


def test_step_kernel_matches_reference_on_ragged_batches() -> None:
    rng = random.Random(5)
    for min_n, max_n in N_RANGES:
        for k in STEP_KS:  # block 4: queries of up to 9 rows and histories up to 70 cross block edges
            num_reqs = rng.randint(3, 6)
            check_step_kernel(DEVICE, rng, random_starts(rng, num_reqs, 60), [rng.randint(1, 9) for _ in
                              range(num_reqs)], min_n, max_n, k, rng.randint(2, 6), block=4)
    # the default block, histories past it
    check_step_kernel(DEVICE, rng, [0, 126, 127, 128, 200, 250], [1, 2, 3, 9, 5, 9], 2, 4, 8, 3)


def test_step_kernel_ignores_tokens_past_each_length() -> None:
    """The same step over histories with different garbage past each request's tokens gives the same drafts."""
    rng = random.Random(2)
    step = random_step(rng, [0, 1, 3, 17, 40, 63], [1, 3, 9, 2, 5, 9], 4, 3)
    other_garbage = torch.randint(0, 6, step.history.shape, generator=torch.Generator().manual_seed(3),
                                  dtype=torch.int32)
    starts = step.positions[step.query_start_loc[:-1]]
    for row, start in zip(step.rows.tolist(), starts.tolist(), strict=True):
        other_garbage[row, :start + 1] = step.history[row, :start + 1]
    args = step.args(DEVICE)[1:]
    first = ngram_step(step.history.clone().to(DEVICE), *args, 2, 4, 8, block=16)
    assert torch.equal(first, ngram_step(other_garbage.to(DEVICE), *args, 2, 4, 8, block=16))
    assert torch.equal(first.cpu(), ngram_step_ref(step.history.clone(), *step.args(torch.device("cpu"))[1:], 2, 4,
                                                   8))


@gpu
@needs_cuda
@pytest.mark.parametrize("k", STEP_KS)
def test_step_kernel_matches_reference_on_long_histories_on_the_gpu(k: int) -> None:
    rng = random.Random(100 + k)
    device = torch.device("cuda")
    for min_n, max_n in N_RANGES:
        starts = random_starts(rng, 64, 8000) + [126, 127, 128]
        check_step_kernel(device, rng, starts, [rng.randint(1, 9) for _ in starts], min_n, max_n, k,
                          rng.randint(2, 6))
    step = random_step(rng, [8000] * 8, [9] * 8, 4, 4)
    args = step.args(device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # every per-request value is read on the device: no host sync
    try:
        ngram_step(*args, 2, 4, k)
    finally:
        torch.cuda.set_sync_debug_mode("default")
