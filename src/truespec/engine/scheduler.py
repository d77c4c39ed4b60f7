"""Continuous batching with chunked prefill and preemption by recompute (pure Python, no torch).

Each step gets a token budget (``max_num_batched_tokens``). Running requests go first, in arrival
order: a decoding request takes 1 token plus the drafts it verifies, a request still prefilling takes
the next chunk of its prompt. Then waiting requests are admitted while the budget, ``max_num_seqs``, KV blocks and state
groups allow. When a running request cannot get the KV blocks it needs, the most recently admitted
running request is preempted: its blocks and state group are freed and it restarts its prefill
(prompt + output so far) later, so its output is unchanged.
"""

from collections import deque
from dataclasses import dataclass, field

from truespec.engine.block_manager import BlockManager
from truespec.engine.sequence import Sequence, SequenceStatus
from truespec.engine.state_manager import StateManager


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens of the sequence computed this step (prefill chunk, or 1 for a decode)
    draft_token_ids: list[int] = field(default_factory=list)  # drafts verified after them (decodes only)
    start: int = field(init=False)  # tokens the request had cached when scheduled
    # True when this step computes up to the request's last token, so a new token is sampled
    is_last_chunk: bool = field(init=False)

    def __post_init__(self) -> None:
        self.start = self.seq.num_computed_tokens
        self.is_last_chunk = self.start + self.num_new_tokens == self.seq.num_tokens

    @property
    def query_len(self) -> int:
        return self.num_new_tokens + len(self.draft_token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(self, block_manager: BlockManager, state_manager: StateManager, max_num_seqs: int,
                 max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.state_manager = state_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0  # total since start, for tests and metrics

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i, skipped = 0, []
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            plan = self._plan(seq, budget)
            if plan is None:  # a verify that does not fit this step waits whole (its drafts are never cut)
                skipped.append(seq)
                i += 1
                continue
            n, drafts = plan
            if not self._make_room(seq, n + len(drafts), out):
                continue  # seq itself was preempted (it was the last running one)
            self.block_manager.allocate(seq, n + len(drafts))
            out.scheduled.append(ScheduledSeq(seq, n, drafts))
            budget -= n + len(drafts)
            i += 1
        skipped += self.running[i:]  # not reached: the budget ran out
        if skipped:  # whoever waited this step goes first in the next (stable: otherwise arrival order)
            waited = set(map(id, skipped))
            self.running.sort(key=lambda s: id(s) not in waited)
        if not out.preempted:
            self._admit(budget, out)
        return out

    def _plan(self, seq: Sequence, budget: int) -> tuple[int, list[int]] | None:
        """(tokens of ``seq`` to compute, drafts to verify after them) within ``budget``; None: wait.

        Drafts ride on a request's last chunk (a decode, or the end of a re-prefill after preemption) and
        are cut only by limits of the request itself, never by the rest of the batch: so a request verifies
        the same drafts alone or in any batch, and its seeded random draws stay batch invariant."""
        remaining = seq.num_uncomputed_tokens
        drafts = seq.draft_token_ids[:self.max_drafts(seq)]
        if remaining + len(drafts) <= budget:
            return remaining, drafts
        if remaining > 1:
            return min(remaining - 1, budget), []  # a prefill chunk; the drafts wait for the last one
        return None

    def max_drafts(self, seq: Sequence) -> int:
        """Drafts a request may verify in one step: what fits a step's budget beside its input token, and
        what it may still emit. Depends on the request alone (the proposer drafts no more than this)."""
        return max(0, min(self.max_num_batched_tokens - 1, seq.max_output_len - len(seq.output_token_ids) - 1))

    def _make_room(self, seq: Sequence, num_new_tokens: int, out: SchedulerOutput) -> bool:
        while not self.block_manager.can_allocate(seq, num_new_tokens):
            victim = self.running[-1]
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _admit(self, budget: int, out: SchedulerOutput) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            plan = self._plan(seq, budget)
            if plan is None:
                break
            n, drafts = plan
            if not (self.state_manager.can_allocate() and self.block_manager.can_allocate(seq, n + len(drafts))):
                break
            self.waiting.popleft()
            self.state_manager.allocate(seq)
            self.block_manager.allocate(seq, n + len(drafts))
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n, drafts))
            budget -= n + len(drafts)

    def preempt(self, seq: Sequence) -> None:
        """Free everything ``seq`` holds; it recomputes its prefill (prompt + output) later."""
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed_tokens = 0  # its drafts stay: they ride on the last chunk of the re-prefill
        seq.num_drafter_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished (or aborted) and return its blocks and state group."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _release(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        self.state_manager.free(seq)
