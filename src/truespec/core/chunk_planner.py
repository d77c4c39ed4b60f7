"""How much of a request one step computes, and the KV positions it must hold for it (pure Python, no torch).

A decoding request computes 1 token plus the drafts it verifies; a request still prefilling computes the next chunk
of its prompt (and, after preemption, of its output so far). Drafts ride on a request's last chunk and are cut only by
limits of the request itself, never by the rest of the batch: so a request verifies the same drafts alone or in
any batch, and its seeded random draws stay batch invariant.

A chunk ends where the step's budget ends, and earlier:
- on a hybrid model with prefix caching, at the next state checkpoint position (core/prefix_planner.py);
- at the step's prefill cap: a long prompt joining running requests would stall their decodes for a whole step of
  ``max_num_batched_tokens`` prompt tokens (on an H100, 8,192-token chunks of a 32K prompt held 8 decoding
  requests' next tokens for 180-963 ms). ``long_prefill_token_threshold`` (vLLM's setting) caps the prompt tokens
  one request computes in a step: a positive value always; 0 never; None (the default) caps at
  ``AUTO_LONG_PREFILL_TOKENS`` only while some request decodes in the step, so a prompt alone still gets the
  whole budget;
- with a ``GdnPrefillRule`` (core/gdn_prefill_rule.py: fla runs the GDN prefill of long prompts), a long request's
  chunks that end inside its prompt end at multiples of the rule's alignment, and no chunk crosses its prompt's
  end: fla's results then do not depend on how the prompt was cut (a cut chunk's drafts wait).

Blocks: every position a step writes, i.e. the query, and on a request's last chunk ``num_lookahead_tokens`` more
for the drafts a model drafter writes after the step (vLLM's lookahead slots); on an earlier chunk one more than
that, for a model drafter drafting behind the step on the device (spec_decode/device_drafts.py).
"""

from truespec.core.gdn_prefill_rule import GdnPrefillRule
from truespec.core.prefix_planner import PrefixPlanner
from truespec.core.sequence import Sequence

# ~22 ms of prefill per step on an H100 for the Qwen3.5-0.8B shape (~11 us a prompt token at 8K, BENCHMARKS.md
# "Session 11"); a multiple of 64, so chunks it cuts start where fla's 64-token chunks do
AUTO_LONG_PREFILL_TOKENS = 2048


class ChunkPlanner:
    def __init__(self, prefix: PrefixPlanner, max_num_batched_tokens: int, num_lookahead_tokens: int = 0,
                 long_prefill_token_threshold: int | None = None, gdn_rule: GdnPrefillRule | None = None) -> None:
        self.prefix, self.gdn_rule = prefix, gdn_rule
        self.max_num_batched_tokens = max_num_batched_tokens
        self.num_lookahead_tokens = num_lookahead_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.prefill_cap: int | None = None  # this step's cap on a request's prompt tokens (None: none)

    def start_step(self, is_decoding: bool) -> None:
        """Set the step's prefill cap: ``is_decoding``, whether a request decodes (or verifies) in it."""
        no_cap = self.long_prefill_token_threshold is None and not is_decoding
        self.prefill_cap = None if no_cap else self.mixed_prefill_cap

    @property
    def mixed_prefill_cap(self) -> int | None:
        """The most prompt tokens a request computes in a step beside decodes (None: the budget's)."""
        threshold = self.long_prefill_token_threshold
        return AUTO_LONG_PREFILL_TOKENS if threshold is None else threshold or None

    def plan(self, seq: Sequence, budget: int) -> tuple[int, list[int]] | None:
        """(tokens of ``seq`` to compute, drafts to verify after them) within ``budget``; None: wait."""
        if seq.num_tokens - seq.num_computed_tokens == 1:  # a decode / verify (the fast path of every step)
            drafts = seq.draft_token_ids[:self.max_drafts(seq)] if seq.draft_token_ids else []
            return (1, drafts) if 1 + len(drafts) <= budget else None  # no chunk limit, no GDN rule cut applies
        is_long = self.gdn_rule is not None and self.gdn_rule.is_long(seq.prompt_len)
        plan = self._plan_tokens(seq, budget, is_long)
        if plan is None or not is_long:
            return plan
        n, drafts = plan
        cut = self.gdn_rule.chunk_len(seq.num_computed_tokens, n, seq.prompt_len)
        if cut <= 0:
            return None
        return (n, drafts) if cut == n else (cut, [])

    def _plan_tokens(self, seq: Sequence, budget: int, is_long: bool) -> tuple[int, list[int]] | None:
        remaining = seq.num_uncomputed_tokens
        drafts = seq.draft_token_ids[:self.max_drafts(seq)]
        limit = self.prefix.chunk_limit(seq) if remaining > 1 else None
        if self.prefill_cap is not None and remaining > 1:
            cap = self.gdn_rule.prefill_cap(self.prefill_cap) if is_long else self.prefill_cap
            limit = min(limit or cap, cap)
        if remaining + len(drafts) <= budget and (limit is None or remaining <= limit):
            return remaining, drafts
        if remaining > 1:
            return min(remaining - 1, budget, limit or budget), []  # a prefill chunk; the drafts wait for the last
        return None

    def max_drafts(self, seq: Sequence) -> int:
        """Drafts a request may verify in one step: what fits a step's budget beside its input token, and
        what it may still emit. Depends on the request alone (proposers draft no more than this)."""
        return max(0, min(self.max_num_batched_tokens - 1, seq.max_output_len - len(seq.output_token_ids) - 1))

    def tokens_to_hold(self, seq: Sequence, n: int, drafts: list[int]) -> int:
        """Positions the request's blocks must cover after a step computing ``n`` tokens and ``drafts``: its query,
        plus the lookahead after a last chunk (``hold_after_last_chunk``), and after an earlier chunk one more than
        that (never past its longest length): a model drafter drafting behind the step on the device writes the
        request's discarded drafts up to ``device_reach`` + 1 positions past the chunk (a draft model's ``k + 1``,
        a head's ``k``), positions of its next chunk or of its lookahead after its last, held then anyway."""
        end = seq.num_computed_tokens + n + len(drafts)
        if end == seq.num_tokens + len(drafts):
            return self.hold_after_last_chunk(seq, end)
        return min(end + self.num_lookahead_tokens + 1, seq.prompt_len + seq.max_output_len) \
            if self.num_lookahead_tokens else end

    def hold_after_last_chunk(self, seq: Sequence, end: int) -> int:
        """Positions the request's blocks must cover after a step whose query (its last chunk) ends at ``end``: the
        query plus the lookahead a model drafter writes after it, never past the request's longest possible length."""
        if not self.num_lookahead_tokens:
            return end
        return min(end + self.num_lookahead_tokens, seq.prompt_len + seq.max_output_len)
