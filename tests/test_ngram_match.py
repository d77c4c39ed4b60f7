"""Device-side prompt lookup (ops/ngram_match.py, kernels/ngram_match.py): the reference drafts what the host
proposer's ``NgramIndex.lookup`` drafts, continued periodically to k tokens (the last token when nothing matches),
and the Triton kernel drafts exactly the reference's on ragged batches whose histories hold garbage past each
length, in unused rows, with requests in permuted rows and matches far behind the suffix (across block edges)."""

import random

import pytest
import torch

from helpers.kernels import DEVICE, gpu, needs_cuda
from truespec.kernels import ngram_match, ngram_match_ref
from truespec.sampling_params import SamplingParams
from truespec.spec_decode.interface import DraftRequest
from truespec.spec_decode.ngram import NgramIndex

N_RANGES = [(1, 1), (2, 2), (1, 3), (2, 4), (3, 5)]  # (min_n, max_n)
KS = [1, 3, 8]


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


def host_lookups(rng: random.Random, tokens: list[int], min_n: int, max_n: int, k: int) -> tuple[list[int], list[int]]:
    """The host proposer's index over ``tokens`` (split at random into prompt and output): its ``lookup(k)`` and
    its ``lookup`` with no limit, all the tokens after the match (one period; [] when nothing matched)."""
    cut, num_tokens = rng.randint(0, len(tokens)), len(tokens)
    request = DraftRequest(request_id="r", params=SamplingParams(), prompt_token_ids=tokens[:cut],
                           output_token_ids=tokens[cut:], step_start=max(num_tokens - 1, 0),
                           num_computed_tokens=num_tokens, row=0, block_ids=[], first_state_slot=0, is_drafting=True,
                           max_drafts=k)
    index = NgramIndex(min_n, max_n, request)
    assert index.catch_up(request)
    return index.lookup(k), index.lookup(num_tokens)


def edge_lengths(rng: random.Random, min_n: int, max_n: int, longest: int) -> list[int]:
    """Lengths 0, 1, min_n, max_n, max_n + 1 and random ones up to ``longest``, shuffled."""
    lengths = [0, 1, min_n, max_n, max_n + 1] + [rng.randint(2, longest) for _ in range(4)]
    rng.shuffle(lengths)
    return lengths


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
            drafts, following = host_lookups(rng, tokens, min_n, max_n, k)
            period = len(following)
            if period:  # the host's drafts, then the tokens after the match again and again
                expected = drafts + [following[j % period] for j in range(len(drafts), k)]
            else:
                expected = [tokens[-1] if tokens else 0] * k
            assert got[r].tolist() == expected, (tokens, min_n, max_n, k)
            num_matched += period > 0
            num_unmatched += period == 0
            num_repeated += 0 < period < k
    assert min(num_matched, num_unmatched, num_repeated) >= 20  # every rule was exercised, not only the easy ones


def check_kernel(device: torch.device, rng: random.Random, lengths: list[int], width: int, min_n: int, max_n: int,
                 k: int, vocab: int, block: int = 128) -> None:
    history, rows, lengths_t, _ = random_batch(rng, lengths, width, max_n, vocab)
    expected = ngram_match_ref(history, rows, lengths_t, min_n, max_n, k)
    got = ngram_match(history.to(device), rows.to(device), lengths_t.to(device), min_n, max_n, k, block=block)
    assert got.device.type == device.type
    assert torch.equal(got.cpu(), expected), (lengths, min_n, max_n, k, block)


def test_kernel_matches_reference_on_ragged_batches() -> None:
    rng = random.Random(1)
    for min_n, max_n in N_RANGES:
        for k in KS:  # block 16: lengths up to 100 cross several block edges
            check_kernel(DEVICE, rng, edge_lengths(rng, min_n, max_n, 100), 104, min_n, max_n, k,
                         rng.randint(2, 6), block=16)
    # the default block, histories past it
    check_kernel(DEVICE, rng, [0, 1, 127, 128, 129, 200, 260], 264, 2, 4, 8, 3)


def test_kernel_ignores_tokens_past_each_length() -> None:
    """The same requests in histories with different garbage past each length draft the same tokens."""
    rng = random.Random(2)
    lengths, width = [0, 1, 3, 5, 17, 40, 63], 72
    history, rows, lengths_t, _ = random_batch(rng, lengths, width, 4, 3)
    other_garbage = torch.randint(0, 6, history.shape, generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    for row, length in zip(rows.tolist(), lengths, strict=True):
        other_garbage[row, :length] = history[row, :length]
    args = [rows.to(DEVICE), lengths_t.to(DEVICE), 2, 4, 8]
    first = ngram_match(history.to(DEVICE), *args, block=16)
    assert torch.equal(first, ngram_match(other_garbage.to(DEVICE), *args, block=16))
    assert torch.equal(first.cpu(), ngram_match_ref(history, rows, lengths_t, 2, 4, 8))


@gpu
@needs_cuda
@pytest.mark.parametrize("min_n, max_n", N_RANGES)
def test_kernel_matches_reference_on_long_histories_on_the_gpu(min_n: int, max_n: int) -> None:
    rng = random.Random(min_n * 10 + max_n)
    device = torch.device("cuda")
    for k in KS:
        width = 8192
        lengths = [0, 1, min_n, max_n, max_n + 1, 127, 128, 129, width] + [rng.randint(2, width) for _ in range(55)]
        check_kernel(device, rng, lengths, width, min_n, max_n, k, rng.randint(2, 6))
    history, rows, lengths_t, _ = random_batch(rng, [8000] * 8, 8192, max_n, 4)
    history, rows, lengths_t = history.to(device), rows.to(device), lengths_t.to(device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # the launch reads the lengths on the device: no host sync
    try:
        ngram_match(history, rows, lengths_t, min_n, max_n, 4)
    finally:
        torch.cuda.set_sync_debug_mode("default")
