"""Lossless verification of drafted tokens (Leviathan et al. 2023; Chen et al. 2023).

For one request with drafts x_1..x_d, the target scored 1 + d positions: row i is the target's
distribution p_i for the token after the request's input token and x_1..x_i. Greedy: accept x_i while
it equals argmax p_{i-1}, then emit the target's own token. Random: accept x_i with probability
min(1, p(x_i) / q(x_i)); on rejection emit a sample of norm(max(p - q, 0)); if every draft is accepted,
emit a bonus sample of p_d. A drafter without a distribution (ngram) is a one-hot q. The emitted
tokens are distributed exactly as the target's own sampling would give.

``rejection_sample`` is the reference, one request at a time with host reads at every draft. The engine uses
``rejection_sample_draws`` (all of a request's draws on the device, no host sync) and ``emitted_tokens`` (the
host half, once the step's draws are copied to the host in one transfer).
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


def rejection_sample_draws(target_logits: torch.Tensor, draft_token_ids: list[int],
                           draft_probs: torch.Tensor | None, params: SamplingParams,
                           generator: torch.Generator | None) -> torch.Tensor:
    """A random request's verify on the device, without reading anything back: [2d + 1] int64, the accept flag
    of each draft (u_i q_i(x_i) < p_i(x_i)), then a sample at each of the 1 + d positions (of norm(max(p_i - q_i,
    0)) at a draft, of p_d at the bonus position). ``emitted_tokens`` turns them into tokens on the host.

    Every call draws d uniforms then 1 + d exponential vectors from ``generator`` whatever the values, so a
    request's random stream depends on nothing but its own drafts (invariant 1)."""
    d = len(draft_token_ids)
    p = torch.stack([probabilities(row, params) for row in target_logits])  # [1 + d, vocab]
    if draft_probs is None:  # ngram: one-hot q
        q = torch.zeros_like(p[:d])
        for i, x in enumerate(draft_token_ids):  # python indices: fills of views, no copy of the ids to the device
            q[i, x] = 1.0
    else:
        q = draft_probs[:d].to(p.dtype)  # [d, vocab]
    p_x, q_x = _at(p, draft_token_ids), _at(q, draft_token_ids)  # [d]
    u = torch.rand(d, generator=generator, device=p.device, dtype=p.dtype)
    accept = (q_x > 0) & (u * q_x < p_x)  # u < p(x) / q(x), without dividing
    residual = torch.clamp(p[:d] - q, min=0)
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p[:d])  # p == q: nothing to correct
    return torch.cat([accept.long(), sample(torch.cat([residual, p[d:]]), generator)])


def sample(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of [rows, vocab] non-negative weights (not necessarily normalised), on the device: the
    exponential race argmax(w / E), E ~ Exp(1) i.i.d., picks token t with probability w_t / sum(w)."""
    race = torch.empty_like(weights).exponential_(generator=generator)
    return torch.argmax(weights / race.clamp_min(torch.finfo(race.dtype).tiny), dim=-1)  # E = 0 is no 0 / 0


def emitted_tokens(draft_token_ids: list[int], draws: list[int]) -> list[int]:
    """The host half of ``rejection_sample_draws``: the drafts up to the first rejected one, then the sample at
    that position (the correction, or the bonus if every draft was accepted)."""
    d = len(draft_token_ids)
    accepted = _num_leading_equal(draws[:d], [1] * d)
    return draft_token_ids[:accepted] + [draws[d + accepted]]


def greedy_verify(draft_token_ids: list[int], target_argmax: list[int]) -> list[int]:
    """Greedy verification from the target's argmax at each of the 1 + d positions: the drafts up to the first
    one that differs, then the target's token there."""
    if not draft_token_ids:  # a plain decode
        return target_argmax[:1]
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


def _at(probs: torch.Tensor, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids)]: probs[i, token_ids[i]], gathered on the device."""
    if not token_ids:
        return probs.new_zeros(0)
    return torch.stack([probs[i, x] for i, x in enumerate(token_ids)])
