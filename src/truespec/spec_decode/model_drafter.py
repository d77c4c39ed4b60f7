"""Drafting with a network: a draft model, the MTP head or an EAGLE head.

After every target step the drafter *catches up* on what it has not seen yet, in one forward over all
requests (mixed lengths, like the target's own steps), then drafts k tokens for each request that got a
new token: the first from its catch-up, then k - 1 single-token steps. Its caches mirror the target's:
KV in the same paged blocks (the same positions), recurrent state (hybrid draft model) in its own slots of
the request's group: slot 0 holds the state after the caught-up prefix, slot j the state after draft j.
Rejected drafts need no rollback: the next catch-up starts again from slot 0 / the verified prefix.

Heads that read the target's hidden states (MTP, EAGLE) catch up on every position the target computed
in the step whose next token is known (prefill chunks included), since those hidden states exist only
then; a draft model catches up on all known tokens when it must draft.
"""

import weakref
from collections.abc import Callable

import torch

from truespec.engine.block_manager import BlockManager
from truespec.engine.context_builder import ContextRow
from truespec.engine.graph_runner import GraphRunner, GraphSettings
from truespec.engine.model_runner import StepOutput, allocate_caches
from truespec.engine.scheduler import ScheduledSeq
from truespec.engine.sequence import Sequence
from truespec.engine.state_manager import StateManager
from truespec.layers.sampler import probabilities


