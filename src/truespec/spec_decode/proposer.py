"""Which proposer a speculative config asks for (``interface.py`` says what a proposer does)."""

from dataclasses import replace

import torch

from truespec.config import SpeculativeConfig
from truespec.models.eagle import load_eagle_head
from truespec.models.loader import LoadedModel, load_model
from truespec.models.mtp import load_mtp_head
from truespec.spec_decode.interface import Proposer
from truespec.spec_decode.model_drafter import ModelDrafter
from truespec.spec_decode.ngram import NgramProposer
from truespec.worker.graph_runner import GraphSettings


def make_proposer(config: SpeculativeConfig | None, target: LoadedModel, num_blocks: int, num_state_slots: int,
                  device: torch.device, seed: int, graphs: GraphSettings) -> Proposer | None:
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
    if config.enforce_eager:
        graphs = replace(graphs, mode="NONE")
    return ModelDrafter(head, k, num_blocks, num_state_slots, device, seed, graphs, target.hf_config.hidden_size)


def num_lookahead_tokens(config: SpeculativeConfig | None) -> int:
    """KV positions past a step's query that the proposer writes after it (its drafts), for the scheduler."""
    return 0 if config is None or config.method == "ngram" else config.num_speculative_tokens


def _load_draft_model(model_dir: str, target: LoadedModel, device: torch.device) -> torch.nn.Module:
    draft = load_model(model_dir, target.dtype, device)
    if draft.hf_config.vocab_size != target.hf_config.vocab_size:
        raise ValueError(f"speculative_config.model {model_dir} has vocab_size {draft.hf_config.vocab_size}, "
                         f"the target {target.hf_config.vocab_size}: a draft model must share the vocabulary")
    return draft.model
