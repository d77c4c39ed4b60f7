"""Prompt-lookup (n-gram) drafting: find the longest suffix n-gram seen earlier, propose what followed."""

from truespec.spec_decode.interface import DraftRequest, Drafts
from truespec.worker.runner_output import ModelRunnerOutput


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, requests: list[DraftRequest], output: ModelRunnerOutput,
                finished_req_ids: list[str]) -> dict[str, Drafts]:
        """Drafts for each request that just got a new token (ngram drafts are one-hot: no probabilities)."""
        return {r.request_id: Drafts(self.lookup(r.prompt_token_ids + r.output_token_ids, r.max_drafts))
                for r in requests if r.is_drafting}

    def lookup(self, token_ids: list[int], max_drafts: int) -> list[int]:
        """Up to ``min(k, max_drafts)`` tokens that followed the most recent earlier occurrence of the
        longest suffix n-gram (n from max_n down to min_n) of ``token_ids``; [] when none occurred."""
        limit = min(self.k, max_drafts)
        if limit <= 0:
            return []
        n_tokens = len(token_ids)
        for n in range(min(self.max_n, n_tokens - 1), self.min_n - 1, -1):
            suffix = token_ids[n_tokens - n:]
            start = _last_occurrence(token_ids, suffix, end=n_tokens - n)
            if start is not None:
                follow = start + n
                return token_ids[follow:follow + limit]
        return []


def _last_occurrence(tokens: list[int], pattern: list[int], end: int) -> int | None:
    """Start of the last occurrence of ``pattern`` beginning before ``end`` (excluding the suffix itself)."""
    first = pattern[0]
    n = len(pattern)
    for start in range(end - 1, -1, -1):
        if tokens[start] == first and tokens[start:start + n] == pattern:
            return start
    return None
