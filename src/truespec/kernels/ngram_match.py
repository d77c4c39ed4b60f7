"""A greedy step's prompt-lookup (n-gram) drafting in one launch (torch reference: ops/ngram_match.ngram_step_ref).

One program per request reads every per-request value from device memory, so the launch needs nothing from the host
but the request count: it can be queued while the accepted counts are still being computed on the device. Each
program first writes its request's query rows' argmax into the history, then (after a barrier) matches with the
length the accepted count gives: for each n, longest first, it walks the candidate end positions backwards from
``L - 2`` in blocks of BLOCK, comparing the n tokens ending at each with the suffix n-gram (n masked loads a block),
and stops at the first block that holds a match: its largest matching position is the most recent occurrence. Work
per request is O(L * (sum of n)) at worst and usually one block per n, as matches tend to be recent. Loads are
masked to positions below the request's length.
"""

import torch
import triton
import triton.language as tl

from truespec.kernels.triton_utils import reduce_max


@triton.jit
def _draft_positions(tokens_ptr, length, MIN_N: tl.constexpr, MAX_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK: tl.constexpr):
    """[BLOCK_K]: where in the request's tokens draft j is (the last token where nothing matched)."""
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
    return tl.where(is_found, best + 1 + j % period, length - 1)


@triton.jit
def _ngram_step_kernel(history_ptr, rows_ptr, positions_ptr, query_start_loc_ptr, argmax_ptr, num_accepted_ptr,
                       out_ptr, stride_history, MIN_N: tl.constexpr, MAX_N: tl.constexpr, K: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    tokens_ptr = history_ptr + tl.load(rows_ptr + r) * stride_history
    q0 = tl.load(query_start_loc_ptr + r)
    q1 = tl.load(query_start_loc_ptr + r + 1)
    for t0 in range(q0, q1, BLOCK):  # each query row's argmax, at the position after the row's
        t = t0 + tl.arange(0, BLOCK)
        is_row = t < q1
        position = tl.load(positions_ptr + t, mask=is_row, other=0)
        token = tl.load(argmax_ptr + t, mask=is_row, other=0)
        tl.store(tokens_ptr + position + 1, token.to(tl.int32), mask=is_row)
    num_accepted = tl.load(num_accepted_ptr + r)
    tl.store(out_ptr + r * (1 + K), tl.load(argmax_ptr + q0 + num_accepted).to(tl.int64))
    if K > 0:
        tl.debug_barrier()  # the writes above, by some threads, before the matching's loads, by others
        length = tl.load(positions_ptr + q0) + num_accepted + 2  # through the next token
        at = _draft_positions(tokens_ptr, length, MIN_N, MAX_N, BLOCK_K, BLOCK)
        j = tl.arange(0, BLOCK_K)
        drafts = tl.load(tokens_ptr + at, mask=j < K, other=0)  # length >= 2: every position holds a token
        tl.store(out_ptr + r * (1 + K) + 1 + j, drafts.to(tl.int64), mask=j < K)


def ngram_step(history: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, query_start_loc: torch.Tensor,
               argmax: torch.Tensor, num_accepted: torch.Tensor, min_n: int, max_n: int, k: int,
               block: int = 128) -> torch.Tensor:
    """``ops.ngram_match.ngram_step_ref`` in one launch (history written in place), with no host sync: one program
    per request writes its query rows' tokens, then (after a barrier, so that its loads see its stores) matches.
    ``block``: query rows and candidate ends a step, a power of two. history's rows contiguous."""
    assert history.stride(1) == 1
    out = torch.empty(len(rows), 1 + k, dtype=torch.int64, device=history.device)
    if len(rows):
        _ngram_step_kernel[(len(rows),)](history, rows, positions, query_start_loc, argmax, num_accepted, out,
                                         history.stride(0), MIN_N=min_n, MAX_N=max_n, K=k,
                                         BLOCK_K=max(triton.next_power_of_2(k), 1), BLOCK=block)
    return out
