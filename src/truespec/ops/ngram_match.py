"""Prompt-lookup (n-gram) drafts from token histories on the device (reference for kernels/ngram_match.py).

The rule is the host proposer's (spec_decode/ngram.py): for n from max_n down to min_n, the most recent earlier
occurrence of the suffix n-gram (one that starts before ``L - n``, so not the suffix itself) ends at p, and the
drafts are the tokens that followed it. Here they always number k: the tokens after p run to the end of the history
(``period = L - 1 - p`` of them), and past those the drafts repeat them, ``t[p + 1 + j % period]`` for draft j (once
they are accepted, the history ends with the same n-gram one period after its last occurrence, so a lookup of that n
drafts the same tokens again); the first ``min(k, period)`` are the host's drafts. With no occurrence (or
``L <= min_n``) every draft is the last token (0 for an empty history).
"""

import torch


def ngram_match_ref(history: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor, min_n: int, max_n: int,
                    k: int) -> torch.Tensor:
    """Drafts [R, k] int64. history [S, W] int32 (request r's tokens: row ``rows[r]``, its first ``lengths[r]``
    entries; the rest is garbage, never read); rows, lengths [R] int64."""
    out = torch.zeros(len(rows), k, dtype=torch.int64, device=history.device)
    for r, (row, length) in enumerate(zip(rows.tolist(), lengths.tolist(), strict=True)):
        tokens = history[row, :length].long()
        end = last_match_end(tokens, min_n, max_n)
        if end is not None:
            period = length - 1 - end
            out[r] = tokens[end + 1 + torch.arange(k, device=history.device) % period]
        elif length > 0:
            out[r] = tokens[-1]
    return out


def last_match_end(tokens: torch.Tensor, min_n: int, max_n: int) -> int | None:
    """Where the most recent earlier occurrence of the longest suffix n-gram (n from max_n down to min_n) of
    ``tokens`` [L] ends: the largest p in [n - 1, L - 2] with ``tokens[p - n + 1 : p + 1]`` the suffix (None:
    none for any n)."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if length <= n:
            continue
        windows = tokens.unfold(0, n, 1)[:length - n]  # [L - n, n]: the n-grams ending at n - 1 .. L - 2
        ends = (windows == tokens[length - n:]).all(dim=1).nonzero()
        if len(ends):
            return int(ends[-1]) + n - 1
    return None
