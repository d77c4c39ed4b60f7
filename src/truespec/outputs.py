"""What generate() returns, shaped like vLLM's RequestOutput / CompletionOutput."""

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token that ended it, if any
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None  # per output token: {token_id: logprob} (raw logits)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
