"""Acceptance counters, named as vLLM names them."""

from dataclasses import dataclass, field


@dataclass
class SpecDecodeMetrics:
    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # per count c <= k: the verified requests that had c drafts / accepted c (O(1) per request; the per-position
    # counts are their tails, ``num_accepted_tokens_per_pos`` / ``num_draft_tokens_per_pos``)
    num_requests_by_drafts: list[int] = field(default_factory=list, repr=False)
    num_requests_by_accepted: list[int] = field(default_factory=list, repr=False)
    num_steps: int = 0  # engine steps run
    num_steps_without_drafts: int = 0  # of them, steps in which no request verified a draft
    # times a request that could draft for its next step drafted nothing because drafts were not paying for it
    # (the adaptive draft length, spec_decode/draft_length.py)
    num_draft_skips: int = 0

    def __post_init__(self) -> None:
        self.num_requests_by_drafts = [0] * (self.num_speculative_tokens + 1)
        self.num_requests_by_accepted = [0] * (self.num_speculative_tokens + 1)

    def observe_step(self, has_drafts: bool) -> None:
        self.num_steps += 1
        self.num_steps_without_drafts += not has_drafts

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One verified request: ``num_draft_tokens`` drafts, the first ``num_accepted`` accepted."""
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        self.num_requests_by_drafts[num_draft_tokens] += 1
        self.num_requests_by_accepted[num_accepted] += 1

    @property
    def num_accepted_tokens_per_pos(self) -> list[int]:
        """Per draft position: the drafts accepted there."""
        return _tails(self.num_requests_by_accepted)

    @property
    def num_draft_tokens_per_pos(self) -> list[int]:
        """Per draft position: the drafts that reached it."""
        return _tails(self.num_requests_by_drafts)

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def as_dict(self) -> dict[str, object]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "num_draft_tokens_per_pos": list(self.num_draft_tokens_per_pos),
            "num_steps": self.num_steps,
            "num_steps_without_drafts": self.num_steps_without_drafts,
            "num_draft_skips": self.num_draft_skips,
            "mean_acceptance_length": self.mean_acceptance_length,
        }


def _tails(num_by_count: list[int]) -> list[int]:
    """Position j (0-based): how many counts exceed j, from the number of times each count occurred."""
    tails, total = [], 0
    for n in reversed(num_by_count[1:]):
        total += n
        tails.append(total)
    return tails[::-1]
