"""Turns a step's tokens into request progress: stop checks, incremental text, timestamps, RequestOutputs.

The engine calls ``process`` once per request per step with the tokens the runner emitted for it; the request's
``output_kind`` decides what ``make_output`` returns (everything so far, only what is new, or only at the end).
The server's streaming and ``truespec bench``'s TTFT / TPOT read what this produces.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from truespec.core.sequence import Sequence
from truespec.engine.detokenizer import IncrementalDetokenizer
from truespec.engine.stop_checker import StopChecker
from truespec.outputs import CompletionOutput, RequestMetrics, RequestOutput
from truespec.sampling_params import RequestOutputKind

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, stop_checker: StopChecker) -> None:
        self.tokenizer = tokenizer
        self.stop_checker = stop_checker
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._num_sent: dict[str, int] = {}  # DELTA requests: output tokens already handed out

    def process(self, seq: Sequence, tokens: list[int], logprobs: list[dict[int, float]] | None,
                now: float | None = None) -> str | None:
        """Append ``tokens`` to ``seq`` one by one until one stops it; the finish reason, or None.
        Nothing after the stopping token is appended."""
        now = time.monotonic() if now is None else now
        if logprobs is None and not self.stop_checker.can_stop(seq, tokens):  # a step's tokens at once
            seq.output_token_ids += tokens
            seq.token_times += [now] * len(tokens)
            return None
        for i, token in enumerate(tokens):
            seq.output_token_ids.append(token)
            seq.token_times.append(now)
            if logprobs is not None:
                seq.output_logprobs.append(logprobs[i])
            reason = self.stop_checker.check(seq)
            if reason is not None:
                return reason
        return None

    @staticmethod
    def add_prompt_logprobs(seq: Sequence, entries: list[dict[int, float]]) -> None:
        """Append the prompt logprobs a prefill chunk gave (``SamplingParams.prompt_logprobs``)."""
        seq.prompt_logprobs += entries

    @staticmethod
    def wants_output(seq: Sequence) -> bool:
        """Whether ``seq`` hands out an output after a step that gave it tokens."""
        return seq.is_finished or seq.params.output_kind is not RequestOutputKind.FINAL_ONLY

    def make_output(self, seq: Sequence) -> RequestOutput | None:
        """The request's output after this step, as its ``output_kind`` asks (None: nothing to hand out)."""
        if not self.wants_output(seq):
            return None
        if seq.params.output_kind is RequestOutputKind.DELTA:
            first = self._num_sent.get(seq.request_id, 0)
            self._num_sent[seq.request_id] = len(seq.output_token_ids)
            text = self._text_delta(seq)
        else:
            first, text = 0, self._full_text(seq)
        if seq.is_finished:
            self.forget(seq.request_id)
        return _request_output(seq, text, first)

    def forget(self, request_id: str) -> None:
        self._detokenizers.pop(request_id, None)
        self._num_sent.pop(request_id, None)

    def _full_text(self, seq: Sequence) -> str:
        if seq.is_finished or self.tokenizer is None:
            return seq.output_text
        detok = self._detokenizer(seq)
        detok.update(seq.output_token_ids)
        return detok.text[:detok.num_emitted]

    def _text_delta(self, seq: Sequence) -> str:
        if self.tokenizer is None:  # skip_tokenizer_init: no text
            return ""
        detok = self._detokenizer(seq)
        if seq.is_finished:
            return detok.finish(seq.output_text)
        return detok.update(seq.output_token_ids)

    def _detokenizer(self, seq: Sequence) -> IncrementalDetokenizer:
        detok = self._detokenizers.get(seq.request_id)
        if detok is None:
            hold_back = max((len(s) for s in seq.params.stop), default=1) - 1  # a stop string may still cut them
            detok = IncrementalDetokenizer(self.tokenizer, seq.params.skip_special_tokens, hold_back)
            self._detokenizers[seq.request_id] = detok
        return detok


def _request_output(seq: Sequence, text: str, first: int) -> RequestOutput:
    """``seq``'s output from output token ``first`` on, with ``text``."""
    logprobs = seq.output_logprobs[first:] if seq.params.logprobs is not None else None
    cumulative = None
    if seq.params.logprobs is not None and seq.output_logprobs:
        cumulative = sum(lp[t] for lp, t in zip(seq.output_logprobs, seq.output_token_ids, strict=True))
    reason = seq.finish_reason if seq.is_finished else None
    out = CompletionOutput(0, text, seq.output_token_ids[first:], reason, seq.stop_reason, cumulative, logprobs)
    times = seq.token_times
    metrics = RequestMetrics(seq.arrival_time, times[0] if times else None, times[-1] if times else None,
                             seq.finished_time, list(times))
    # complete from the first output on (it follows the last prefill chunk); a DELTA stream has them in its first
    # output only, as vLLM
    prompt_logprobs = None if seq.prompt_logprobs is None else list(seq.prompt_logprobs) if first == 0 else []
    return RequestOutput(seq.request_id, seq.prompt, list(seq.prompt_token_ids), prompt_logprobs, [out],
                         seq.is_finished, metrics, seq.num_cached_tokens)
