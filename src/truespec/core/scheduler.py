"""Continuous batching with chunked prefill and preemption by recompute (pure Python, no torch).

Each step gets a token budget (``max_num_batched_tokens``). Running requests go first, in arrival order, each
computing what core/chunk_planner.py gives it (a decode and its drafts, or the next chunk of a prompt, within the
budget and the step's prefill cap), with the KV blocks it must hold. Then waiting requests are admitted while the
budget, ``max_num_seqs``, KV blocks and state groups allow. When a running request cannot get the KV blocks it
needs, the most recently admitted running request is preempted: its blocks and state group are freed and it
restarts its prefill (prompt + output so far) later, so its output is unchanged.

With prefix caching a request is admitted after its longest cached prefix, and its progress is cached before each
step (core/prefix_planner.py). With async scheduling the next step may be planned before the current one is read
(``schedule_verify_ahead``, engine/verify_plan.py).
"""

import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from truespec.core.chunk_planner import ChunkPlanner
from truespec.core.gdn_prefill_rule import GdnPrefillRule
from truespec.core.prefix_planner import PrefixPlanner
from truespec.core.scheduler_output import ScheduledRequest, SchedulerOutput
from truespec.core.sequence import PLACEHOLDER, Sequence, SequenceStatus, token_slice
from truespec.kv_cache.manager import KVCacheManager


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 num_lookahead_tokens: int = 0, long_prefill_token_threshold: int | None = None,
                 gdn_rule: GdnPrefillRule | None = None) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0  # total since start, for tests and metrics
        self._finished_ids: list[str] = []  # reported in the next SchedulerOutput
        self.gdn_rule = gdn_rule
        self.prefix = PrefixPlanner(kv, gdn_rule)
        self.chunks = ChunkPlanner(self.prefix, max_num_batched_tokens, num_lookahead_tokens,
                                   long_prefill_token_threshold, gdn_rule)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def unreported_finished_ids(self) -> list[str]:
        """Requests finished since the last step that ran (the next one reports them); a copy."""
        return list(self._finished_ids)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.prefix.is_enabled:
            for seq in self.running:
                self.prefix.progress(seq)
        budget = self.max_num_batched_tokens
        self.chunks.start_step(is_decoding=any(seq.num_uncomputed_tokens <= 1 for seq in self.running))
        i, skipped = 0, []
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            plan = self.chunks.plan(seq, budget)
            if plan is None:  # a verify that does not fit this step waits whole (its drafts are never cut)
                skipped.append(seq)
                i += 1
                continue
            n, drafts = plan
            num_tokens = self.chunks.tokens_to_hold(seq, n, drafts)
            if not self._make_room(seq, num_tokens, out):
                continue  # seq itself was preempted (it was the last running one)
            out.scheduled.append(self._scheduled_request(seq, n, drafts, num_tokens))
            budget -= n + len(drafts)
            i += 1
        skipped += self.running[i:]  # not reached: the budget ran out
        if skipped:  # whoever waited this step goes first in the next (stable: otherwise arrival order)
            waited = set(map(id, skipped))
            self.running.sort(key=lambda s: id(s) not in waited)
        if not out.preempted_req_ids:
            self._admit(budget, out)
        if out.scheduled:  # reported with a step that runs (an empty one is never launched)
            out.finished_req_ids, self._finished_ids = self._finished_ids, []
            out.state_saves = self.prefix.take_saves()
        return out

    def schedule_verify_ahead(self, plans: list[tuple[Sequence, int, int, int | None]],
                              may_admit: Callable[[Sequence, int], bool] | None = None) -> SchedulerOutput | None:
        """The next step of every running request, planned while the current one runs (speculative steps queued
        ahead): per request (seq, first query position as if nothing is accepted now, drafts it verifies, positions
        its blocks must cover). The device moves each request past what it accepts and supplies the token and
        drafts, so the host lists placeholders. A request whose current step is an earlier chunk of its prompt
        (positions None) goes on with its next chunk, planned from that position as ``schedule`` would, its ids
        known on the host. Nothing is preempted: None when the blocks or the budget do not fit. Waiting
        requests are admitted after them as ``schedule`` admits them (their prompt tokens known on the host), while
        ``may_admit(seq, num_tokens)`` agrees (None: none is)."""
        kv = self.kv
        # the plan's verifies decode (a request whose last chunk runs now among them, not yet applied to it)
        self.chunks.start_step(is_decoding=any(hold is not None for *_, hold in plans))
        going_on = self._next_chunks(plans)
        if going_on is None or sum(kv.num_blocks_needed(seq.request_id, going_on.get(seq.request_id, (0, hold))[1])
                                 for seq, _, _, hold in plans) > kv.num_free_blocks:
            return None
        out = SchedulerOutput()
        for seq, start, num_drafts, hold in plans:
            # its last step's prompt positions (through ``start``) are known: cached now; what it accepts is known on
            # the device only, so the step's record goes (``progress`` drops it; without prefix caching there is none)
            if self.prefix.is_enabled:
                self.prefix.progress(seq, computed=start)
            if hold is None:  # a prompt going on: its next chunk, planned from ``start``
                n, hold = going_on[seq.request_id]
                with _computed_from(seq, start):
                    out.scheduled.append(self._scheduled_request(seq, n, [], hold))
                continue
            ids, block_ids = [PLACEHOLDER] * (1 + num_drafts), kv.allocate(seq.request_id, hold)
            out.scheduled.append(ScheduledRequest(
                seq.request_id, seq.params, start, 1 + num_drafts, ids, ids[1:], None, block_ids,
                kv.first_state_slot(seq.request_id), 0, len(seq.output_token_ids) + 1, True, seq.prompt_len,
                gdn_chunked=self._gdn_chunked(seq)))
        if may_admit is not None:
            self._admit(self.max_num_batched_tokens - sum(r.num_scheduled_tokens for r in out.scheduled), out,
                        may_admit)
        out.finished_req_ids, self._finished_ids = self._finished_ids, []
        out.state_saves = self.prefix.take_saves()
        return out

    def _next_chunks(self, plans: list[tuple[Sequence, int, int, int | None]]) -> dict[str, tuple[int, int]] | None:
        """Per prompt going on in a step planned ahead (``hold`` None): the tokens of its next chunk, planned from
        its ``start`` in the budget the verifies leave as ``schedule`` plans it, and the positions its blocks must
        cover. None when one cannot run now (the budget, or a chunk with drafts: a re-prefill's last)."""
        budget = self.max_num_batched_tokens - sum(1 + d for _, _, d, hold in plans if hold is not None)
        chunks = {}
        for seq, start, _, hold in plans:
            if hold is None:
                with _computed_from(seq, start):
                    plan = self.chunks.plan(seq, budget) if budget > 0 else None
                    if plan is None or plan[1]:
                        return None
                    chunks[seq.request_id] = (plan[0], self.chunks.tokens_to_hold(seq, *plan))
                budget -= plan[0]
        return chunks

    def report_finished(self, request_ids: list[str]) -> None:
        """Report these finished requests again with the next step (the step that carried them failed)."""
        self._finished_ids += request_ids

    def _scheduled_request(self, seq: Sequence, n: int, drafts: list[int], num_tokens: int) -> ScheduledRequest:
        """Allocate the blocks for ``num_tokens`` positions and describe the step's work for the runner."""
        request_id, start, end = seq.request_id, seq.num_computed_tokens, seq.num_computed_tokens + n
        block_ids = self.kv.allocate(request_id, num_tokens)
        first_state_slot = self.kv.first_state_slot(request_id)
        self.prefix.scheduled(seq, n, first_state_slot)
        token_ids = token_slice(seq.prompt_token_ids, seq.output_token_ids, start, end) + drafts
        return ScheduledRequest(  # positional, in field order: this runs for every request of every step
            request_id, seq.params, start, n + len(drafts), token_ids, drafts, seq.draft_probs if drafts else None,
            block_ids, first_state_slot, seq.state_index, len(seq.output_token_ids), end == seq.num_tokens,
            seq.prompt_len, seq.prompt_logprobs_due(start, end) if seq.prompt_logprobs is not None else [],
            self._gdn_chunked(seq))

    def _gdn_chunked(self, seq: Sequence) -> bool | None:
        """Whether the request's prompt chunks run fla's chunk kernel (None: no rule, the layer decides by length)."""
        return None if self.gdn_rule is None else self.gdn_rule.is_long(seq.prompt_len)

    def _make_room(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        while not self.kv.can_allocate(seq.request_id, num_tokens):
            victim = self.running[-1]
            self.preempt(victim)
            out.preempted_req_ids.append(victim.request_id)
            if victim is seq:
                return False
        return True

    def _admit(self, budget: int, out: SchedulerOutput,
               may_admit: Callable[[Sequence, int], bool] | None = None) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hit = self.prefix.find(seq)
            seq.num_computed_tokens = hit.num_tokens  # planned from there (back to 0 if it is not admitted)
            plan = self.chunks.plan(seq, budget)
            num_tokens = self.chunks.tokens_to_hold(seq, *plan) if plan is not None else 0
            if plan is None or not (self.kv.can_allocate_state() and
                                    self.kv.can_allocate(seq.request_id, num_tokens, hit)) or \
                    may_admit is not None and not may_admit(seq, plan[0]):
                seq.num_computed_tokens = 0
                break
            n, drafts = plan
            self.waiting.popleft()
            self.kv.allocate_state(seq.request_id)
            self.prefix.take(seq, hit, out.state_restores)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(self._scheduled_request(seq, n, drafts, num_tokens))
            budget -= n + len(drafts)

    def preempt(self, seq: Sequence) -> None:
        """Free everything ``seq`` holds; it recomputes its prefill (prompt + output) later."""
        self.running.remove(seq)
        self.kv.free(seq.request_id)
        self.prefix.forget_step(seq.request_id)
        seq.num_computed_tokens = 0  # its drafts stay: they ride on the last chunk of the re-prefill
        seq.state_index = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished (or aborted) and return its blocks and state group."""
        if seq in self.running:
            if self.prefix.is_enabled:  # what its last step computed stays cached
                self.prefix.progress(seq, is_finished=True)
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.forget(seq.request_id)
        self.prefix.forget_step(seq.request_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finished_time = time.monotonic()
        self._finished_ids.append(seq.request_id)


@contextmanager
def _computed_from(seq: Sequence, start: int) -> Iterator[None]:
    """``seq`` seen as having computed ``start`` tokens (a step planned before the host applied the one before it)."""
    saved, seq.num_computed_tokens = seq.num_computed_tokens, start
    try:
        yield
    finally:
        seq.num_computed_tokens = saved
