"""Drafting with a network: a draft model, the MTP head or an EAGLE head.

After every target step the drafter *catches up* on the positions the target computed in it, in one forward
over all requests (mixed lengths, like the target's own steps), then drafts for each request that got a new
token: the first draft from its catch-up, then single-token steps. Its caches mirror the target's: KV in the
same paged blocks at the same positions, recurrent state (a hybrid draft model) in the request's state group.
It keeps no progress of its own: each step starts where the target's step started, from slot 0 of the group,
and rejected drafts need no rollback.

- A draft model reads tokens: its catch-up covers the step's positions and, when the request got a new token,
  that token's position too (``offset`` 1). Slot 0 keeps the state after the last verified position, slot 1
  the state after the new token, slot j + 1 the state after draft j.
- A head reading the target's hidden states (MTP, EAGLE) pairs the hidden state at position t with token
  t + 1, so it covers the verified positions only (``offset`` 0); slot j keeps the state after draft j.
Draft j (j >= 1) is fed at position ``num_computed_tokens + offset - 1 + j``; the scheduler allocated blocks
for up to ``num_speculative_tokens`` positions past the step's query (its lookahead).

While drafting is off for a request, the catch-up of its plain decode steps waits (deferred_catch_up.py), so such a
step costs what a step without speculation costs; the drafter catches up on those positions with its next catch-up.
"""

from dataclasses import dataclass, field

import torch

from truespec.core.scheduler_output import ScheduledRequest
from truespec.kv_cache.layout import allocate_caches, state_bytes_per_slot
from truespec.layers.sampler import probabilities, request_generator
from truespec.ops.host_copy import to_device_async
from truespec.spec_decode.deferred_catch_up import Behind, DeferredCatchUp
from truespec.spec_decode.device_drafts import DeviceDrafts, draft_by_launches
from truespec.spec_decode.draft_chain import DraftChain
from truespec.spec_decode.interface import DraftRequest, Drafts
from truespec.worker.graph_runner import GraphRunner, GraphSettings
from truespec.worker.input_builder import ContextRow
from truespec.worker.model_runner import LaunchedStep
from truespec.worker.runner_output import ModelRunnerOutput


@dataclass
class _Job:
    """One request's work in a ``propose`` call."""

    request: DraftRequest
    start: int  # first position of its catch-up
    input_ids: list[int]  # its catch-up's tokens
    hidden_rows: list[tuple[int, int]]  # the target's hidden rows they pair with, as (held step id, row) (heads only)
    hidden: torch.Tensor | None = None  # [H]: the drafter's output the next draft is predicted from
    token_ids: list[int] = field(default_factory=list)  # drafts so far
    probs: list[torch.Tensor | None] = field(default_factory=list)

    @property
    def num_wanted(self) -> int:
        return self.request.max_drafts if self.request.is_drafting else 0


