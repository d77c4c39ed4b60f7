"""Which drafter a speculative config asks for. A proposer sets ``seq.draft_token_ids`` (and
``seq.draft_probs`` when it samples) for every request that decodes in the next step."""

from typing import Protocol

from truespec.config import SpeculativeConfig
from truespec.engine.sequence import Sequence
from truespec.spec_decode.ngram import NgramProposer


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence]) -> None: ...


def make_proposer(config: SpeculativeConfig | None) -> Proposer | None:
    if config is None:
        return None
    if config.method == "ngram":
        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
    raise ValueError(f"speculative_config.method={config.method!r} is not available in this build yet")
