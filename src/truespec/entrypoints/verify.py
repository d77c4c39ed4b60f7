"""``truespec verify``: run the same prompts through the engine with and without a configuration
(the *candidate*) and report, per request, ``identical`` or the first divergence: its position, both
tokens, and both runs' top-2 logit margins there.

Greedy decoding is deterministic, and truespec promises that speculation gives exactly the tokens of
the run without it (docs/ARCHITECTURE.md, invariant 4), so for a lossless knob any divergence is a bug. A
divergence where the baseline's own margin is tiny is still reported: for a lossy knob (a quantized
KV cache) a near-tie may legitimately flip, and the margins let the user judge.
"""

import gc
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from truespec.llm import LLM
from truespec.outputs import CompletionOutput
from truespec.sampling_params import SamplingParams

PromptType = str | dict


@dataclass(frozen=True)
class Knob:
    """An engine setting under test: verify sets it on the candidate engine only."""

    name: str  # the LLM(...) keyword; the CLI flag is --name-with-dashes
    parse: Callable[[str], object]  # command-line text -> value; raises ValueError with a clear message
    help: str


def json_object(text: str) -> dict:
    """Parse a JSON object given on the command line (vLLM's style for dict-valued engine args)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON ({e.msg} at column {e.colno}): {text!r}") from e
    if not isinstance(value, dict):
        raise ValueError(f"must be a JSON object like '{{\"method\": \"ngram\", ...}}', got {text!r}")
    return value


# One line per knob. Each is also an ordinary engine arg of `truespec generate`.
KNOBS: tuple[Knob, ...] = (
    Knob("speculative_config", json_object,
         'speculative decoding, as JSON: \'{"method": "ngram", "num_speculative_tokens": 4}\''),
)


def _stale_state(llm: LLM) -> None:
    """After each verify, point the request back at state slot 0 instead of the slot after its last accepted
    token: the recurrent-state bug of vLLM #40738 on hybrid models (nothing changes for dense models)."""

    def stale(seq: object, num_accepted: int) -> None:
        seq.state_index = 0

    llm.llm_engine.update_hooks.append(stale)


# Faults injected into the candidate, to check that verify catches a real bug class (a self-test).
DEBUG_FAULTS: dict[str, Callable[[LLM], None]] = {"stale-state": _stale_state}


@dataclass(frozen=True)
class Divergence:
    position: int  # index of the first differing output token
    baseline_token: int | None  # None: that run had already finished
    candidate_token: int | None
    baseline_text: str
    candidate_text: str
    baseline_margin: float | None  # top-2 logprob margin (= logit margin) of that run at this position
    candidate_margin: float | None


@dataclass(frozen=True)
class VerifyResult:
    prompt: PromptType
    baseline_token_ids: list[int]
    candidate_token_ids: list[int]
    divergence: Divergence | None

    @property
    def is_identical(self) -> bool:
        return self.divergence is None


def verify(model: str | None, prompts: PromptType | Sequence[PromptType], candidate_kwargs: dict[str, object],
           baseline_kwargs: dict[str, object] | None = None, max_tokens: int = 128, ignore_eos: bool = False,
           candidate_hook: Callable[[LLM], None] | None = None) -> list[VerifyResult]:
    """Greedy-decode ``prompts`` with the baseline engine, then with the candidate; compare per request.

    ``baseline_kwargs`` defaults to ``candidate_kwargs`` without the knobs (``KNOBS``).
    ``candidate_hook`` is called on the candidate ``LLM`` after construction (tests, fault injection).
    The engines run one after the other, so each may take the whole device."""
    if baseline_kwargs is None:
        baseline_kwargs = baseline_of(candidate_kwargs)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos, logprobs=2)
    prompts = [prompts] if isinstance(prompts, str | dict) else list(prompts)
    for kwargs in (candidate_kwargs, baseline_kwargs):  # a bad candidate fails before the baseline runs
        LLM.check_args(model, **kwargs)
    baseline, tokenizer = _run(model, baseline_kwargs, prompts, params, None)
    candidate, _ = _run(model, candidate_kwargs, prompts, params, candidate_hook)
    return [VerifyResult(p, b.token_ids, c.token_ids, first_divergence(b, c, tokenizer))
            for p, b, c in zip(prompts, baseline, candidate, strict=True)]


