"""Which proposer a speculative config asks for (``interface.py`` says what a proposer does), in three phases
so that nothing is allocated for a configuration that cannot work: ``check_speculative_config`` reads only
configs and checkpoint headers (before the target loads), ``load_drafter`` loads the drafter's weights (before
the KV pool is sized), ``make_proposer`` gives it its caches and graphs."""

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch

from truespec.config import SpeculativeConfig
from truespec.models.eagle import load_eagle_head, read_eagle_config
from truespec.models.loader import LoadedModel, checkpoint_tensor_names, load_model, read_text_config
from truespec.models.mtp import check_mtp_checkpoint, load_mtp_head
from truespec.spec_decode.interface import Proposer
from truespec.spec_decode.model_drafter import ModelDrafter
from truespec.spec_decode.ngram import NgramProposer
from truespec.worker.graph_runner import GraphSettings

logger = logging.getLogger("truespec")


def check_speculative_config(config: SpeculativeConfig | None, target_dir: str) -> None:
    """Raise the error ``load_drafter`` would, from the files' configs and headers alone (no weight loaded)."""
    if config is None or config.method == "ngram":
        return
    with _naming(config):
        target = read_text_config(target_dir)
        if config.method == "mtp":
            check_mtp_checkpoint(target, checkpoint_tensor_names(target_dir))
        elif config.method == "eagle":
            read_eagle_config(config.model, target.hidden_size)
        else:
            _check_vocab(config.model, read_text_config(config.model).vocab_size, target.vocab_size)
            checkpoint_tensor_names(config.model)


def load_drafter(config: SpeculativeConfig | None, target: LoadedModel,
                 device: torch.device) -> torch.nn.Module | None:
    """The drafting network a config names (None for ngram and no speculation), its weights loaded."""
    if config is None or config.method == "ngram":
        return None
    with _naming(config):
        if config.method == "mtp":
            return load_mtp_head(target.hf_config, target.model, target.mtp_weights)
        if config.method == "eagle":
            return load_eagle_head(config.model, target.model, target.hf_config.hidden_size)
        draft = load_model(config.model, target.dtype, device)
        _check_vocab(config.model, draft.hf_config.vocab_size, target.hf_config.vocab_size)
        return draft.model


def make_proposer(config: SpeculativeConfig | None, head: torch.nn.Module | None, num_blocks: int,
                  num_state_slots: int, device: torch.device, seed: int, graphs: GraphSettings,
                  hidden_size: int, kv_cache_dtype: str = "auto") -> Proposer | None:
    if config is None:
        return None
    k = config.num_speculative_tokens
    if config.method == "ngram":
        return NgramProposer(k, config.prompt_lookup_min, config.prompt_lookup_max, bool(config.draft_on_device))
    if config.enforce_eager:
        graphs = replace(graphs, mode="NONE")
    return ModelDrafter(head, k, num_blocks, num_state_slots, device, seed, graphs, hidden_size, kv_cache_dtype,
                        config.draft_on_device)


def prefix_cache_extra_tokens(head: torch.nn.Module | None) -> int | None:
    """Token ids past a KV block that its prefix-cache key must cover for the drafter's cache of it to be valid: 0
    (no drafter, ngram, a draft model: its KV at a position depends on the tokens up to it), 1 (MTP / EAGLE: the
    head's KV at position p depends on token p + 1). None: a drafter with recurrent state, whose state is not
    checkpointed: prefix caching is turned off for it (logged)."""
    if head is None:
        return 0
    if head.gdn_layers():
        logger.warning("prefix caching is off: the draft model has recurrent state, which is not checkpointed")
        return None
    return 1 if getattr(head, "uses_target_hidden", False) else 0


def num_lookahead_tokens(config: SpeculativeConfig | None) -> int:
    """KV positions past a step's query that the proposer writes after it (its drafts), for the scheduler."""
    return 0 if config is None or config.method == "ngram" else config.num_speculative_tokens


@contextmanager
def _naming(config: SpeculativeConfig) -> Iterator[None]:
    """Say which part of the config an error is about."""
    try:
        yield
    except (FileNotFoundError, ValueError) as e:
        raise type(e)(f"speculative_config ({config.method}, model={config.model!r}): {e}") from e


def _check_vocab(model_dir: str, draft_vocab: int, target_vocab: int) -> None:
    if draft_vocab != target_vocab:
        raise ValueError(f"speculative_config.model {model_dir} has vocab_size {draft_vocab}, the target "
                         f"{target_vocab}: a draft model must share the vocabulary")
