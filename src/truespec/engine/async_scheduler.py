"""Async scheduling (vLLM's ``async_scheduling``): queue step N+1 on the device before reading step N's tokens.

Two kinds of step are queued ahead, each only when every running request takes part and none has structured outputs
(the grammar mask of its next rows is built on the host from this step's tokens, so those steps run one after the
other), and, for decodes, no waiting request could be admitted (its prompt goes in a step planned on the host):
- **Decodes**: every request decodes greedily on, one token, without drafts, logprobs (of its output or of its
  prompt): step N+1's input ids are copied on the device from step N's argmax. What no token value changes is
  done ahead (positions, KV blocks, state slots); each request gets a placeholder token that the engine replaces
  once N's tokens are read. With a proposer, too, while the next step may not draft (the speculation governor
  turned drafting off, or disable_by_batch_size): ngram indexes the skipped tokens when it drafts again, and a model
  drafter defers its catch-up until then (``ModelDrafter.propose``), so such steps cost what steps without
  speculation cost.
- **Verifies** (a proposer that drafts on the device: MTP, EAGLE, a draft model; ngram with ``draft_on_device``):
  behind every greedy decode / verify step (a model drafter: also behind a request's prompt chunks)
  the proposer queues the step's accepted counts and each request's next token and k drafts on the device
  (``ModelDrafter.draft_on_device``, ``NgramProposer.draft_on_device``; while the next steps may not draft, nothing:
  the queued step after a verify then goes on as a plain decode). Step N+1
  is planned as if N accepts nothing; its blocks cover the case where N accepts everything, and the device moves
  each request's positions, KV slots and state source by what N accepted (``input_builder.shift_positions``) and
  feeds the next token and drafts. The host learns N+1's drafts
  with its tokens, in the step's one read. The host work of N+1 and N+2 thus overlaps N's and N+1's forwards.
  A request that finished before N is left out of N+1, one that may reach max_tokens at N stays in it, and with a
  model drafter waiting requests join it and a prompt whose earlier chunk N computes goes on in it
  (engine/verify_plan.py): neither a finish nor a join waits for a step planned on the host.
A request that stops at N has its queued work discarded: the KV and state it wrote went to blocks and slots it
held, and anything that reuses them later is queued after it on the same stream. Each request's rows are
computed as without the overlap (docs/ARCHITECTURE.md, invariant 1), so outputs are unchanged
(tests/test_async_scheduling.py, tests/test_async_spec.py).
"""

import logging
from collections.abc import Callable

import torch

from truespec.core.scheduler import Scheduler
from truespec.core.scheduler_output import SchedulerOutput
from truespec.core.sequence import PLACEHOLDER, Sequence
from truespec.engine.verify_plan import going_on, plan_verify
from truespec.spec_decode.interface import DeviceDrafter
from truespec.worker.model_runner import LaunchedStep, ModelRunner

logger = logging.getLogger("truespec")


def queued_steps(async_scheduling: bool | None, device_type: str, proposer: object | None,
                 asked_on_device: bool = False) -> tuple[bool, bool]:
    """(decodes queued ahead, verifies queued ahead) for an engine's ``async_scheduling`` (None: on for CUDA, off on
    CPU) and proposer. Decodes: with any proposer, for the steps that draft nothing (ngram indexes the tokens it
    skipped when it drafts again; a model drafter defers its catch-up, spec_decode/model_drafter.py). Verifies:
    with a proposer that drafts on the device (MTP / EAGLE, a draft model without recurrent state; ngram with
    ``draft_on_device``, see ``ModelDrafter.can_draft_on_device``): for MTP faster than planning them on the host at
    every batch size measured (BENCHMARKS.md, session 15). ``asked_on_device``: the user set ``draft_on_device``
    True, which without async scheduling has no effect (a warning says so)."""
    is_async = async_scheduling if async_scheduling is not None else device_type == "cuda"
    if not is_async and asked_on_device and getattr(proposer, "can_draft_on_device", False):
        logger.warning("speculative_config.draft_on_device has no effect without async scheduling (async_scheduling="
                       "%s on %s): drafts are made on the host", async_scheduling, device_type)
    return is_async, is_async and getattr(proposer, "can_draft_on_device", False)


