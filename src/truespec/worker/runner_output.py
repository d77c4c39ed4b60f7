"""What the model runner returns for one step: ``ModelRunnerOutput``, read by the engine and the proposers."""

from dataclasses import dataclass, field

import torch


@dataclass
class ModelRunnerOutput:
    req_ids: list[str] = field(default_factory=list)  # the scheduled requests, in the step's order
    # per request: its accepted drafts then one new token; [] for a prefill chunk that is not its last
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[dict[int, float]] | None] = field(default_factory=list)  # per emitted token, if asked
    # per request: per prompt token whose logprobs the step gave (SamplingParams.prompt_logprobs), else None
    prompt_logprobs: list[list[dict[int, float]] | None] = field(default_factory=list)
    hidden_states: torch.Tensor | None = None  # [num_tokens, hidden_size]: the target's final hidden states
    query_start_loc: list[int] = field(default_factory=list)  # request r's rows in ``hidden_states``

    def num_accepted(self, r: int) -> int:
        """Drafts request ``r`` had accepted."""
        return max(len(self.sampled_token_ids[r]) - 1, 0)
