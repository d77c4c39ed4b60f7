"""The distribution a request samples from: temperature, top-k, top-p, min-p.

Tokens are drawn in ``rejection_sampler.py`` (with or without drafts), on the device with each request's
own generator, so a seeded request draws the same tokens whatever else is in the batch (invariant 1).
"""

import torch

from truespec.sampling_params import SamplingParams


def probabilities(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a random request samples from: [vocab] logits -> [vocab] probabilities."""
    row = row / p.temperature
    if p.top_k > 0 and p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token is always kept)
        drop_sorted = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= p.top_p
        drop_sorted[0] = False  # also when top_p is 0 in float32 (1e-46): 0 >= 0 would drop every token
        probs = probs.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), 0.0)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def request_generator(params: SamplingParams, request_id: str, engine_seed: int, device: torch.device,
                      stream: int = 0) -> torch.Generator:
    """A request's own random stream (``stream`` 0: the target's sampling; 1: a drafter's), seeded by
    ``params.seed`` or else by the engine seed and the request id: the same whatever the batch."""
    base = params.seed if params.seed is not None else engine_seed * 1_000_003 + int(request_id)
    gen = torch.Generator(device=device)
    gen.manual_seed((base + stream * 0x9E3779B97F4A7C15) % 2**64)
    return gen
