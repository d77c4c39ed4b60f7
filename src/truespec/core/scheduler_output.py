"""The contract between the scheduler and the model runner: one ``SchedulerOutput`` per step.

It is plain data: everything the runner needs to build the step's inputs and sample, taken out of the
requests, so the runner never reads or changes a ``Sequence``. Token counts are named as vLLM names them:
``num_scheduled_tokens`` counts a request's query tokens this step, drafts included.
"""

from dataclasses import dataclass, field
from typing import Any

from truespec.sampling_params import SamplingParams


@dataclass(slots=True)
class ScheduledRequest:
    request_id: str
    params: SamplingParams
    num_computed_tokens: int  # tokens already in the cache: the first query position
    num_scheduled_tokens: int  # query tokens this step: sequence tokens, then drafts
    token_ids: list[int]  # the query tokens' ids (an unknown async token is -1, filled in on the device)
    draft_token_ids: list[int]  # the drafts verified after the sequence tokens (only on a request's last chunk)
    draft_probs: Any  # [len(draft_token_ids), vocab] tensor when the drafter sampled, else None
    # the request's KV block table (covers every query position): the manager's live list, read at launch and
    # by the proposer after the step, before the next schedule() may grow it
    block_ids: list[int]
    first_state_slot: int  # where its group of 1 + k recurrent-state slots starts
    state_index: int  # slot of the group with the state after the last computed token
    num_output_tokens: int  # output tokens before this step (min_tokens counts from here)
    is_last_chunk: bool  # the step computes up to the request's last token, so it samples a new one
    prompt_len: int  # the request's prompt tokens: query positions before it are prompt rows (num_prompt_rows)
    # SamplingParams.prompt_logprobs: the prompt tokens whose logprobs this step gives, each from the query row
    # before it (``prompt_logprobs_rows``); [] when not asked, or all given already
    prompt_logprob_token_ids: list[int] = field(default_factory=list)
    # a GdnPrefillRule's path (core/gdn_prefill_rule.py): True, a long prompt whose chunks of prompt rows only run fla's
    # chunk kernel in the GDN layers; False, the token loop for every row; None, no rule (the layer decides by length)
    gdn_chunked: bool | None = None
    # derived once at construction (the fields above never change: the hot path reads these per request per step)
    # sequence tokens computed this step (a prefill chunk, or 1 for a decode), drafts excluded
    num_new_tokens: int = field(init=False, repr=False, compare=False)
    # rows the sampler needs: 1 + drafts on the last chunk, none for an earlier prefill chunk
    num_logits: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        num_drafts = len(self.draft_token_ids)
        self.num_new_tokens = self.num_scheduled_tokens - num_drafts
        self.num_logits = 1 + num_drafts if self.is_last_chunk else 0

    @property
    def state_src(self) -> int:
        """The flat slot the step starts from; -1 (zeros) before the request's first token."""
        return self.first_state_slot + self.state_index if self.num_computed_tokens else -1

    @property
    def num_prompt_rows(self) -> int:
        """Leading query rows at prompt positions (< prompt_len): a prefill chunk's, or the prompt part of a
        re-prefill after preemption; 0 for decodes and verifies. On CUDA their attention runs in the prefill kernel
        (kernels/step_attention.py)."""
        return min(max(self.prompt_len - self.num_computed_tokens, 0), self.num_scheduled_tokens)

    @property
    def prompt_logprobs_rows(self) -> range:
        """The query rows whose logits give ``prompt_logprob_token_ids``, one each: they end where the sampled rows
        begin (a last chunk) or at the chunk's end (the chunk's last row predicts the next chunk's first token)."""
        end = self.num_new_tokens - self.is_last_chunk
        return range(end - len(self.prompt_logprob_token_ids), end)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)  # freed this step; they re-prefill later
    # requests that finished or were aborted since the previous step: holders of per-request state (sampling
    # generators, drafter streams) drop it
    finished_req_ids: list[str] = field(default_factory=list)
    # structured outputs: the grammar mask of each logits row, [rows, ceil(vocab / 32)] int32 on the host, set by
    # the engine after scheduling (structured_output/manager.py); None: no request of the step is constrained
    grammar_bitmask: Any = None
    # prefix caching of recurrent state (core/prefix_planner.py), as (source, destination) flat state slots, run in
    # this order before the step's forward: checkpoints saved out of requests' groups, then restored into them
    state_saves: list[tuple[int, int]] = field(default_factory=list)
    state_restores: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_decode_only(self) -> bool:
        """Every request computes one sequence token (a decode, or a verify with its drafts): no prompt chunk, no
        recompute after preemption."""
        return all(r.num_new_tokens == 1 for r in self.scheduled)
