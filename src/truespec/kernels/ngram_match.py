"""Prompt-lookup (n-gram) drafts in one launch (torch reference: ops/ngram_match.py).

One program per request reads its length from device memory, so the launch needs nothing from the host but the
request count: it can be queued while the lengths are still being computed on the device. For each n, longest
first, it walks the candidate end positions backwards from ``L - 2`` in blocks of BLOCK, comparing the n tokens
ending at each with the suffix n-gram (n masked loads a block), and stops at the first block that holds a match:
its largest matching position is the most recent occurrence. Work per request is O(L * (sum of n)) at worst and
usually one block per n, as matches tend to be recent. Loads are masked to positions below the request's length.
"""

import torch
import triton
import triton.language as tl

from truespec.kernels.triton_utils import reduce_max


@triton.jit
def _ngram_match_kernel(history_ptr, rows_ptr, lengths_ptr, out_ptr, stride_history, MIN_N: tl.constexpr,
                        MAX_N: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    tokens_ptr = history_ptr + tl.load(rows_ptr + r) * stride_history
    length = tl.load(lengths_ptr + r)
    best = tl.full([], -1, tl.int64)  # where the winning occurrence ends (-1: none yet)
    for n in tl.static_range(MAX_N, MIN_N - 1, -1):
        block_end = length - 2  # candidate ends: n - 1 .. L - 2 (no candidate when L <= n)
        while (best < 0) & (block_end >= n - 1):
            p = block_end - tl.arange(0, BLOCK)  # [BLOCK] candidate ends, newest first
            is_match = p >= n - 1
            for i in tl.static_range(n):  # token i back from each end against the suffix's
                suffix_token = tl.load(tokens_ptr + length - 1 - i)
                token = tl.load(tokens_ptr + p - i, mask=is_match, other=0)
                is_match = is_match & (token == suffix_token)
            best = reduce_max(tl.where(is_match, p, -1), 0)
            block_end -= BLOCK
    is_found = best >= 0
    period = tl.where(is_found, length - 1 - best, 1)
    j = tl.arange(0, BLOCK_K)
    at = tl.where(is_found, best + 1 + j % period, length - 1)  # [BLOCK_K]: no match -> the last token
    drafts = tl.load(tokens_ptr + at, mask=(j < K) & (length > 0), other=0)
    tl.store(out_ptr + r * K + j, drafts.to(tl.int64), mask=j < K)


def ngram_match(history: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor, min_n: int, max_n: int, k: int,
                block: int = 128) -> torch.Tensor:
    """``ops.ngram_match.ngram_match_ref`` in one launch, with no host sync (``block``: candidate ends a step, a
    power of two; tests pass a small one to cross block edges on short histories). history's rows contiguous."""
    assert history.stride(1) == 1
    out = torch.empty(len(rows), k, dtype=torch.int64, device=history.device)
    if len(rows):
        _ngram_match_kernel[(len(rows),)](history, rows, lengths, out, history.stride(0), MIN_N=min_n, MAX_N=max_n,
                                          K=k, BLOCK_K=triton.next_power_of_2(k), BLOCK=block)
    return out
