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


def ngram_step_ref(history: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, query_start_loc: torch.Tensor,
                   argmax: torch.Tensor, num_accepted: torch.Tensor, min_n: int, max_n: int, k: int) -> torch.Tensor:
    """A greedy step's next tokens and drafts [R, 1 + k] int64, its tokens written into ``history`` (in place).
    Request r (history row ``rows[r]``) has query rows ``query_start_loc[r] .. query_start_loc[r + 1] - 1`` at
    consecutive ``positions`` [>= T] int64, whose target tokens are ``argmax`` [>= T] int64, and its verify accepted
    ``num_accepted[r]`` drafts (below its query length). Each query row's token goes to the position after the row's
    (rows past the accepted ones write past the request's new length); then the request holds ``L = positions[q0] +
    num_accepted[r] + 2`` tokens through its next token ``argmax[q0 + num_accepted[r]]``, result column 0, and
    columns 1 .. k are ``ngram_match_ref``'s drafts for that length."""
    starts = query_start_loc[:-1]
    tokens = torch.arange(int(query_start_loc[0]), int(query_start_loc[-1]), device=history.device)
    token_rows = rows.repeat_interleave(query_start_loc.diff())
    history[token_rows, positions[tokens] + 1] = argmax[tokens].to(torch.int32)
    next_token = argmax[starts + num_accepted][:, None]
    if not k:
        return next_token
    lengths = positions[starts] + num_accepted + 2
    return torch.cat([next_token, ngram_match_ref(history, rows, lengths, min_n, max_n, k)], dim=1)


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