class ModelDrafter:
    def __init__(self, head: torch.nn.Module, k: int, blocks: BlockManager, states: StateManager,
                 max_drafts: Callable[[Sequence], int], device: torch.device, seed: int,
                 graphs: GraphSettings | None = None, hidden_size: int | None = None) -> None:
        self.head, self.k, self.blocks, self.states = head, k, blocks, states
        self.max_drafts, self.device, self.seed = max_drafts, device, seed
        self.uses_target_hidden = bool(getattr(head, "uses_target_hidden", False))
        self._generators: weakref.WeakKeyDictionary[Sequence, torch.Generator] = weakref.WeakKeyDictionary()
        allocate_caches(head, blocks.num_blocks, blocks.block_size, states.num_slots, device)
        settings = graphs or GraphSettings(block_size=blocks.block_size)
        self.graphs = GraphRunner(head, f"drafter ({type(head).__name__})", settings, device, hidden_size,
                                  head.dtype)
        self.graphs.capture()  # the drafter runs in the target's mode (CONTEXT.md section 4)

    # ---- the proposer interface --------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, scheduled: list[ScheduledSeq], step: StepOutput) -> None:
        drafting = [(s, r) for r, (s, tokens) in enumerate(zip(scheduled, step.tokens, strict=True))
                    if tokens and not s.seq.is_finished]
        budget = {id(s.seq): self._num_drafts(s.seq) for s, _ in drafting}
        jobs = [job for r, s in enumerate(scheduled) if (job := self._catch_up_job(s, r, step, budget)) is not None]
        if not jobs:
            return
        hidden = self._forward(jobs)
        current = [(j.seq, hidden[j.last_row]) for j in jobs if budget.get(id(j.seq), 0) > 0]
        drafts: dict[int, list[int]] = {id(seq): [] for seq, _ in current}
        probs: dict[int, list[torch.Tensor]] = {id(seq): [] for seq, _ in current}
        for j in range(self.k):
            current = [(seq, h) for seq, h in current if len(drafts[id(seq)]) < budget[id(seq)]]
            if not current:
                break
            if j > 0:  # one more single-token step over the drafts so far
                current = self._draft_step(current, drafts, j)
            logits = self.head.compute_logits(torch.stack([h for _, h in current]))
            logits = logits if logits.dtype == torch.float64 else logits.float()
            # greedy requests: one argmax over the batch, one copy to the host
            argmax = logits.argmax(dim=-1).tolist() if any(seq.params.is_greedy for seq, _ in current) else []
            for i, ((seq, _), row) in enumerate(zip(current, logits, strict=True)):
                token, q = (argmax[i], None) if seq.params.is_greedy else self._sample(seq, row)
                drafts[id(seq)].append(token)
                probs[id(seq)].append(q)
        for s, _ in drafting:
            seq = s.seq
            seq.draft_token_ids = drafts.get(id(seq), [])
            qs = probs.get(id(seq), [])
            seq.draft_probs = torch.stack(qs) if qs and qs[0] is not None else None

    # ---- catch-up ------------------------------------------------------------------------------------
    def _catch_up_job(self, s: ScheduledSeq, r: int, step: StepOutput, budget: dict[int, int]) -> "_Job | None":
        seq = s.seq
        if seq.is_finished:
            return None
        start = seq.num_drafter_computed_tokens
        if self.uses_target_hidden:
            # positions the target computed this step whose next token is known: t in [start, end)
            end = min(seq.num_computed_tokens, seq.num_tokens - 1)
            step_start = s.start
            if start != step_start:  # the head is behind only after a preemption restarted the target too
                raise RuntimeError(f"{seq.request_id}: drafter at {start}, target step began at {step_start}")
            ids = seq.token_slice(start + 1, end + 1)
            rows = list(range(step.query_start_loc[r], step.query_start_loc[r] + end - start))
            hidden = step.hidden[rows] if rows else None
        else:
            if budget.get(id(seq), 0) == 0:
                return None  # a draft model catches up only when it drafts (KV blocks are held for that)
            end = seq.num_tokens
            ids, hidden = seq.token_slice(start, end), None
        if end <= start:
            return None
        return _Job(seq, start, ids, hidden)

    def _forward(self, jobs: "list[_Job]") -> torch.Tensor:
        rows, input_ids, positions, hidden_in, offset = [], [], [], [], 0
        for job in jobs:
            n = len(job.input_ids)
            base = self.states.first_slot(job.seq)
            src = base if job.start > 0 else -1  # slot 0: the state after the caught-up prefix
            rows.append(ContextRow(job.seq.block_ids, job.start, n, src, base, n - 1, 0))
            input_ids += job.input_ids
            positions += range(job.start, job.start + n)
            if job.hidden is not None:
                hidden_in.append(job.hidden)
            job.last_row = offset + n - 1
            offset += n
        decode_only = all(len(job.input_ids) <= 1 + self.k for job in jobs)  # no prompt prefill in it
        hidden, _ = self.graphs.run(rows, input_ids, positions, torch.cat(hidden_in) if hidden_in else None,
                                    decode_only)
        for job in jobs:  # only once its KV / state is written
            job.seq.num_drafter_computed_tokens = job.start + len(job.input_ids)
        return hidden

    # ---- drafting ------------------------------------------------------------------------------------
    def _draft_step(self, current: list[tuple[Sequence, torch.Tensor]], drafts: dict[int, list[int]],
                    j: int) -> list[tuple[Sequence, torch.Tensor]]:
        """Feed draft j (the latest) of every request at the position after the previous one."""
        rows, input_ids, positions = [], [], []
        for seq, _ in current:
            pos = seq.num_drafter_computed_tokens - 1 + j
            base = self.states.first_slot(seq)
            rows.append(ContextRow(seq.block_ids, pos, 1, base + j - 1, base + j, 0, 0))
            input_ids.append(drafts[id(seq)][-1])
            positions.append(pos)
        hidden_in = torch.stack([h for _, h in current]) if self.uses_target_hidden else None
        out, _ = self.graphs.run(rows, input_ids, positions, hidden_in, decode_only=True)
        return [(seq, out[i]) for i, (seq, _) in enumerate(current)]

    def _num_drafts(self, seq: Sequence) -> int:
        """k, within what the request may still emit and the KV blocks that can be had for the drafts."""
        want = min(self.k, self.max_drafts(seq))
        # positions written: catch-up up to num_tokens - 1 (draft model), drafts up to num_tokens + want - 2
        needed = seq.num_tokens + want - 1 - seq.num_computed_tokens
        if want and not self.blocks.can_allocate(seq, needed):
            capacity = (len(seq.block_ids) + self.blocks.num_free_blocks) * self.blocks.block_size
            want = max(0, min(want, capacity - seq.num_tokens + 1))
            needed = seq.num_tokens + want - 1 - seq.num_computed_tokens
        if want:
            self.blocks.allocate(seq, needed)
        return want

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> tuple[int, torch.Tensor]:
        q = probabilities(logits, seq.params)
        return int(torch.multinomial(q, 1, generator=self._generator(seq))), q

    def _generator(self, seq: Sequence) -> torch.Generator:
        gen = self._generators.get(seq)
        if gen is None:  # a stream apart from the target's sampling
            gen = self._generators[seq] = seq.make_generator(self.device, self.seed, stream=1)
        return gen


class _Job:
    def __init__(self, seq: Sequence, start: int, input_ids: list[int], hidden: torch.Tensor | None) -> None:
        self.seq, self.start, self.input_ids, self.hidden = seq, start, input_ids, hidden
        self.last_row = -1
