"""A request's ``StructuredOutputsParams`` -> an xgrammar ``CompiledGrammar``, compiled once per constraint.

The compiler is built on first use from the engine's tokenizer (``xgrammar.TokenizerInfo``), the model's vocabulary
size (the logits' width: rows past the tokenizer's tokens are never allowed) and the engine's EOS ids, which are the
grammar's stop tokens: EOS is allowed exactly where the grammar may end. Compiled grammars are kept in a bounded
LRU cache keyed by the constraint's canonical text, so a schema that many requests share compiles once.
"""

from __future__ import annotations

import json
import os
import re
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from truespec.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped first)
JSON_OBJECT_SCHEMA = '{"type": "object"}'  # json_object: any JSON object (vLLM compiles the same schema)


class GrammarCompiler:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int, stop_token_ids: set[int],
                 disable_any_whitespace: bool = False) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.disable_any_whitespace = disable_any_whitespace  # for every request (structured_outputs_config)
        self.stop_token_ids = sorted(t for t in stop_token_ids if 0 <= t < vocab_size)
        self.num_compiled = 0  # compilations run (cache misses)
        self._compiler: Any = None  # xgrammar.GrammarCompiler, built on first use
        self._cache: OrderedDict[tuple, Any] = OrderedDict()

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``params`` (cached); a ValueError naming the field if it does not compile."""
        key = self.cache_key(params)
        grammar = self._cache.get(key)
        if grammar is not None:
            self._cache.move_to_end(key)
            return grammar
        grammar = self._compile(params)
        self.num_compiled += 1
        self._cache[key] = grammar
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return grammar

    def _compile(self, params: StructuredOutputsParams) -> Any:
        compiler, kind = self._xgrammar_compiler(), params.kind
        try:
            if kind in ("json", "json_object"):
                schema = key_text(params) if kind == "json" else JSON_OBJECT_SCHEMA
                return compiler.compile_json_schema(schema, any_whitespace=not self._no_whitespace(params))
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            return compiler.compile_grammar(choice_grammar(params.choice) if kind == "choice" else params.grammar)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError on a bad constraint
            raise ValueError(f"SamplingParams.structured_outputs.{kind} is not a valid {DESCRIPTIONS[kind]}: "
                             f"{_reason(e)}") from None

    def cache_key(self, params: StructuredOutputsParams) -> tuple:
        return params.kind, key_text(params), self._no_whitespace(params)

    def _no_whitespace(self, params: StructuredOutputsParams) -> bool:
        return self.disable_any_whitespace or params.disable_any_whitespace

    def _xgrammar_compiler(self) -> Any:
        if self._compiler is None:
            if self.tokenizer is None:
                raise ValueError("SamplingParams.structured_outputs needs a tokenizer, and this engine has "
                                 "skip_tokenizer_init=True")
            import xgrammar as xgr  # here, not at the top: only requests with structured outputs load it

            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=min(8, os.cpu_count() or 1))
        return self._compiler


DESCRIPTIONS = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex", "choice": "list of choices",
                "grammar": "EBNF grammar"}


def key_text(params: StructuredOutputsParams) -> str:
    """The constraint as canonical text (a JSON schema re-serialised with sorted keys)."""
    spec = params.spec
    if params.kind == "json":
        try:
            return json.dumps(json.loads(spec) if isinstance(spec, str) else spec, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"SamplingParams.structured_outputs.json is not a valid JSON schema: {e}") from None
    return json.dumps(spec) if params.kind == "choice" else str(spec)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of ``choices`` (JSON string escapes are xgrammar's EBNF escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _reason(error: Exception) -> str:
    """xgrammar's message without its ``[time] file.cc:line:`` prefix, on one line."""
    text = re.sub(r"\[[\d:]+\] \S+:\d+: ", "", str(error)).strip()
    return " ".join(text.split())[:500]
