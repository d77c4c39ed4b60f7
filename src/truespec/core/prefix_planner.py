"""What prefix caching adds to scheduling (plain Python, no torch): a new request's cached prefix, prefill chunks
that end at state checkpoints, and the state copies a step carries.

- **Admission**: a new (or preempted) request starts after the longest cached prefix it can use
  (``KVCacheManager.find_prefix``): its table begins with the shared blocks, and on a hybrid model the checkpoint
  of the state after that prefix is copied into slot 0 of its group before its first chunk runs (a *restore*).
- **Progress**: before each step, every running request's newly completed blocks are cached, and where its previous
  step passed a checkpoint position (kv_cache/state_checkpoints.py) the state there is copied out of its group into
  a checkpoint slot (a *save*). A step keeps the state after query token ``i`` in group slot ``i - write_start``
  (``write_start`` = its sequence tokens - 1: a prefill chunk keeps only its end, a decode / verify every position
  it computed), so the state after position ``P`` is in slot ``P - start - num_new_tokens``, for ``P`` from the
  end of its sequence tokens to its last accepted token.
- **Only prompt positions are cached** (blocks and checkpoints up to the prompt's length): on CUDA a prompt position
  and a generated one are computed by different attention kernels (kernels/prefill_attention.py for positions
  before the prompt's end, the split-KV kernel for decodes and verifies), so a generated position's KV is not what a
  later request that has it in its prompt would compute; sharing it would change that request's tokens.
- **Chunks**: on a hybrid model a prefill chunk never runs past the next checkpoint position, so every prompt leaves
  its checkpoints behind.

- **GDN prefill path** (a ``GdnPrefillRule``, core/gdn_prefill_rule.py): a long prompt's blocks are keyed under a
  root of their own (fla computed their GDN states, the token loop a short prompt's) and its checkpoints sit only at
  multiples of ``lcm(block_size, alignment)``, so its cache hits start where its chunks may be cut.

Saves, then restores, run on the device at the start of the next step that runs, before its forward (outside any
CUDA graph: ``SchedulerOutput.state_saves`` / ``state_restores``), so nothing overwrites a slot before it is copied.
A verify queued ahead (engine/async_scheduler.py) keeps no record of its verifies, whose progress the host
never sees, so their positions save nothing; its prompt chunks (of requests joining, or going on) are recorded
as in any step, and the saves they pass ride the step planned after them.
"""

import math

from truespec.core.gdn_prefill_rule import GdnPrefillRule
from truespec.core.sequence import PLACEHOLDER, Sequence
from truespec.kv_cache.manager import NO_HIT, KVCacheManager, PrefixHit
from truespec.kv_cache.prefix_cache import ROOT_KEY, BlockKey
from truespec.kv_cache.state_checkpoints import is_checkpoint_position, next_checkpoint_position


