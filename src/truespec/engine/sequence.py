"""Request state: token ids, how many are in the cache, where its KV blocks and state slots are."""

from enum import Enum, auto

import torch

from truespec.sampling_params import SamplingParams

# An output token not yet known on the host (async scheduling): the device holds it, the engine fills it in
PLACEHOLDER = -1


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

    def make_generator(self, device: object, engine_seed: int, stream: int = 0) -> "torch.Generator":
        """The request's own random stream (``stream`` 0: the target's sampling; 1: a drafter's), seeded by
        ``params.seed`` or else by the engine seed and the request id: the same whatever the batch."""
        base = self.params.seed if self.params.seed is not None else engine_seed * 1_000_003 + int(self.request_id)
        gen = torch.Generator(device=device)
        gen.manual_seed((base + stream * 0x9E3779B97F4A7C15) % 2**64)
        return gen

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """``token_ids[start:end]`` without building the whole list first (a decode step reads one token)."""
        prompt_len = len(self.prompt_token_ids)
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len:end - prompt_len]
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - prompt_len]

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
