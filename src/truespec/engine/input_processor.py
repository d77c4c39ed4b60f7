"""InputProcessor (vLLM's name): a prompt and its SamplingParams -> a validated request, before the engine holds it.

Every check that can fail a request runs here, so a bad request fails alone with an error naming what is wrong and
never touches the scheduler or the caches: the prompt's form, its tokens (within the vocabulary, leaving room for
one output token), stop strings without a tokenizer, and the structured-output constraint (compiled here, cached).
Request ids come from one counter, drawn under a lock (the server's engine thread and ``LLM.generate`` both build
requests).
"""

from __future__ import annotations

import itertools
import threading
from typing import TYPE_CHECKING

from truespec.core.sequence import Sequence
from truespec.engine.parallel_sampling import ParentRequest
from truespec.sampling_params import SamplingParams
from truespec.structured_output.manager import StructuredOutputManager

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PromptType = str | dict
Request = Sequence | ParentRequest  # what make_request builds: one sequence, or n > 1 children under a parent


class InputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, max_model_len: int, vocab_size: int,
                 structured_outputs: StructuredOutputManager) -> None:
        self.tokenizer, self.max_model_len, self.vocab_size = tokenizer, max_model_len, vocab_size
        self.structured_outputs = structured_outputs
        self._ids = itertools.count()
        self._ids_lock = threading.Lock()

    def next_id(self) -> str:
        with self._ids_lock:
            return f"{next(self._ids)}"

    def make_request(self, prompt: PromptType, params: SamplingParams) -> Request:
        """Its Sequence, or with ``n > 1`` a ParentRequest over n child Sequences (engine/parallel_sampling.py)."""
        seq = self.make_sequence(prompt, params)
        if params.n == 1:
            return seq
        return ParentRequest(seq, [self.next_id() for _ in range(params.n)])

    def make_sequence(self, prompt: PromptType, params: SamplingParams) -> Sequence:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        text, token_ids = self._tokenize(prompt)
        if not token_ids:
            raise ValueError("prompt is empty: it must contain at least one token")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, but max_model_len is "
                             f"{self.max_model_len} (the prompt must leave room for one output token)")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if params.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop needs a tokenizer, and this engine has skip_tokenizer_init=True: "
                             "use stop_token_ids")
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"SamplingParams.stop_token_ids {bad[:5]} are outside the vocabulary "
                             f"[0, {self.vocab_size})")
        self.structured_outputs.check(params)  # compiles its grammar (cached): a bad schema is a ValueError here
        max_output_len = self.max_model_len - len(token_ids)
        if params.max_tokens is not None:
            max_output_len = min(max_output_len, params.max_tokens)
        return Sequence(self.next_id(), text, token_ids, params, max_output_len)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list | tuple) or not set(map(type, ids)) <= {int}:  # bool is no token
                raise ValueError("prompt_token_ids must be a list of ints")
            return prompt.get("prompt"), list(ids)
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        if isinstance(text, str):
            return text, self._encode(text)
        raise ValueError("a prompt must be a string, {'prompt': str} or {'prompt_token_ids': [int, ...]}, "
                         f"got {type(prompt).__name__}")

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer, and this engine has skip_tokenizer_init=True: give "
                             "{'prompt_token_ids': [...]}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate: no tokenizer can take it
            raise ValueError(f"the prompt is not valid Unicode: {e.reason} at index {e.start}") from e
        return self.tokenizer.encode(text)
