"""Acceptance counters, named as vLLM names them."""

from dataclasses import dataclass, field


@dataclass
class SpecDecodeMetrics:
    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_draft_tokens_per_pos: list[int] = field(default_factory=list)  # drafts that reached each position
    num_steps: int = 0  # engine steps run
    num_steps_without_drafts: int = 0  # of them, steps in which no request verified a draft
    # times a request that could draft for its next step drafted nothing because drafts were not paying for it
    # (the adaptive draft length, spec_decode/draft_length.py)
    num_draft_skips: int = 0

    def __post_init__(self) -> None:
        self.num_accepted_tokens_per_pos = [0] * self.num_speculative_tokens
        self.num_draft_tokens_per_pos = [0] * self.num_speculative_tokens

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
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1
        for pos in range(num_draft_tokens):
            self.num_draft_tokens_per_pos[pos] += 1

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