class ModelDrafter:
    catches_up = True  # its caches follow every position a request computes
    drafts_after_prompts = True  # drafts on the device behind a step with last prompt chunks too (draft_by_launches)
    can_draft_on_device = True  # __init__ decides: a head without recurrent state; a draft model without, if asked

    def __init__(self, head: torch.nn.Module, k: int, num_blocks: int, num_state_slots: int, device: torch.device,
                 seed: int, graphs: GraphSettings, hidden_size: int | None = None,
                 kv_cache_dtype: str = "auto", draft_on_device: bool | None = None) -> None:
        if draft_on_device and state_bytes_per_slot(head) > 0:  # before any cache or graph is made for it
            raise ValueError("speculative_config.draft_on_device: the draft model has recurrent state (GDN layers), "
                             "which drafting on the device does not keep; leave the key out")
        self.head, self.k, self.device, self.seed = head, k, device, seed
        self.uses_target_hidden = bool(getattr(head, "uses_target_hidden", False))
        self.offset = 0 if self.uses_target_hidden else 1
        self._generators: dict[str, torch.Generator] = {}
        self.deferred = DeferredCatchUp(keeps_hidden=self.uses_target_hidden)  # while a request's drafting is off
        allocate_caches(head, num_blocks, graphs.block_size, num_state_slots, device, kv_cache_dtype)
        # 1 + k forwards per step, and the host may queue the next step's before the device ends this one's
        self.graphs = GraphRunner(head, f"drafter ({type(head).__name__})", graphs, device, hidden_size, head.dtype,
                                  num_staging=2 * (k + 1) + 2)
        self.graphs.capture()  # the drafter replays graphs whenever the target does
        # a drafter without recurrent state drafts greedy steps on the device, queued behind the target's forward;
        # with graphs, a uniform step's whole drafting is one replay (draft_chain.py). A draft model does unless told
        # not to (speculative_config.draft_on_device False)
        wants = self.uses_target_hidden or draft_on_device is not False
        self.can_draft_on_device = wants and state_bytes_per_slot(head) == 0
        # KV positions past a step's query that drafting behind it on the device writes: the k - 1 draft steps after
        # the last accepted position (a head), or one more for a draft model (its catch-up feeds the new token too)
        self.device_reach = k - 1 + self.offset
        self.chain = None
        if self.can_draft_on_device and self.graphs.enabled:
            self.chain = DraftChain(head, k, self.graphs.sizes, graphs.max_blocks_per_req, graphs.block_size,
                                    hidden_size, device, reads_tokens=not self.uses_target_hidden)
            with torch.cuda.device(device):
                self.chain.capture()

    def forget(self, request_ids: list[str]) -> None:
        """Drop what the drafter keeps for finished requests."""
        for request_id in request_ids:
            self._generators.pop(request_id, None)
        self.deferred.forget(request_ids)

    def defer_decodes(self, scheduled: list[ScheduledRequest], output: ModelRunnerOutput) -> list[int]:
        """After a step after which nobody drafts: defer its decodes' catch-up (``DeferredCatchUp.defer_decodes``);
        the indices of the other requests, which ``propose`` must see."""
        return self.deferred.defer_decodes(scheduled, output)

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest], output: ModelRunnerOutput,
                finished_req_ids: list[str]) -> dict[str, Drafts]:
        self.forget(finished_req_ids)
        jobs, deferred = [], self.deferred
        for r in requests:
            behind = deferred.take(r.request_id, r.step_start)
            # deferred: drafting is off for its next step and the step was one decode of an output position (prompt
            # positions are caught up at once: prefix caching shares their blocks), unless its limit is due
            if (r.may_defer and r.num_computed_tokens - r.step_start == 1
                    and r.step_start >= len(r.prompt_token_ids)
                    and deferred.defer(r.request_id, r.step_start, output.query_start_loc[r.row], behind, output)):
                continue
            deferred.release(behind)
            if (job := self._catch_up_job(r, output, behind)) is not None:
                jobs.append(job)
        if jobs:
            self._catch_up(jobs, output)
        deferred.prune()
        if not jobs:
            return {}
        # the drafts stay on the device until all are made: one host read per step, not one per draft position
        active, tokens, drafted = jobs, None, []
        for j in range(self.k):
            kept = [i for i, job in enumerate(active) if j < min(self.k, job.num_wanted)]
            if not kept:
                break
            if len(kept) < len(active):  # requests that want no more drafts leave the step
                active = [active[i] for i in kept]
                tokens = None if tokens is None else tokens[to_device_async(kept, tokens.device)]
            if j > 0:  # one more single-token step over the drafts so far
                self._draft_step(active, j, tokens)
            tokens = self._sample(active)
            drafted.append((active, tokens))
        if drafted:
            values = iter(torch.cat([t for _, t in drafted]).tolist())
            for active, _ in drafted:
                for job in active:
                    job.token_ids.append(next(values))
        return {job.request.request_id: Drafts(job.token_ids, _stack(job.probs))
                for job in jobs if job.request.is_drafting}

    def is_behind(self, request_ids: list[str]) -> bool:
        """Whether one of these requests' catch-up was deferred (it then catches up on the host: ``propose``)."""
        return self.deferred.is_behind(request_ids)

    @property
    def num_lookahead_tokens(self) -> int:
        """KV positions past a step's query its drafts write."""
        return self.k

    @property
    def defers_while_off(self) -> bool:
        """While drafting is off, the catch-up waits (so nothing is drafted behind a step on the device)."""
        return self.deferred.limit > 0

    @torch.inference_mode()
    def draft_on_device(self, step: LaunchedStep, num_drafts: int, seqs: dict[str, object]) -> DeviceDrafts:
        """Queue a greedy step's acceptance, catch-up and ``num_drafts`` (k or 0) drafts per request on the
        device, nothing read back (``seqs``: for the prompt token after an earlier chunk of a prompt): one launch per
        forward (``draft_by_launches``, which says what each forward computes; a step with prompt chunks too), or, where
        every request is a decode / verify and a graph is captured, one replay (``DraftChain``). The same tokens as
        ``propose`` (tests/test_async_spec.py). 0 drafts (the next steps draft nothing): only the acceptance and the
        catch-up, which keeps the drafter's cache whole for when drafting resumes."""
        self.forget(step.sched.finished_req_ids)
        rows, inputs = step.rows, step.inputs
        num_tokens, num_reqs, ctx = len(step.positions), len(rows), inputs.ctx
        if num_drafts == self.k and self.chain is not None and all(row.num_logits == row.query_len for row in rows) \
                and self.chain.can_run(num_reqs, [row.query_len for row in rows], ctx.block_tables.shape[1]):
            hidden = step.output.hidden_states if self.uses_target_hidden else None
            return self.chain.run(step.argmax, inputs.input_ids, hidden, inputs.positions,
                                  ctx.query_start_loc[:num_reqs + 1], ctx.block_tables, num_tokens)
        after_chunks = [seqs[r.request_id].token_slice(end, end + 1)[0] for r in step.sched.scheduled
                        if not r.is_last_chunk for end in (r.num_computed_tokens + r.num_new_tokens,)]
        return draft_by_launches(self.head, self.graphs, step, num_drafts, reads_tokens=not self.uses_target_hidden,
                                 after_chunks=after_chunks)

    # ---- catch-up ------------------------------------------------------------------------------------
    def _catch_up_job(self, r: DraftRequest, output: ModelRunnerOutput, behind: Behind | None = None) -> _Job | None:
        """``r``'s catch-up: its deferred positions, if any, then the step's."""
        start = behind.start if behind is not None else r.step_start
        end = r.num_computed_tokens + (self.offset if r.is_drafting else 0)
        if end <= start:
            return None
        if not self.uses_target_hidden:
            return _Job(r, start, r.token_slice(start, end), [])
        first = output.query_start_loc[r.row]  # hidden state of position t goes with token t + 1
        rows = [(-1, first + i) for i in range(end - r.step_start)]  # -1: this step's hidden states
        return _Job(r, start, r.token_slice(start + 1, end + 1), (behind.hidden if behind else []) + rows)

    def _catch_up(self, jobs: list[_Job], output: ModelRunnerOutput) -> None:
        rows, input_ids, positions = [], [], []
        for job in jobs:
            n, base = len(job.input_ids), job.request.first_state_slot
            src = base if job.start > 0 else -1  # slot 0: the state after the positions before the step
            keep = 1 + (self.offset if job.request.is_drafting else 0)  # states kept: slot 0 (and 1)
            rows.append(ContextRow(job.request.block_ids, job.start, n, src, base, n - keep, 0))
            input_ids += job.input_ids
            positions += range(job.start, job.start + n)
        pairs = [pair for job in jobs for pair in job.hidden_rows]
        hidden_in = self.deferred.gather(pairs, output) if self.uses_target_hidden else None
        # no prompt prefill in it: at most the step's 1 + k verified positions (and a draft model's new token)
        decode_only = all(len(job.input_ids) <= 1 + self.k + self.offset for job in jobs)
        hidden, _ = self.graphs.run(rows, input_ids, positions, hidden_in, decode_only)
        last = 0
        for job in jobs:
            last += len(job.input_ids)
            job.hidden = hidden[last - 1]

    # ---- drafting ------------------------------------------------------------------------------------
    def _draft_step(self, jobs: list[_Job], j: int, tokens: torch.Tensor) -> None:
        """Feed draft j (``tokens`` [J], on the device: the latest) of every request at the position after the
        previous one."""
        rows, positions = [], []
        for job in jobs:
            pos = job.request.num_computed_tokens + self.offset - 1 + j
            slot = job.request.first_state_slot + self.offset + j  # the state after draft j
            rows.append(ContextRow(job.request.block_ids, pos, 1, slot - 1, slot, 0, 0))
            positions.append(pos)
        hidden_in = torch.stack([job.hidden for job in jobs]) if self.uses_target_hidden else None
        out, _ = self.graphs.run(rows, [0] * len(jobs), positions, hidden_in, decode_only=True, input_ids_from=tokens)
        for i, job in enumerate(jobs):
            job.hidden = out[i]

    def _sample(self, jobs: list[_Job]) -> torch.Tensor:
        """One draft per job, [J] on the device (nothing read back): the argmax for greedy requests, else a sample
        with the request's drafter stream (its distribution appended to ``job.probs``)."""
        logits = self.head.compute_logits(torch.stack([job.hidden for job in jobs]))
        logits = logits if logits.dtype == torch.float64 else logits.float()
        greedy = [job.request.params.is_greedy for job in jobs]
        argmax = logits.argmax(dim=-1) if any(greedy) else None
        if all(greedy):
            for job in jobs:
                job.probs.append(None)
            return argmax
        picks = []
        for i, (job, row) in enumerate(zip(jobs, logits, strict=True)):
            if greedy[i]:
                picks.append(argmax[i:i + 1])
                job.probs.append(None)
                continue
            q = probabilities(row, job.request.params)
            picks.append(torch.multinomial(q, 1, generator=self._generator(job.request)))
            job.probs.append(q)
        return torch.cat(picks)

    def _generator(self, r: DraftRequest) -> torch.Generator:
        gen = self._generators.get(r.request_id)
        if gen is None:  # a stream apart from the target's sampling
            gen = self._generators[r.request_id] = request_generator(r.params, r.request_id, self.seed, self.device,
                                                                     stream=1)
        return gen


def _stack(probs: list[torch.Tensor | None]) -> torch.Tensor | None:
    return torch.stack(probs) if probs and probs[0] is not None else None
