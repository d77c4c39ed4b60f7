"""After each step, the proposer's turn: hand it the step's requests (``propose``) or take the drafts it left on the
device (``take_device_drafts``), and store each request's next drafts in its ``Sequence``.

The engine calls exactly one of the two per step: ``take_device_drafts`` when the drafter already drafted behind the
step on the device (MTP / EAGLE, a draft model without recurrent state, ngram with ``draft_on_device``; async
scheduling), ``propose`` otherwise. Which requests may draft and how many drafts each gets come from the engine's
gates (engine/draft_gate.py: ``may_draft``, ``num_drafts``).
"""

from collections.abc import Callable

from truespec.core.scheduler import Scheduler
from truespec.core.scheduler_output import SchedulerOutput
from truespec.core.sequence import Sequence
from truespec.spec_decode.device_drafts import DeviceDrafts
from truespec.spec_decode.draft_length import DraftLengthPolicy
from truespec.spec_decode.interface import DraftRequest, Proposer
from truespec.worker.runner_output import ModelRunnerOutput


class DraftHandoff:
    def __init__(self, proposer: Proposer | None, seqs: dict[str, Sequence], scheduler: Scheduler,
                 draft_length: DraftLengthPolicy, may_draft: Callable[..., bool],
                 num_drafts: Callable[[str, bool], int]) -> None:
        self.proposer, self.seqs, self.scheduler = proposer, seqs, scheduler
        self.draft_length, self.may_draft, self.num_drafts = draft_length, may_draft, num_drafts

    def propose(self, sched: SchedulerOutput, output: ModelRunnerOutput, may_draft: bool, shifted: bool) -> None:
        """Let the proposer catch up on the step and draft for the requests that got a new token (as many drafts as
        the draft-length policy expects to pay for; none: the drafters only catch up on that request). Not
        ``may_draft``: the next step is already queued as a decode, nobody drafts. ``shifted``: a step queued ahead
        whose positions the device moved (its plan's start is as if the step before accepted nothing)."""
        if self.proposer is None:
            return
        self.draft_length.forget(sched.finished_req_ids)
        indices: range | list[int] = range(len(sched.scheduled))
        if not may_draft:  # nobody drafts
            self.proposer.forget(sched.finished_req_ids)
            if not self.proposer.catches_up:  # ngram: nothing to index before a request drafts
                return
            if not shifted:  # a model drafter defers its decodes' catch-up without a DraftRequest each
                indices = self.proposer.defer_decodes(sched.scheduled, output)
        # whether drafting is on for the next step of a random / a greedy request (off: a drafter may defer)
        is_on = (self.may_draft(False), self.may_draft(True)) if may_draft else (False, False)
        requests = []
        for i in indices:
            r = sched.scheduled[i]
            seq = self.seqs.get(r.request_id)
            if seq is None or seq.is_finished:
                continue
            tokens = output.sampled_token_ids[i]
            num_drafts = self.num_drafts(r.request_id, r.params.is_greedy) if may_draft and tokens else 0
            # a request's query in a step queued ahead starts where the device moved it (a prompt: not moved)
            is_moved = shifted and r.num_new_tokens == 1
            start = seq.num_computed_tokens - len(tokens) if is_moved else r.num_computed_tokens
            requests.append(DraftRequest(
                r.request_id, r.params, seq.prompt_token_ids, seq.output_token_ids, start,
                seq.num_computed_tokens, i, r.block_ids, r.first_state_slot, num_drafts > 0,
                num_drafts and min(num_drafts, self.scheduler.chunks.max_drafts(seq)),  # max_drafts is never negative
                not is_on[r.params.is_greedy]))
        drafts = self.proposer.propose(requests, output, sched.finished_req_ids)
        for request_id, d in drafts.items():
            seq = self.seqs[request_id]
            seq.draft_token_ids, seq.draft_probs = d.token_ids, d.probs

    def take_device_drafts(self, sched: SchedulerOutput, output: ModelRunnerOutput, drafts: DeviceDrafts,
                           is_queued: bool) -> None:
        """After a step the drafter drafted behind on the device: the verify queued after it uses the drafts there;
        if none was queued, each request that goes on takes what the draft-length policy gives it to the host."""
        self.draft_length.forget(sched.finished_req_ids)
        if is_queued:
            return
        next_ids = drafts.next_ids.tolist()  # waits for the drafter
        for i, r in enumerate(sched.scheduled):
            seq = self.seqs.get(r.request_id)
            if seq is None or seq.is_finished or not output.sampled_token_ids[i]:
                continue
            num_drafts = min(self.num_drafts(r.request_id, True), self.scheduler.chunks.max_drafts(seq))  # greedy steps
            seq.draft_token_ids, seq.draft_probs = next_ids[i][1:1 + num_drafts], None

    def forget_finished(self) -> None:
        """An idle step (nothing ran): drop what the proposer keeps for requests finished since the last step."""
        if self.proposer is not None:
            self.proposer.forget(self.scheduler.unreported_finished_ids)
