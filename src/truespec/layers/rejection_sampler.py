"""Lossless verification of drafted tokens (Leviathan et al. 2023; Chen et al. 2023).

For one request with drafts x_1..x_d, the target scored 1 + d positions: row i is the target's
distribution p_i for the token after the request's input token and x_1..x_i. Greedy: accept x_i while
it equals argmax p_{i-1}, then emit the target's own token. Random: accept x_i with probability
min(1, p(x_i) / q(x_i)); on rejection emit a sample of norm(max(p - q, 0)); if every draft is accepted,
emit a bonus sample of p_d. A drafter without a distribution (ngram) is a one-hot q. The emitted
tokens are distributed exactly as the target's own sampling would give.
"""

import torch

from truespec.layers.sampler import probabilities
from truespec.sampling_params import SamplingParams


def rejection_sample(target_logits: torch.Tensor, draft_token_ids: list[int], draft_probs: torch.Tensor | None,
                     params: SamplingParams, generator: torch.Generator | None) -> list[int]:
    """target_logits: [1 + d, vocab]; draft_probs: [d, vocab] or None (one-hot drafts).

    Returns the accepted drafts followed by one token from the target (correction or bonus)."""
    if params.is_greedy:
        return greedy_verify(draft_token_ids, torch.argmax(target_logits, dim=-1).tolist())
    out: list[int] = []
    for i, x in enumerate(draft_token_ids):
        p = probabilities(target_logits[i], params)
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
        u = float(torch.rand((), generator=generator, device=p.device, dtype=p.dtype))
        if q_x > 0 and u * q_x < float(p[x]):  # u < p(x) / q(x), without dividing
            out.append(x)
            continue
        q = _one_hot(x, p) if draft_probs is None else draft_probs[i].to(p.dtype)
        residual = torch.clamp(p - q, min=0)
        if float(residual.sum()) <= 0:  # p <= q everywhere only when p == q: nothing to correct
            residual = p
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    p = probabilities(target_logits[len(draft_token_ids)], params)
    out.append(int(torch.multinomial(p, 1, generator=generator)))
    return out


def greedy_verify(draft_token_ids: list[int], target_argmax: list[int]) -> list[int]:
    """Greedy verification from the target's argmax at each of the 1 + d positions: the drafts up to the first
    one that differs, then the target's token there."""
    accepted = _num_leading_equal(draft_token_ids, target_argmax)
    return draft_token_ids[:accepted] + [target_argmax[accepted]]


def _num_leading_equal(a: list[int], b: list[int]) -> int:
    n = 0
    while n < len(a) and a[n] == b[n]:
        n += 1
    return n


def _one_hot(x: int, like: torch.Tensor) -> torch.Tensor:
    q = torch.zeros_like(like)
    q[x] = 1.0
    return q