def baseline_of(candidate_kwargs: dict[str, object]) -> dict[str, object]:
    names = {knob.name for knob in KNOBS}
    return {k: v for k, v in candidate_kwargs.items() if k not in names}


def first_divergence(baseline: CompletionOutput, candidate: CompletionOutput,
                     tokenizer) -> Divergence | None:  # noqa: ANN001 - a transformers tokenizer
    a, b = baseline.token_ids, candidate.token_ids
    pos = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    if pos == len(a) == len(b):
        return None
    tok_a, tok_b = (a[pos] if pos < len(a) else None), (b[pos] if pos < len(b) else None)
    return Divergence(pos, tok_a, tok_b, _piece(tokenizer, tok_a), _piece(tokenizer, tok_b),
                      _margin(baseline.logprobs, pos), _margin(candidate.logprobs, pos))


def top2_margin(logprobs: dict[int, float]) -> float:
    """Largest minus second-largest log-probability: the logit margin (softmax shifts both alike)."""
    top = sorted(logprobs.values(), reverse=True)
    return top[0] - top[1] if len(top) > 1 else float("inf")


def _margin(logprobs: list[dict[int, float]] | None, pos: int) -> float | None:
    return top2_margin(logprobs[pos]) if logprobs is not None and pos < len(logprobs) else None


def _piece(tokenizer, token: int | None) -> str:  # noqa: ANN001 - a transformers tokenizer
    return "<end>" if token is None else tokenizer.decode([token])


def _run(model: str | None, kwargs: dict[str, object], prompts: list[PromptType], params: SamplingParams,
         hook: Callable[[LLM], None] | None) -> tuple[list[CompletionOutput], object]:
    llm = LLM(model, **kwargs)
    if hook is not None:
        hook(llm)
    outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    tokenizer = llm.get_tokenizer()
    del llm  # free its KV pool before the next engine takes the device
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return outputs, tokenizer


# ---- the report ------------------------------------------------------------------------------
_ROW = "{:>4}  {:<9}  {:>5}  {:<20}  {:>7}  {:<20}  {:>7}  {}"


def format_results(results: list[VerifyResult]) -> str:
    """A table (one row per request) and a summary line."""
    rows = [_ROW.format("req", "result", "pos", "baseline", "margin", "candidate", "margin", "prompt")]
    for i, r in enumerate(results):
        d = r.divergence
        if d is None:
            rows.append(_ROW.format(i, "identical", "-", "", "", "", "", _short(r.prompt)))
        else:
            rows.append(_ROW.format(i, "DIVERGED", d.position, _token(d.baseline_token, d.baseline_text),
                                    _num(d.baseline_margin), _token(d.candidate_token, d.candidate_text),
                                    _num(d.candidate_margin), _short(r.prompt)))
    num_diverged = sum(not r.is_identical for r in results)
    num_tokens = sum(len(r.baseline_token_ids) for r in results)
    rows.append(f"verify: {len(results) - num_diverged} of {len(results)} requests identical, {num_diverged} "
                f"diverged ({num_tokens} baseline tokens compared)")
    return "\n".join(rows)


def _token(token: int | None, text: str) -> str:
    return text if token is None else f"{token} {text!r}"[:20]


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def _short(prompt: PromptType, width: int = 40) -> str:
    if isinstance(prompt, dict):
        prompt = prompt.get("prompt") or prompt.get("prompt_token_ids")
    text = repr(prompt)
    return text if len(text) <= width else text[:width - 3] + "..."
