"""The rejection sampler is lossless: whatever the drafter proposes, the tokens a verify emits are
distributed exactly as the target's own sampling would give (Leviathan et al. 2023, Theorem 1).

The target here is a model whose row i (the distribution after the input token and drafts x_1..x_i)
does not depend on the drafts, so its own sampling gives position i a token from p_i, independently:
the first 1 + d tokens are distributed as p_0 x p_1 x ... x p_d. One verify emits the first a + 1 of
them (a accepted drafts, then a correction or bonus token); the next steps would sample the rest
from the target, so the test completes each draw with independent samples of p_{a+1}, ..., p_d and
checks, with chi-square tests on seeded draws, the marginal of the first token, the joint of the
first two, and the joint of all 1 + d (which covers the second token given an accepted first draft).
Each check runs on the per-row reference ``rejection_sample`` and on the engine's device sampler
(``rejection_sample_draws`` + ``emitted_tokens``).
"""

import itertools
from collections.abc import Callable

import pytest
import torch

from truespec.layers.rejection_sampler import emitted_tokens, rejection_sample, rejection_sample_draws
from truespec.layers.sampler import probabilities
from truespec.sampling_params import SamplingParams

torch.set_num_threads(1)

V, D, N = 6, 2, 20_000  # vocabulary, drafts per verify, draws per case
ALPHA = 1e-3  # a lossless sampler fails one check in 1000 (the seeds are fixed: the outcome is too)


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P(chi2 >= statistic) of observed ``counts`` against cell probabilities ``probs`` (same shape).

    Cells of probability 0 must be empty (checked by the caller); cells expecting < 5 draws are pooled
    (the chi-square approximation needs it). The p-value is the regularized upper incomplete gamma
    Q(df / 2, stat / 2) (scipy.stats.chi2.sf without scipy)."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    keep = probs > 0
    counts, expected = counts[keep], probs[keep] / probs[keep].sum() * counts.sum()
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum().view(1)])
        expected = torch.cat([expected[~small], expected[small].sum().view(1)])
    stat = ((counts - expected) ** 2 / expected).sum()
    df = torch.tensor((len(counts) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, stat / 2))


def device_sample(logits: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None,
                  params: SamplingParams, g: torch.Generator) -> list[int]:
    """The engine's path: every draw on the device, then the host reads them once."""
    return emitted_tokens(drafts, rejection_sample_draws(logits, drafts, draft_probs, params, g).tolist())


SAMPLERS = {"reference": rejection_sample, "device": device_sample}
Sampler = Callable[..., list[int]]


def draws(logits: torch.Tensor, params: SamplingParams, draft_probs: torch.Tensor | None,
          fixed_drafts: list[int] | None, seed: int, sampler: Sampler = rejection_sample) -> torch.Tensor:
    """[N, 1 + D] token sequences: each verify's emitted tokens, completed from the target's rows."""
    g = torch.Generator().manual_seed(seed)
    target = torch.stack([probabilities(row, params) for row in logits])  # [1 + D, V]
    if fixed_drafts is None:  # a drafter that samples: x_i ~ q_i
        drafts = torch.multinomial(draft_probs, N, replacement=True, generator=g).T.tolist()
    else:  # ngram: the same one-hot proposal every time
        drafts = [fixed_drafts] * N
    seqs = torch.multinomial(target, N, replacement=True, generator=g).T.clone()  # the later steps' samples
    for i in range(N):
        tokens = sampler(logits, drafts[i], draft_probs, params, g)
        seqs[i, :len(tokens)] = torch.tensor(tokens)
    return seqs


def assert_distributed_as_target(seqs: torch.Tensor, target: torch.Tensor) -> None:
    """Marginal of token 0, joint of tokens 0-1, joint of tokens 0..D against the product of the rows."""
    for n in (1, 2, 1 + D):
        index = torch.zeros(len(seqs), dtype=torch.int64)
        probs = torch.ones(())
        for pos in range(n):
            index = index * V + seqs[:, pos]
            probs = torch.outer(probs.flatten(), target[pos]).flatten()
        counts = torch.bincount(index, minlength=V ** n).double()
        assert counts[probs == 0].sum() == 0, f"tokens 0..{n - 1}: emitted a sequence the target never samples"
        p_value = chi_square_p_value(counts, probs)
        assert p_value > ALPHA, f"tokens 0..{n - 1}: chi-square p-value {p_value:.2e}"


def case_logits(seed: int, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1 + D, V, generator=g, dtype=torch.float64) * scale  # [1 + D, V]


def drafter_probs(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(D, V, generator=g, dtype=torch.float64) * 1.5, dim=-1)  # [D, V], q != p


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_drafter_distribution_random_sampling(sampler: str) -> None:
    logits, params, q = case_logits(0, 1.0), SamplingParams(temperature=1.0), drafter_probs(1)
    target = torch.stack([probabilities(row, params) for row in logits])
    assert_distributed_as_target(draws(logits, params, q, None, seed=2, sampler=SAMPLERS[sampler]), target)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_ngram_one_hot_drafts_random_sampling(sampler: str) -> None:
    logits, params = case_logits(3, 1.0), SamplingParams(temperature=1.0)
    target = torch.stack([probabilities(row, params) for row in logits])
    drafts = [int(torch.argsort(target[i])[-2]) for i in range(D)]  # the second most likely: often rejected
    assert_distributed_as_target(draws(logits, params, None, drafts, seed=4, sampler=SAMPLERS[sampler]), target)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_drafter_distribution_with_temperature_and_top_p(sampler: str) -> None:
    logits, params, q = case_logits(5, 1.5), SamplingParams(temperature=0.7, top_p=0.9), drafter_probs(6)
    target = torch.stack([probabilities(row, params) for row in logits])
    assert (target == 0).any(dim=-1).all()  # top-p cuts tokens in every row
    assert (q[target[:D] == 0] > 0.01).any()  # the drafter proposes tokens the target can never emit
    assert_distributed_as_target(draws(logits, params, q, None, seed=7, sampler=SAMPLERS[sampler]), target)


