"""One grammar matcher per constrained request; each step's token bitmask; the matchers advanced by what a step
emitted.

A step's logits rows are its requests' rows in order, ``num_logits`` each (1 + its drafts on its last chunk, none
for an earlier prefill chunk). Row j of a constrained request allows what the grammar allows after the request's
tokens and its drafts 0..j-1: the manager accepts each draft into the matcher before filling the next row, then
rolls them back. Past a draft the grammar rejects (or past the grammar's end) the rows stay all ones: they are
never sampled, because that draft's own row forbids it, so the target gives it probability 0 (greedy: it is not
the argmax; random: u * q(x) < p(x) = 0 never holds) and the rejection sampler stops there. After the step the
matcher accepts the emitted tokens (the accepted drafts and the new token): it holds the state of the request's
output so far, which a preemption (re-prefill of the same tokens) does not change.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from truespec.core.scheduler_output import ScheduledRequest
from truespec.sampling_params import SamplingParams
from truespec.structured_output.compiler import GrammarCompiler

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("truespec")


class StructuredOutputManager:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int, eos_token_ids: set[int],
                 disable_any_whitespace: bool = False) -> None:
        self.compiler = GrammarCompiler(tokenizer, vocab_size, eos_token_ids, disable_any_whitespace)
        self.num_words = -(-vocab_size // 32)  # int32 words per bitmask row
        self.matchers: dict[str, Any] = {}  # request id -> xgrammar.GrammarMatcher, for constrained requests

    def check(self, params: SamplingParams) -> None:
        """A ValueError naming the field if the request's constraint does not compile (compiled once, cached)."""
        if params.structured_outputs is not None:
            self.compiler.compile(params.structured_outputs)

    def add(self, request_id: str, params: SamplingParams) -> None:
        if params.structured_outputs is not None:
            import xgrammar as xgr  # loaded already by the compile in ``check``

            self.matchers[request_id] = xgr.GrammarMatcher(self.compiler.compile(params.structured_outputs))

    def forget(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)

    def is_constrained(self, request_id: str) -> bool:
        return request_id in self.matchers

    def bitmask(self, scheduled: list[ScheduledRequest]) -> torch.Tensor | None:
        """[rows, num_words] int32 on the host, one row per logits row of the step: bit t % 32 of word t // 32 set
        when token t may be sampled there (xgrammar's layout); all ones for a row without a constraint. None when
        no request of the step is constrained: the runner then fills the all-ones mask on the device itself."""
        if not self.matchers or not any(r.num_logits and r.request_id in self.matchers for r in scheduled):
            return None
        mask = torch.full((sum(r.num_logits for r in scheduled), self.num_words), -1, dtype=torch.int32)
        row = 0
        for r in scheduled:
            matcher = self.matchers.get(r.request_id)
            if matcher is not None and r.num_logits:
                _fill_rows(matcher, r.draft_token_ids, mask, row)
            row += r.num_logits
        return mask

    def accept(self, request_id: str, tokens: list[int]) -> None:
        """Advance the request's matcher past the tokens a step emitted (nothing once the grammar has ended)."""
        matcher = self.matchers.get(request_id)
        for token in tokens if matcher is not None else []:
            if matcher.is_terminated():
                return
            if not matcher.accept_token(token):  # only when every token was masked (min_tokens banning the EOS
                # the grammar needed): the request goes on unconstrained rather than failing mid-batch
                logger.warning("request %s emitted token %d, which its grammar does not allow: it goes on without "
                               "its structured output constraint", request_id, token)
                self.forget(request_id)
                return


def _fill_rows(matcher: Any, draft_token_ids: list[int], mask: torch.Tensor, row: int) -> None:
    """Rows row .. row + len(drafts): the grammar's next-token bitmask after each prefix of the drafts, up to the
    first draft it rejects or its end; the matcher is left as it was."""
    num_accepted = 0
    for j in range(1 + len(draft_token_ids)):
        if matcher.is_terminated():  # the stop token was accepted: nothing is constrained after it
            break
        matcher.fill_next_token_bitmask(mask, row + j)
        if j == len(draft_token_ids) or not matcher.accept_token(draft_token_ids[j]):
            break
        num_accepted += 1
    if num_accepted:
        matcher.rollback(num_accepted)
