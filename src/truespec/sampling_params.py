"""SamplingParams: how one request picks its tokens and when it stops (vLLM's fields and meanings), and
StructuredOutputsParams: the grammar its tokens must follow (vLLM's ``structured_outputs``)."""

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any

MAX_LOGPROBS = 20  # as vLLM's default max_logprobs
MIN_TEMPERATURE = 1e-2  # vLLM's _MAX_TEMP: a smaller temperature > 0 is raised to it (logits / T overflow)
FLOAT32_MAX = 3.4028234663852886e38  # a temperature above it is inf in the float32 logits: NaN probabilities
BOOL_FIELDS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens")

logger = logging.getLogger("truespec")


class RequestOutputKind(Enum):
    """Which outputs a request yields while it runs (vLLM's names)."""

    CUMULATIVE = 0  # after each step with new tokens: everything so far
    DELTA = 1  # after each step with new tokens: only what is new (text deltas never split a character)
    FINAL_ONLY = 2  # once, when it finishes (LLM.generate)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output (vLLM's names): ``json`` (a JSON schema, as a dict or its text),
    ``json_object`` (any JSON object), ``regex``, ``choice`` (one of these strings) or ``grammar`` (EBNF, as
    xgrammar reads it). Checked here for types; whether the schema / regex / grammar compiles is checked when the
    request is added (the engine's grammar compiler), with an error naming the field as well."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON without whitespace between tokens (vLLM's option)

    def __post_init__(self) -> None:
        given = [name for name in CONSTRAINTS if getattr(self, name) not in (None, False)]
        _check(len(given) == 1, "structured_outputs", f"must set exactly one of {list(CONSTRAINTS)}", given)
        _check(isinstance(self.disable_any_whitespace, bool), "structured_outputs.disable_any_whitespace",
               "must be a bool", self.disable_any_whitespace)
        _check(self.json_object in (None, True, False), "structured_outputs.json_object", "must be a bool",
               self.json_object)
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"SamplingParams.structured_outputs.json is not valid JSON: {e}") from None
        _check(self.json is None or isinstance(self.json, dict | str), "structured_outputs.json",
               "must be a JSON schema (a dict or its JSON text)", self.json)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, str) and value and "\x00" not in value),
                   f"structured_outputs.{name}", "must be a non-empty string without NUL", value)
        _check(self.choice is None or (isinstance(self.choice, list | tuple) and self.choice
                                       and all(isinstance(c, str) for c in self.choice)),
               "structured_outputs.choice", "must be a non-empty list of strings", self.choice)

    @property
    def kind(self) -> str:
        """The constraint set: "json", "json_object", "regex", "choice" or "grammar"."""
        return next(name for name in CONSTRAINTS if getattr(self, name) not in (None, False))

    @property
    def spec(self) -> Any:
        return getattr(self, self.kind)


CONSTRAINTS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class SamplingParams:
    n: int = 1  # completions per prompt (engine/parallel_sampling.py: n child requests, child i seeded seed + i)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # return the sampled token's and this many top tokens' log-probabilities
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (RequestOutput)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None  # the grammar the output follows (JSON schema, ...)

    def __post_init__(self) -> None:
        for f in fields(self):  # numpy scalars (np.float32(0.5), np.int64(5)) as the Python numbers they hold
            setattr(self, f.name, _plain(getattr(self, f.name)))
        self.stop = [self.stop] if isinstance(self.stop, str) else _as_list(self.stop, "stop", "strings")
        self.stop_token_ids = _as_list(self.stop_token_ids, "stop_token_ids", "ints")
        _check(_is_int(self.n) and self.n >= 1, "n", "must be an int >= 1", self.n)
        _check(_is_number(self.temperature) and 0 <= self.temperature <= FLOAT32_MAX, "temperature",
               "must be a finite number >= 0 (at most float32's largest, 3.4e38)", self.temperature)
        if 0 < self.temperature < MIN_TEMPERATURE:
            logger.warning("SamplingParams.temperature %s is below %s, where logits / temperature overflow: "
                           "raised to %s (as vLLM; use 0 for greedy)", self.temperature, MIN_TEMPERATURE,
                           MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p)
        _check(_is_int(self.top_k) and (self.top_k >= 0 or self.top_k == -1), "top_k",
               "must be -1, 0 (disabled) or >= 1", self.top_k)
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]", self.min_p)
        _check(self.seed is None or (_is_int(self.seed) and -(2**63) <= self.seed < 2**64), "seed",
               "must be None or an int in [-2**63, 2**64)", self.seed)
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens",
               "must be >= 1 or None", self.max_tokens)
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "must be >= 0",
               self.min_tokens)
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be <= max_tokens ({self.max_tokens})", self.min_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS), name,
                   f"must be None or in [0, {MAX_LOGPROBS}]", value)
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings",
               self.stop)
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "must be non-negative ints", self.stop_token_ids)
        _check(isinstance(self.output_kind, RequestOutputKind), "output_kind", "must be a RequestOutputKind",
               self.output_kind)
        for name in BOOL_FIELDS:
            _check(isinstance(getattr(self, name), bool), name, "must be a bool", getattr(self, name))
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               "structured_outputs", "must be a StructuredOutputsParams or None", self.structured_outputs)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and x == x  # x == x rejects NaN


def _plain(x: object) -> object:
    """A numpy scalar as the Python value it holds (vLLM accepts them); anything else unchanged."""
    return x.item() if type(x).__module__ == "numpy" and getattr(x, "shape", None) == () else x


def _as_list(value: object, name: str, of: str) -> list:
    if value is None:
        return []
    _check(isinstance(value, Iterable) and not isinstance(value, str | bytes | Mapping), name,
           f"must be a list of {of}", value)
    return [_plain(x) for x in value]


def _check(ok: bool, name: str, rule: str, value: object) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} {rule}, got {value!r}")


__all__ = ["RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]
