"""Which prompts' GDN prefill runs fla's chunked kernel, and the chunk cuts that keep it chunking-invariant (plain
Python, no torch).

fla's ``chunk_gated_delta_rule`` (kernels/gdn_chunked.py) computes the recurrence 64 tokens at a time counted from
each call's start, in another order than the token loop (``gdn_recurrent``), which decodes use. Measured on an H100
(benchmarks/fla_chunk_invariance.py): one fla call over a prompt and two calls cut at position ``c`` (the second from
the first's final state) agree bit for bit when ``c`` is a multiple of 64 and differ otherwise. So with this rule a
request's GDN path is decided by its prompt length, never by how its prompt happened to be chunked:

- a request is *long* iff ``prompt_len >= min_prompt_len``; every chunk of a long request whose rows are all prompt
  rows runs fla, whatever its length; everything else (short requests, decodes, verifies, output positions
  recomputed after preemption) runs the token loop;
- a long request's chunks that end inside its prompt end at a multiple of ``alignment`` (absolute positions), and a
  chunk never crosses its prompt's end;
- its prefix-cache checkpoints sit at multiples of ``lcm(block_size, alignment)`` and its block keys are salted with
  the path, so a cache hit resumes on the grid and never mixes fla and token-loop states.

The engine creates a rule only when fla will run (engine/llm_engine.py); None keeps the length rule of
kernels/gdn_chunked.py per chunk.
"""

import math
from dataclasses import dataclass

FLA_CHUNK_SIZE = 64  # fla's chunk length: a call's 64-token chunks count from its first token


@dataclass(frozen=True)
class GdnPrefillRule:
    min_prompt_len: int  # prompts this long take fla's chunk kernel (kernels/gdn_chunked.MIN_CHUNK_LEN)
    alignment: int = FLA_CHUNK_SIZE  # chunk cuts inside a long prompt fall on multiples of this

    def __post_init__(self) -> None:
        if self.alignment <= 0 or self.min_prompt_len < self.alignment:
            raise ValueError(f"GdnPrefillRule needs 0 < alignment <= min_prompt_len, got {self}")

    @classmethod
    def create(cls, min_prompt_len: int | None, max_num_batched_tokens: int) -> "GdnPrefillRule | None":
        """The rule when fla runs GDN prefill (``min_prompt_len`` given) and a step fits two aligned chunks (so a
        long request alone always progresses); else None."""
        if min_prompt_len is None or max_num_batched_tokens < 2 * FLA_CHUNK_SIZE:
            return None
        return cls(min_prompt_len)

    def is_long(self, prompt_len: int) -> bool:
        return prompt_len >= self.min_prompt_len

    def chunk_len(self, start: int, num_tokens: int, prompt_len: int) -> int:
        """How many of ``num_tokens`` planned from position ``start`` a long request computes: up to its prompt's end
        if the chunk would cross it, else down to a multiple of ``alignment`` (0: none fits, it waits)."""
        end = start + num_tokens
        if start >= prompt_len or end == prompt_len:
            return num_tokens
        if end > prompt_len:
            return prompt_len - start
        return end // self.alignment * self.alignment - start

    def prefill_cap(self, cap: int) -> int:
        """A cap on a long request's prompt tokens per step that still lets it progress by one aligned chunk."""
        return max(cap, self.alignment)

    def checkpoint_grid(self, block_size: int) -> int:
        """The positions a long request's state checkpoints may sit at are multiples of this."""
        return math.lcm(block_size, self.alignment)
