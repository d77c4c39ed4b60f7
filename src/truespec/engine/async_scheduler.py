"""Async scheduling (vLLM's ``async_scheduling``): queue step N+1 on the device before reading step N's tokens.

Done only for steps in which every running request decodes greedily on, one token, without drafts, logprobs (of
its output or of its prompt) or a waiting request that could be admitted: then step N+1 is the decode of the same
requests, and its input ids can be copied on the device from step N's argmax. What no token value changes is
done ahead (positions, KV blocks, state slots); each request gets a placeholder token that the engine replaces
once N's tokens are read.
A request that stops at N has its queued token discarded: the KV and state that token wrote went to blocks and
slots it held, and anything that reuses them later is queued after it on the same stream. Each request's rows
are computed as without the overlap (docs/ARCHITECTURE.md, invariant 1), so outputs are unchanged
(tests/test_async_scheduling.py).
"""

from truespec.core.scheduler import Scheduler
from truespec.core.sequence import PLACEHOLDER, Sequence
from truespec.worker.model_runner import LaunchedStep, ModelRunner


class AsyncScheduler:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, seqs: dict[str, Sequence], enabled: bool) -> None:
        self.scheduler, self.runner, self.seqs = scheduler, runner, seqs
        self.enabled = enabled
        self.inflight: LaunchedStep | None = None  # a queued step, collected by the next engine step
        self.num_async_steps = 0  # steps queued before the previous one's tokens were read

    def take(self) -> LaunchedStep | None:
        launched, self.inflight = self.inflight, None
        return launched

    def launch_next(self, launched: LaunchedStep) -> bool:
        """If every request of ``launched`` goes on to a greedy one-token decode, advance them past it with a
        placeholder token and queue the next step. True if it did."""
        seqs = self._next_decodes(launched)
        if seqs is None:
            return False
        for r, seq in zip(launched.sched.scheduled, seqs, strict=True):
            seq.advance(r.num_new_tokens, 0)
            seq.output_token_ids.append(PLACEHOLDER)
        out = self.scheduler.schedule()
        if [r.request_id for r in out.scheduled] != [s.request_id for s in seqs] or out.preempted_req_ids \
                or any(r.num_scheduled_tokens != 1 for r in out.scheduled):
            raise RuntimeError(f"async scheduling: the next step is not the decode of {seqs} it was planned as")
        self.inflight = self.runner.launch(out, input_ids_from=launched.argmax)
        self.num_async_steps += 1
        return True

    def _next_decodes(self, launched: LaunchedStep) -> list[Sequence] | None:
        """The requests of ``launched`` if the next step can be planned now, else None."""
        sched = self.scheduler
        if not self.enabled or (sched.waiting and len(sched.running) < sched.max_num_seqs):
            return None  # the next step may admit a waiting request: its prompt goes in a step planned on the host
        seqs = [self.seqs.get(r.request_id) for r in launched.sched.scheduled]
        if seqs != sched.running or len(seqs) > sched.max_num_batched_tokens:
            return None
        blocks = 0
        for r, seq in zip(launched.sched.scheduled, seqs, strict=True):
            p = r.params
            if (not r.is_last_chunk or r.draft_token_ids or not p.is_greedy or p.logprobs is not None
                    or r.prompt_logprob_token_ids or len(seq.output_token_ids) + 2 > seq.max_output_len):
                return None
            blocks += sched.kv.num_blocks_needed(seq.request_id, seq.num_computed_tokens + r.num_new_tokens + 1)
        return seqs if blocks <= sched.kv.blocks.num_free else None

    def drop_if_finished(self) -> None:
        """Forget a queued step whose requests all stopped or were aborted: nothing will read its tokens."""
        if self.inflight is not None and all(self._is_done(r.request_id) for r in self.inflight.sched.scheduled):
            self.inflight = None

    def _is_done(self, request_id: str) -> bool:
        seq = self.seqs.get(request_id)
        return seq is None or seq.is_finished
