"""A CompletionOutput's logprobs (per token ``{token_id: logprob}``: the sampled token and the top ones) in the
OpenAI shapes: chat's ``{"content": [...]}`` and the legacy completions' ``tokens / token_logprobs / ...``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


TokenLogprobs = list[dict[int, float]]


def chat_logprobs(tokenizer: PreTrainedTokenizerBase, token_ids: list[int], logprobs: TokenLogprobs,
                  num_top: int) -> dict[str, Any]:
    content = []
    for token_id, entry in zip(token_ids, logprobs, strict=True):
        top = [_chat_entry(tokenizer, t, lp) for t, lp in _top(entry, num_top)]
        content.append(_chat_entry(tokenizer, token_id, entry[token_id]) | {"top_logprobs": top})
    return {"content": content}


def completion_logprobs(tokenizer: PreTrainedTokenizerBase, token_ids: list[int], logprobs: TokenLogprobs,
                        num_top: int, text_offset: int = 0) -> dict[str, Any]:
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, logprobs, strict=True):
        text = _token_text(tokenizer, token_id)
        tokens.append(text)
        token_logprobs.append(_finite(entry[token_id]))
        top_logprobs.append({_token_text(tokenizer, t): _finite(lp) for t, lp in _top(entry, num_top)})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def _top(entry: dict[int, float], num_top: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])[:num_top]


def _chat_entry(tokenizer: PreTrainedTokenizerBase, token_id: int, logprob: float) -> dict[str, Any]:
    text = _token_text(tokenizer, token_id)
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8", "replace"))}


def _token_text(tokenizer: PreTrainedTokenizerBase, token_id: int) -> str:
    return tokenizer.decode([token_id])


def _finite(logprob: float) -> float:
    return max(logprob, -9999.0)  # JSON has no -inf (OpenAI uses -9999.0 too)
