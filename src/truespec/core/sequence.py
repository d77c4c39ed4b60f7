"""One request's state: its tokens, how many are in the cache, its drafts, its timestamps.

Only the engine side changes a Sequence: the scheduler its status (finish included) and, on admission after a
cached prefix (and its ``num_cached_tokens``) and on preemption, its progress; the engine the progress and drafts a
step produced (the async scheduler the progress and a placeholder token of a step it queues ahead); the output
processor its new tokens (up to a stop), prompt logprobs, text and timestamps.
Which KV blocks and state slots it holds is recorded by the ``KVCacheManager`` under its ``request_id``.
"""

import time
from enum import Enum, auto

from truespec.sampling_params import SamplingParams

# An output token not yet known on the host (async scheduling): the device holds it, the engine fills it in
PLACEHOLDER = -1


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, max_output_len: int, arrival_time: float | None = None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)  # never changes: only output tokens are appended
        self.prompt_len = len(self.prompt_token_ids)  # read several times per request per step: not a property
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[dict[int, float]] = []  # when params.logprobs is set
        # when params.prompt_logprobs is set: None for the first prompt token, then one entry per prompt token as
        # the prefill chunks give them (the output processor appends them)
        self.prompt_logprobs: list[dict[int, float] | None] | None = None if params.prompt_logprobs is None else [None]
        self.params = params
        self.max_output_len = max_output_len  # min(max_tokens, max_model_len - prompt_len)
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop string / stop token that ended it
        self.output_text = ""
        self.num_computed_tokens = 0  # tokens whose KV / state is in the cache
        self.num_cached_tokens = 0  # prompt tokens the prefix cache gave it when first admitted
        self.state_index = 0  # slot of its state group holding the state after the last computed token
        self.num_preemptions = 0
        self.draft_token_ids: list[int] = []  # proposed for the next step's verify
        self.draft_probs = None  # [len(draft_token_ids), vocab] tensor when the drafter sampled, else None
        # timestamps (time.monotonic()): arrival, each output token's delivery, finish
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.token_times: list[float] = []  # one per output token (a step's tokens share its time)
        self.finished_time: float | None = None

    def advance(self, num_new_tokens: int, num_accepted: int) -> None:
        """Move past ``num_new_tokens`` computed sequence tokens and ``num_accepted`` verified drafts."""
        self.num_computed_tokens += num_new_tokens + num_accepted
        self.state_index = num_accepted  # the slot of the group holding the state after the last accepted token

    def prompt_logprobs_due(self, start: int, end: int) -> list[int]:
        """The prompt tokens whose logprobs a step computing positions [start, end) gives (token t from the row of
        position t - 1), leaving out those already given (a re-prefill after preemption gives none twice)."""
        if self.prompt_logprobs is None:
            return []
        return self.prompt_token_ids[max(start + 1, len(self.prompt_logprobs)):min(end + 1, self.prompt_len)]

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """``token_ids[start:end]`` without building the whole list first (a decode step reads one token)."""
        return token_slice(self.prompt_token_ids, self.output_token_ids, start, end)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")


def token_slice(prompt: list[int], output: list[int], start: int, end: int) -> list[int]:
    """``(prompt + output)[start:end]`` without concatenating the two."""
    if start >= len(prompt):
        return output[start - len(prompt):end - len(prompt)]
    if end <= len(prompt):
        return prompt[start:end]
    return prompt[start:] + output[:end - len(prompt)]
