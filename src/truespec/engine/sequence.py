"""Request state: token ids, how many are in the cache, where its KV blocks and state slots are."""

from enum import Enum, auto

from truespec.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, max_output_len: int) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[dict[int, float]] = []  # when params.logprobs is set
        self.params = params
        self.max_output_len = max_output_len  # min(max_tokens, max_model_len - prompt_len)
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop string / stop token that ended it
        self.output_text = ""
        self.num_computed_tokens = 0  # tokens whose KV / state is in the cache
        self.block_ids: list[int] = []
        self.state_group: int | None = None  # recurrent-state group (1 + k_max slots)
        self.state_index = 0  # slot inside the group holding the state after the last computed token
        self.num_preemptions = 0
        self.num_drafter_computed_tokens = 0  # positions in a model drafter's cache
        self.draft_token_ids: list[int] = []  # proposed for the next step's verify
        self.draft_probs = None  # [len(draft_token_ids), vocab] tensor when the drafter sampled, else None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
