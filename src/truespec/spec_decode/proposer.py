"""Which drafter a speculative config asks for. After each step a proposer sees what ran (and the
target's hidden states) and sets ``seq.draft_token_ids`` (and ``seq.draft_probs`` when it samples) for
every request that got a new token, to be verified in its next step."""

from typing import Protocol

from truespec.config import SpeculativeConfig
from truespec.engine.model_runner import StepOutput
from truespec.engine.scheduler import ScheduledSeq
from truespec.spec_decode.ngram import NgramProposer


class Proposer(Protocol):
    def propose(self, scheduled: list[ScheduledSeq], step: StepOutput) -> None: ...


def make_proposer(config: SpeculativeConfig | None) -> Proposer | None:
    if config is None:
        return None
    if config.method == "ngram":
        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
    raise ValueError(f"speculative_config.method={config.method!r} is not available in this build yet")
