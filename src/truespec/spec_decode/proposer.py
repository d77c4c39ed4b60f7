"""Which drafter a speculative config asks for. After each step a proposer sees what ran (and the
target's hidden states) and sets ``seq.draft_token_ids`` (and ``seq.draft_probs`` when it samples) for
every request that got a new token, to be verified in its next step."""

from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

import torch

from truespec.config import SpeculativeConfig
from truespec.engine.block_manager import BlockManager
from truespec.engine.graph_runner import GraphSettings
from truespec.engine.model_runner import StepOutput
from truespec.engine.scheduler import ScheduledSeq
from truespec.engine.sequence import Sequence
from truespec.engine.state_manager import StateManager
from truespec.models.eagle import load_eagle_head
from truespec.models.loader import LoadedModel, load_model
from truespec.models.mtp import load_mtp_head
from truespec.spec_decode.model_drafter import ModelDrafter
from truespec.spec_decode.ngram import NgramProposer


class Proposer(Protocol):
    def propose(self, scheduled: list[ScheduledSeq], step: StepOutput) -> None: ...


def make_proposer(config: SpeculativeConfig | None, target: LoadedModel, blocks: BlockManager,
                  states: StateManager, max_drafts: Callable[[Sequence], int], device: torch.device,
                  seed: int, graphs: GraphSettings | None = None) -> Proposer | None:
    if config is None:
        return None
    k = config.num_speculative_tokens
    if config.method == "ngram":
        return NgramProposer(k, config.prompt_lookup_min, config.prompt_lookup_max)
    try:
        if config.method == "mtp":
            head = load_mtp_head(target.hf_config, target.model, target.mtp_weights)
        elif config.method == "eagle":
            head = load_eagle_head(config.model, target.model, target.hf_config.hidden_size)
        else:
            head = _load_draft_model(config.model, target, device)
    except (FileNotFoundError, ValueError) as e:  # say which part of the config it is about
        raise type(e)(f"speculative_config ({config.method}, model={config.model!r}): {e}") from e
    if config.enforce_eager and graphs is not None:
        graphs = replace(graphs, mode="NONE")
    return ModelDrafter(head, k, blocks, states, max_drafts, device, seed, graphs, target.hf_config.hidden_size)


def _load_draft_model(model_dir: str, target: LoadedModel, device: torch.device) -> torch.nn.Module:
    draft = load_model(model_dir, target.dtype, device)
    if draft.hf_config.vocab_size != target.hf_config.vocab_size:
        raise ValueError(f"speculative_config.model {model_dir} has vocab_size {draft.hf_config.vocab_size}, "
                         f"the target {target.hf_config.vocab_size}: a draft model must share the vocabulary")
    return draft.model
