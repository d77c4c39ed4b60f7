"""What a proposer is given after each step, and what it returns.

After the target's step the engine hands every proposer one ``DraftRequest`` per request that ran and is still
running, and the step's ``ModelRunnerOutput`` (the target's hidden states). The proposer returns, for each
request that got a new token (``max_drafts`` is set for those), the drafts its next step verifies, and their
probabilities when it sampled them. A proposer keeps no copy of a request's progress: everything it needs is in
the ``DraftRequest``, and the blocks and state slots it writes were allocated by the scheduler.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from truespec.core.sequence import token_slice
from truespec.sampling_params import SamplingParams
from truespec.worker.runner_output import ModelRunnerOutput

if TYPE_CHECKING:
    from truespec.core.sequence import Sequence
    from truespec.spec_decode.device_drafts import DeviceDrafts
    from truespec.worker.model_runner import LaunchedStep


@dataclass(slots=True)
class DraftRequest:
    request_id: str
    params: SamplingParams
    # the request's tokens, the step's new ones included (read only: the engine's own lists, not copies)
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    step_start: int  # tokens in the target's cache before the step (the step's first position)
    num_computed_tokens: int  # tokens in the target's cache after the step (verified positions)
    row: int  # the request's index in the step (its hidden rows start at output.query_start_loc[row])
    block_ids: list[int]
    first_state_slot: int
    is_drafting: bool  # draft for its next step (it got a new token and drafts pay; False: catch up only)
    max_drafts: int  # at most this many drafts (0 when not drafting)
    # drafting is off for its next step (the governor, disable_by_batch_size), not merely unprofitable for it: a
    # drafter may defer its catch-up (a request whose draft length is 0 still probes soon, and with MTP / EAGLE
    # queued ahead a request left behind would keep its whole batch on host-planned steps)
    may_defer: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``start .. end - 1`` of the request."""
        return token_slice(self.prompt_token_ids, self.output_token_ids, start, end)


@dataclass
class Drafts:
    token_ids: list[int]
    probs: torch.Tensor | None = None  # [len(token_ids), vocab] when the drafter sampled them


class Proposer(Protocol):
    # whether a request that does not draft still needs its steps proposed: a model drafter's caches follow every
    # position (it catches up, or defers that); ngram indexes a request's tokens only when it drafts
    catches_up: bool

    def forget(self, request_ids: list[str]) -> None:
        """Drop what is kept for these finished requests."""
        ...

    # a proposer that ``catches_up`` also has ``defer_decodes(scheduled, output) -> list[int]``: after a step after
    # which nobody drafts, it takes what it can from the step's scheduled requests directly and returns the indices
    # of those ``propose`` must still see (ModelDrafter: the decodes' catch-up is deferred)

    def propose(self, requests: list[DraftRequest], output: ModelRunnerOutput,
                finished_req_ids: list[str]) -> dict[str, Drafts]:
        """Drafts for the requests with ``is_drafting``, by request id (absent: none)."""
        ...


class DeviceDrafter(Protocol):
    """A proposer that drafts behind a greedy step on the device, so that the next verify queues ahead
    (engine/async_scheduler.py): ModelDrafter (MTP / EAGLE), NgramProposer."""

    k: int
    can_draft_on_device: bool
    defers_while_off: bool  # while drafting is off, nothing is drafted behind a step (the next one is a decode)
    num_lookahead_tokens: int  # KV positions past a step's query it writes (its drafts'): blocks a step must hold
    device_reach: int  # of those, the ones drafting behind a step on the device writes (past that step's query)
    drafts_after_prompts: bool  # it also drafts behind a step (planned on the host) with last prompt chunks

    def is_behind(self, request_ids: list[str]) -> bool:
        """Whether one of these requests must catch up on the host before it drafts on the device."""
        ...

    def draft_on_device(self, step: "LaunchedStep", num_drafts: int, seqs: "dict[str, Sequence]") -> "DeviceDrafts":
        """Queue ``step``'s accepted counts and each request's next token and ``num_drafts`` drafts (k, or 0 while
        drafting is off); ``seqs``: the engine's requests, by id."""
        ...
