"""Incremental detokenization: the text a request's new tokens add, never ending inside a character.

Decoding tokens one by one is wrong for byte-level vocabularies (a character may span tokens) and for tokenizers
whose decode depends on the token before (leading spaces). So each step decodes a short window: the tokens from
``prefix_offset`` on, and the same window without the new tokens; the new text is the difference. While the
window's text ends in U+FFFD (an incomplete UTF-8 sequence), nothing is emitted and the window grows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool, hold_back: int = 0) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.hold_back = hold_back  # characters kept back until the end (a stop string may still cut them)
        self.prefix_offset = 0  # first token of the decode window
        self.read_offset = 0  # tokens whose text is in ``text``
        self.text = ""  # decoded so far
        self.num_emitted = 0  # characters of ``text`` handed out as deltas

    def update(self, token_ids: list[int]) -> str:
        """Given all output tokens so far, the text to hand out now."""
        window = self._decode(token_ids[self.prefix_offset:])
        if len(token_ids) > self.read_offset and not window.endswith(INCOMPLETE):
            before = self._decode(token_ids[self.prefix_offset:self.read_offset])
            self.text += window[len(before):]
            self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        return self._emit(len(self.text) - self.hold_back)

    def finish(self, final_text: str) -> str:
        """The rest of ``final_text`` (the request's whole output text, a stop string cut off) not yet handed out."""
        self.text = final_text
        return self._emit(len(final_text))

    def _emit(self, end: int) -> str:
        if end <= self.num_emitted:
            return ""
        delta = self.text[self.num_emitted:end]
        self.num_emitted = end
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