@pytest.mark.parametrize("drafter", ["sampled", "ngram"])
def test_device_sampler_with_top_k_and_min_p(drafter: str) -> None:
    params = SamplingParams(temperature=0.8, top_k=4, min_p=0.05)
    logits = case_logits(10, 2.0)
    target = torch.stack([probabilities(row, params) for row in logits])
    assert (target == 0).any(dim=-1).all()  # top-k cuts tokens in every row
    q = drafter_probs(11) if drafter == "sampled" else None
    drafts = None if q is not None else [int(torch.argsort(target[i])[-2]) for i in range(D)]
    assert_distributed_as_target(draws(logits, params, q, drafts, seed=12, sampler=device_sample), target)


@pytest.mark.parametrize("drafter", ["sampled", "ngram"])
def test_device_sampler_accepts_at_the_theoretical_rate(drafter: str) -> None:
    """P(draft i accepted | drafts before it accepted) = sum_x min(p_i(x), q_i(x)) for x_i ~ q_i (Leviathan et al.,
    Theorem 3.5), = p_i(x_i) for a one-hot draft; the rows don't depend on the drafts, so the count of leading
    accepts is a product of these. Checked per position within 4 standard errors of the binomial."""
    params = SamplingParams(temperature=1.0, top_p=0.95)
    logits = case_logits(13, 1.0)
    target = torch.stack([probabilities(row, params) for row in logits])
    q = drafter_probs(14) if drafter == "sampled" else None
    if q is None:
        fixed = [int(torch.argsort(target[i])[-2]) for i in range(D)]
        rates = [float(target[i, fixed[i]]) for i in range(D)]
    else:
        rates = [float(torch.minimum(target[i], q[i]).sum()) for i in range(D)]
    g = torch.Generator().manual_seed(15)
    trials = 10_000
    drafts = [fixed] * trials if q is None else torch.multinomial(q, trials, replacement=True, generator=g).T.tolist()
    accepted = torch.tensor([len(device_sample(logits, x, q, params, g)) - 1 for x in drafts])
    for i in range(D):
        reached = int((accepted >= i).sum())
        passed = int((accepted >= i + 1).sum())
        stderr = (rates[i] * (1 - rates[i]) / reached) ** 0.5
        assert abs(passed / reached - rates[i]) < 4 * stderr, (i, passed / reached, rates[i])


def test_device_sampler_is_seeded_and_fixed_length() -> None:
    """Same generator seed -> same tokens; and every call consumes the same amount of the stream whatever is
    accepted, so the next call's draws depend only on the request's own drafts."""
    logits, params, q = case_logits(16, 1.0), SamplingParams(temperature=1.0), drafter_probs(17)
    runs = []
    for _ in range(2):
        g = torch.Generator().manual_seed(18)
        runs.append([device_sample(logits, [t % V, (t + 1) % V], q, params, g) for t in range(50)])
    assert runs[0] == runs[1]
    assert len({len(tokens) for tokens in runs[0]}) > 1  # both accepts and rejects happened
    after = []
    for drafts in ([0, 1], [5, 5]):  # other drafts and outcomes, the same amount of the stream used
        g = torch.Generator().manual_seed(19)
        rejection_sample_draws(logits[:1 + len(drafts)], drafts, q, params, g)
        after.append(torch.rand(4, generator=g, dtype=torch.float64))
    assert torch.equal(after[0], after[1])


@pytest.mark.parametrize("with_probs", [False, True])
def test_greedy_accepts_the_leading_argmax_matches(with_probs: bool) -> None:
    logits = case_logits(8, 1.0)
    argmax = logits.argmax(dim=-1).tolist()
    q = drafter_probs(9) if with_probs else None  # greedy ignores the drafter's probabilities
    for drafts in itertools.product(range(V), repeat=D):
        accepted = next((i for i in range(D) if drafts[i] != argmax[i]), D)
        expected = list(drafts[:accepted]) + [argmax[accepted]]
        assert rejection_sample(logits, list(drafts), q, SamplingParams(temperature=0), None) == expected
    assert rejection_sample(logits[:1], [], None, SamplingParams(temperature=0), None) == argmax[:1]


def test_chi_square_check_detects_a_biased_sampler() -> None:
    """The check has power: at N draws it rejects the classic bug "on rejection, resample from p instead
    of norm(max(p - q, 0))", whose first token has law min(p, q) + (1 - sum min(p, q)) p."""
    table_df5_p001 = 20.515  # chi-square critical value, 5 degrees of freedom, p = 0.001
    assert torch.special.gammaincc(torch.tensor(2.5, dtype=torch.float64),
                                   torch.tensor(table_df5_p001 / 2, dtype=torch.float64)) == pytest.approx(1e-3, 1e-3)
    p = probabilities(case_logits(0, 1.0)[0], SamplingParams(temperature=1.0))
    q = drafter_probs(1)[0]
    overlap = torch.minimum(p, q)
    biased = overlap + (1 - overlap.sum()) * p
    counts = torch.bincount(torch.multinomial(biased, N, replacement=True,
                                              generator=torch.Generator().manual_seed(0)), minlength=V)
    assert chi_square_p_value(counts, p) < ALPHA
