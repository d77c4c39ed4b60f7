"""What the engine returns, shaped like vLLM's RequestOutput / CompletionOutput / RequestMetrics."""

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str  # the output text (only the new text for RequestOutputKind.DELTA)
    token_ids: list[int]  # the output tokens (only the new ones for DELTA)
    finish_reason: str | None  # "stop" | "length" | "abort"; None while running
    stop_reason: int | str | None = None  # the stop string or stop token that ended it, if any
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None  # per output token: {token_id: logprob} (raw logits)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """A request's timestamps, in seconds of ``time.monotonic()``."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # when each output token reached the host

    @property
    def time_to_first_token(self) -> float | None:
        """TTFT: from arrival to the first output token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """TPOT: the mean time between output tokens after the first (None with fewer than two)."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    # SamplingParams.prompt_logprobs: per prompt token, None for the first, then {token_id: logprob} (raw logits)
    # holding the prompt token and the n most likely ones given the tokens before it; None unless asked
    prompt_logprobs: list[dict[int, float] | None] | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    metrics: RequestMetrics | None = None
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache gave it (vLLM's field)
