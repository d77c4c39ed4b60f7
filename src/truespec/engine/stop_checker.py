"""When a request stops: EOS, stop token ids, stop strings (on decoded text), max tokens, min tokens."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from truespec.core.sequence import Sequence

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase


class StopChecker:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, hf_config: PretrainedConfig, model_dir: str) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = _eos_token_ids(tokenizer, hf_config, model_dir)

    def check(self, seq: Sequence) -> str | None:
        """After a token was appended: the finish reason, or None. Sets the output text when finished."""
        p, token = seq.params, seq.output_token_ids[-1]
        if len(seq.output_token_ids) >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return self._finish(seq, "stop", None)
            if token in p.stop_token_ids:
                return self._finish(seq, "stop", token)
            if p.stop and self._match_stop_string(seq):
                return "stop"
        if len(seq.output_token_ids) >= seq.max_output_len:
            return self._finish(seq, "length", None)
        return None

    def can_stop(self, seq: Sequence, tokens: list[int]) -> bool:
        """Whether ``check`` could stop ``seq`` at any of ``tokens`` appended one by one (False: it certainly stops at
        none, so they may go in at once). Ignores min_tokens, which only ever delays a stop."""
        p = seq.params
        if p.stop or len(seq.output_token_ids) + len(tokens) >= seq.max_output_len:
            return True
        if not p.ignore_eos and not self.eos_token_ids.isdisjoint(tokens):
            return True
        return bool(p.stop_token_ids) and not set(p.stop_token_ids).isdisjoint(tokens)

    def _match_stop_string(self, seq: Sequence) -> bool:
        """The earliest stop string that ends past the text of the first ``min_tokens`` tokens (vLLM ignores a
        stop string inside that text); cut the output text there."""
        text = self.decode(seq)
        floor = len(self.decode(seq, seq.params.min_tokens)) if seq.params.min_tokens else 0
        hits = [(i, s) for s in seq.params.stop if (i := text.find(s, max(0, floor - len(s) + 1))) >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        end = index + len(stop) if seq.params.include_stop_str_in_output else index
        seq.output_text, seq.stop_reason = text[:end], stop
        return True

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | None) -> str:
        seq.output_text, seq.stop_reason = self.decode(seq), stop_reason
        return reason

    def decode(self, seq: Sequence, num_tokens: int | None = None) -> str:
        """The text of the output's first ``num_tokens`` tokens (all by default)."""
        if self.tokenizer is None:  # skip_tokenizer_init: outputs carry token ids and no text
            return ""
        ids = seq.output_token_ids if num_tokens is None else seq.output_token_ids[:num_tokens]
        return self.tokenizer.decode(ids, skip_special_tokens=seq.params.skip_special_tokens)


def _eos_token_ids(tokenizer: PreTrainedTokenizerBase | None, hf_config: PretrainedConfig,
                   model_dir: str) -> set[int]:
    ids: set[int] = set()
    sources: list[object] = [getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)]
    path = Path(model_dir) / "generation_config.json"
    if path.is_file():
        try:
            from transformers import GenerationConfig  # imported when an engine starts, not with truespec

            sources.append(GenerationConfig.from_pretrained(model_dir, local_files_only=True).eos_token_id)
        except (OSError, TypeError, ValueError) as e:  # transformers: OSError for bad JSON, TypeError for a list
            reason = e.__context__ if isinstance(e.__context__, ValueError) else e  # the JSON error, if any
            raise ValueError(f"invalid {path}: {reason}") from e
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(v for v in value if isinstance(v, int))
    return ids