class PrefixPlanner:
    def __init__(self, kv: KVCacheManager, gdn_rule: GdnPrefillRule | None = None) -> None:
        self.kv = kv
        self.gdn_rule = gdn_rule
        self.is_enabled = kv.prefix is not None
        self.needs_checkpoints = self.is_enabled and kv.prefix.needs_checkpoints
        self._steps: dict[str, tuple[int, int, int]] = {}  # request -> (start, new tokens, first slot) of its step
        self._saves: list[tuple[int, int]] = []  # (group slot, checkpoint slot) not yet handed to a step

    # ---- admission ---------------------------------------------------------------------------------
    def find(self, seq: Sequence) -> PrefixHit:
        """A request with prompt logprobs computes every prompt position (its logits give them), as in vLLM."""
        if not self.is_enabled or seq.params.prompt_logprobs is not None:
            return NO_HIT
        return self.kv.find_prefix(seq.request_id, seq.token_slice(0, _num_known_tokens(seq)), self._key_root(seq))

    def take(self, seq: Sequence, hit: PrefixHit, restores: list[tuple[int, int]]) -> None:
        """``seq`` (admitted, its state group allocated) starts after ``hit``. Counted once per request."""
        is_first = seq.num_preemptions == 0
        self.kv.take_prefix(seq.request_id, hit, seq.num_tokens if is_first else None)
        if is_first:
            seq.num_cached_tokens = hit.num_tokens
        seq.num_computed_tokens = hit.num_tokens
        if hit.checkpoint_slot is not None:
            restores.append((hit.checkpoint_slot, self.kv.first_state_slot(seq.request_id)))

    # ---- chunks ------------------------------------------------------------------------------------
    def chunk_limit(self, seq: Sequence) -> int | None:
        """The most tokens ``seq``'s next chunk may compute (up to the next checkpoint position); None: no limit."""
        if not self.needs_checkpoints:
            return None
        start = seq.num_computed_tokens
        return next_checkpoint_position(start, seq.prompt_len, *self._checkpoint_grid(seq)) - start

    def scheduled(self, seq: Sequence, num_new_tokens: int, first_state_slot: int) -> None:
        if self.is_enabled:
            self._steps[seq.request_id] = (seq.num_computed_tokens, num_new_tokens, first_state_slot)

    def forget_step(self, request_id: str) -> None:
        """The request's group no longer holds its last step's states as the host planned them."""
        self._steps.pop(request_id, None)

    # ---- progress ----------------------------------------------------------------------------------
    def progress(self, seq: Sequence, is_finished: bool = False, computed: int | None = None) -> None:
        """Cache ``seq``'s completed blocks and save the checkpoints its last step passed. ``is_finished``: it
        finished in that step, so a model drafter never caught up on the step's positions: they are not cached.
        ``computed``: the tokens computed after that step when ``seq`` does not say it yet (a step planned ahead of
        reading it: its prompt positions are known)."""
        kv, request_id, bs = self.kv, seq.request_id, self.kv.block_size
        step = self._steps.pop(request_id, None)
        if (step is None or step[0] >= seq.prompt_len) and kv.num_cached_blocks_of(request_id) >= seq.prompt_len // bs:
            return  # a step past the prompt (no checkpoint there), every prompt block cached: the common decode
        computed = seq.num_computed_tokens if computed is None else computed
        if is_finished and kv.prefix.has_drafter_cache:
            computed = step[0] if step is not None else 0
        computed = min(computed, seq.prompt_len)  # only prompt positions are shared (module docstring)
        known = _num_known_tokens(seq)
        if min(computed, known - kv.prefix.extra_tokens) // bs > kv.num_cached_blocks_of(request_id):
            kv.cache_blocks(request_id, seq.token_slice(0, known), computed, self._key_root(seq))
        if step is None or not self.needs_checkpoints:
            return
        start, num_new, first_slot = step
        grid = self._checkpoint_grid(seq)
        for position in range(-(-(start + num_new) // bs) * bs, computed + 1, bs):
            if is_checkpoint_position(position, seq.prompt_len, *grid):
                slot = kv.add_checkpoint(request_id, position)
                if slot is not None:
                    self._saves.append((first_slot + position - start - num_new, slot))

    def _is_long(self, seq: Sequence) -> bool:
        return self.gdn_rule is not None and self.gdn_rule.is_long(seq.prompt_len)

    def _key_root(self, seq: Sequence) -> BlockKey:
        """The root of ``seq``'s chained block keys: a long prompt's (fla's GDN states) apart from a short one's."""
        return ROOT_KEY + b"fla" if self._is_long(seq) else ROOT_KEY

    def _checkpoint_grid(self, seq: Sequence) -> tuple[int, int]:
        """(interval, alignment) of ``seq``'s checkpoint positions: block multiples, for a long prompt multiples of
        ``GdnPrefillRule.checkpoint_grid`` (interval positions off that grid are skipped)."""
        interval, bs = self.kv.prefix.checkpoint_interval, self.kv.block_size
        if not self._is_long(seq):
            return interval, bs
        grid = self.gdn_rule.checkpoint_grid(bs)
        return math.lcm(interval, grid), grid

    def take_saves(self) -> list[tuple[int, int]]:
        saves, self._saves = self._saves, []
        return saves

    def discard_saves(self, saves: list[tuple[int, int]]) -> None:
        """A step that carried ``saves`` failed, maybe before they ran: forget their checkpoints."""
        for _, slot in saves:
            self.kv.checkpoints.discard_slot(slot)


def _num_known_tokens(seq: Sequence) -> int:
    """Tokens known on the host: an async step's placeholder at the end is not."""
    known = seq.num_tokens
    while known > seq.prompt_len and seq.output_token_ids[known - seq.prompt_len - 1] == PLACEHOLDER:
        known -= 1
    return known
