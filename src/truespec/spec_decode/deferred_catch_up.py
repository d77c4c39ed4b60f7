"""A model drafter's deferred catch-up: the positions a request computed while its drafting was off.

A model drafter (spec_decode/model_drafter.py) keeps KV of its own at every position a request computes, written by
its catch-up after each step. While drafting is off for a request (the governor, disable_by_batch_size:
``DraftRequest.may_defer``) that cache is not needed yet, so the catch-up of its plain decode steps waits: this
class notes the positions (``Behind``: ``start .. end - 1``) and, for a head that reads the target's hidden states,
where each one's hidden state is: a (step id, row) pair into ``held``, the steps' hidden-state tensors (the runner
returns a fresh tensor per step, so holding a reference keeps it). The drafter catches up on all of them at once,
before the step's own positions, when the request drafts again, when ``limit`` positions are due, or when a step of
it is not a plain decode. Each catch-up row is computed alone (docs/ARCHITECTURE.md, invariant 4), so its KV, and
the drafts after it, are those of catching up after every step.

A request's deferred positions end where its next step starts; if they do not, it was preempted since (its
re-prefill recomputes them, and its old blocks may belong to another request by then): they are dropped. A finished
request's are dropped when its finish is reported (``forget``); a held tensor goes when no deferred run reads it.
"""

from dataclasses import dataclass
from itertools import count

import torch

from truespec.core.scheduler_output import ScheduledRequest
from truespec.ops.host_copy import to_device_async
from truespec.worker.runner_output import ModelRunnerOutput

DEFER_LIMIT = 64  # positions a request's catch-up may fall behind while its drafting is off


@dataclass
class Behind:
    """A request's deferred positions ``start .. end - 1``; a head's hidden state of each, as (held step id, row)."""

    start: int
    end: int
    hidden: list[tuple[int, int]]


class DeferredCatchUp:
    def __init__(self, keeps_hidden: bool, limit: int = DEFER_LIMIT) -> None:
        self.keeps_hidden = keeps_hidden  # a head: the target's hidden states of the deferred positions are kept
        self.limit = limit  # 0: never defer
        self.behind: dict[str, Behind] = {}  # by request id
        self.held: dict[int, torch.Tensor] = {}  # steps' hidden states [T, H] a deferred run reads, by step id
        self._latest: tuple[torch.Tensor, int] | None = None  # the latest held step's hidden states and id
        self._ids = count()
        self._released = False  # a deferred run ended since ``held`` was last pruned

    def forget(self, request_ids: list[str]) -> None:
        """Drop finished requests' deferred positions."""
        for request_id in request_ids:
            self._released |= self.behind.pop(request_id, None) is not None
        self.prune()

    def is_behind(self, request_ids: list[str]) -> bool:
        return bool(self.behind) and any(request_id in self.behind for request_id in request_ids)

    def take(self, request_id: str, step_start: int) -> Behind | None:
        """The request's deferred positions, taken out (give them back with ``defer``, or ``release`` them once
        caught up); None if it has none, or was restarted since (they do not end where its step starts)."""
        behind = self.behind.pop(request_id, None)
        if behind is not None and behind.end != step_start:
            behind, self._released = None, True
        return behind

    def release(self, behind: Behind | None) -> None:
        """``behind`` is being caught up (its held states may go once the catch-up is queued: ``prune``)."""
        self._released |= behind is not None

    def defer(self, request_id: str, start: int, row: int, behind: Behind | None, output: ModelRunnerOutput) -> bool:
        """Add the decode at position ``start`` (its target hidden state in ``row`` of the step) to the request's
        deferred positions; False (nothing changed) if ``limit`` positions are already due."""
        if behind is None:
            behind = Behind(start, start, [])
        if behind.end - behind.start >= self.limit:
            return False
        if self.keeps_hidden:
            hidden = output.hidden_states
            if self._latest is None or self._latest[0] is not hidden:
                self._latest = (hidden, next(self._ids))
                self.held[self._latest[1]] = hidden
            behind.hidden.append((self._latest[1], row))
        behind.end = start + 1
        self.behind[request_id] = behind
        return True

    def defer_decodes(self, scheduled: list[ScheduledRequest], output: ModelRunnerOutput) -> list[int]:
        """A step after which nobody drafts: defer each of its one-row decodes of an output position straight from
        the scheduled requests (no ``DraftRequest`` each). Returns the indices of the others."""
        rest = []
        for i, r in enumerate(scheduled):
            start = r.num_computed_tokens
            if r.num_scheduled_tokens == 1 and r.is_last_chunk and start >= r.prompt_len:
                behind = self.take(r.request_id, start)
                if self.defer(r.request_id, start, output.query_start_loc[i], behind, output):
                    continue
                if behind is not None:  # ``limit`` positions due: ``propose`` catches up on them
                    self.behind[r.request_id] = behind
            rest.append(i)
        return rest

    def prune(self) -> None:
        """Release the held hidden states no deferred run reads any more (step ids grow with time)."""
        if not self._released or not self.held:
            return
        self._released = False
        oldest = min((b.hidden[0][0] for b in self.behind.values() if b.hidden), default=None)
        for step_id in [i for i in self.held if oldest is None or i < oldest]:
            del self.held[step_id]
        if self._latest is not None and self._latest[1] not in self.held:
            self._latest = None

    def gather(self, pairs: list[tuple[int, int]], output: ModelRunnerOutput) -> torch.Tensor:
        """The hidden states of (step id, row) pairs, in order: step id -1 is ``output``'s, others held ones."""
        held = sorted({step_id for step_id, _ in pairs if step_id >= 0}) if self.held else []
        states = output.hidden_states
        if not held:  # nothing deferred (the usual catch-up): this step's rows only
            return states.index_select(0, to_device_async([row for _, row in pairs], states.device))
        sources, base, offset = [states], {-1: 0}, states.shape[0]
        for step_id in held:
            sources.append(self.held[step_id])
            base[step_id], offset = offset, offset + sources[-1].shape[0]
        rows = to_device_async([base[step_id] + row for step_id, row in pairs], states.device)
        return torch.cat(sources).index_select(0, rows)