class AsyncScheduler:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, seqs: dict[str, Sequence], enabled: bool,
                 drafter: DeviceDrafter | None = None, num_drafts: Callable[[str, bool], int] | None = None,
                 may_draft: Callable[[], bool] | None = None) -> None:
        self.scheduler, self.runner, self.seqs = scheduler, runner, seqs
        # decodes queued ahead (with a proposer only while ``may_draft`` says the next step drafts nothing)
        self.enabled = enabled
        # verifies queued ahead, drafted on the device (None: never); ``num_drafts``: the drafts a request's
        # next step verifies; ``may_draft``: whether the next step may draft at all (None: no proposer)
        self.drafter = drafter if drafter is not None and drafter.can_draft_on_device else None
        self.num_drafts, self.may_draft = num_drafts, may_draft
        self.inflight: LaunchedStep | None = None  # a queued step, collected by the next engine step
        self.num_async_steps = 0  # steps queued before the previous one's tokens were read
        self.host_admits = False  # a request still waited beside the last verify queued ahead (verify_plan.py)
        self.num_admitted_ahead = 0  # waiting requests that joined a verify queued ahead

    def take(self) -> LaunchedStep | None:
        launched, self.inflight = self.inflight, None
        return launched

    def launch(self, sched: SchedulerOutput, input_ids_from: torch.Tensor | None = None,
               shift: torch.Tensor | None = None) -> LaunchedStep:
        """Queue a step, and behind it the drafter's work on the device when every request of it is greedy."""
        step = self.runner.launch(sched, input_ids_from, shift)
        if self._drafts_on_device(sched, is_ahead=shift is not None):
            # while the next steps may not draft (the governor, disable_by_batch_size), the drafter defers its
            # catch-up (``ModelDrafter.propose``) and the next step is queued as a plain decode
            drafting = self.may_draft is None or self.may_draft()
            if drafting or not self.drafter.defers_while_off:
                step.device_drafts = self.drafter.draft_on_device(step, self.drafter.k if drafting else 0, self.seqs)
        return step

    def launch_next(self, launched: LaunchedStep) -> str | None:
        """Queue the step after ``launched`` if it can be planned now: "decode" (its requests were advanced past
        ``launched`` with a placeholder token), "verify" (they were not: the device moves them), else None."""
        if launched.device_drafts is not None:
            return "verify" if self._launch_verify(launched) else None
        return "decode" if self._launch_decode(launched) else None

    # ---- decodes ------------------------------------------------------------------------------------
    def _launch_decode(self, launched: LaunchedStep) -> bool:
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
        seqs = self._same_requests(launched) if self.enabled else None
        if seqs is None or self.may_draft is not None and self.may_draft():
            return None
        blocks = 0
        for r, seq in zip(launched.sched.scheduled, seqs, strict=True):
            p = r.params
            if (not r.is_last_chunk or r.draft_token_ids or not p.is_greedy or p.logprobs is not None
                    or r.prompt_logprob_token_ids or len(seq.output_token_ids) + 2 > seq.max_output_len):
                return None
            end = sched.chunks.hold_after_last_chunk(seq, seq.num_computed_tokens + r.num_new_tokens + 1)  # as planned
            blocks += sched.kv.num_blocks_needed(seq.request_id, end)
        return seqs if blocks <= sched.kv.num_free_blocks else None

    def _same_requests(self, launched: LaunchedStep) -> list[Sequence] | None:
        """The requests of ``launched`` if they are exactly the running ones, no waiting one could join and none has
        structured outputs (its next rows' grammar mask needs ``launched``'s tokens on the host)."""
        sched = self.scheduler
        if sched.waiting and len(sched.running) < sched.max_num_seqs:
            return None  # the next step may admit a waiting request: its prompt goes in a step planned on the host
        found = going_on(launched, self.seqs, sched.running)  # every request of ``launched``, none left out
        if found is None or len(found[0]) != len(launched.sched.scheduled):
            return None
        return found[1] if len(found[1]) <= sched.max_num_batched_tokens else None

    # ---- verifies -----------------------------------------------------------------------------------
    def _drafts_on_device(self, sched: SchedulerOutput, is_ahead: bool) -> bool:
        """Whether the drafter drafts behind this step on the device: every request is greedy without logprobs and
        computes its last token (a decode or verify; with a model drafter also the last chunk of a prompt: a request
        joining the batch) or, with a model drafter, a chunk of its prompt beside requests that do (the drafter only
        catches up on it), and its blocks cover the drafts' positions (a verify planned ahead allocated them for
        the most it can move; a prompt's blocks end at its longest possible length, which may be closer; behind an
        earlier chunk the drafts of its request start one position further, ``ChunkPlanner.tokens_to_hold``)."""
        if self.drafter is None or self.drafter.is_behind([r.request_id for r in sched.scheduled]):
            return False  # a request whose catch-up was deferred catches up on the host (``ModelDrafter.propose``)
        # positions past the query the drafter writes KV at (a model drafter's drafts; ngram none)
        reach = self.drafter.device_reach
        block_size, after_prompts = self.scheduler.kv.block_size, self.drafter.drafts_after_prompts
        return any(r.is_last_chunk for r in sched.scheduled) and all(
            (r.is_last_chunk and r.num_new_tokens == 1 or after_prompts and not r.prompt_logprob_token_ids)
            and r.params.is_greedy and r.params.logprobs is None
            and r.num_computed_tokens + r.num_scheduled_tokens + (
                reach + 1 if not r.is_last_chunk else reach if not is_ahead or r.num_prompt_rows else 0)
            <= len(r.block_ids) * block_size for r in sched.scheduled)

    def _launch_verify(self, launched: LaunchedStep) -> bool:
        """Plan (verify_plan.py) and queue the verify after ``launched`` from the drafts queued behind it."""
        plan, self.host_admits = plan_verify(self.scheduler, self.seqs, self.drafter, self.num_drafts, launched,
                                             self.host_admits)
        if plan is None:
            return False
        try:
            self.inflight = self.launch(plan.sched, input_ids_from=plan.input_ids, shift=plan.shift)
        except BaseException:  # the engine restarts ``launched``'s requests; the ones admitted here wait again
            for r in plan.admitted:
                self.scheduler.preempt(self.seqs[r.request_id])
            # the plan's checkpoint saves never ran; the finished requests it took are reported with the next step
            self.scheduler.prefix.discard_saves(plan.sched.state_saves)
            self.scheduler.report_finished(plan.sched.finished_req_ids)
            raise
        self.num_admitted_ahead += len(plan.admitted)
        self.num_async_steps += 1
        return True

    def drop_if_finished(self) -> None:
        """Forget a queued step whose requests all stopped or were aborted: nothing will read its tokens. The
        finished requests it reported are reported again with the next step (else the runner and proposer would
        keep what they hold for them)."""
        if self.inflight is not None and all(self._is_done(r.request_id) for r in self.inflight.sched.scheduled):
            self.scheduler.report_finished(self.inflight.sched.finished_req_ids)
            self.inflight = None

    def _is_done(self, request_id: str) -> bool:
        seq = self.seqs.get(request_id)
        return seq is None or seq.is_finished
