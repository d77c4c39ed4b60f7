"""Engine configuration: frozen dataclasses, validated at construction with errors naming the field."""

from dataclasses import dataclass

DTYPES = ("auto", "float64", "float32", "bfloat16", "float16", "half", "float", "double")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_space_gib: float = 4.0  # KV pool size on CPU (vLLM's VLLM_CPU_KVCACHE_SPACE)
    seed: int = 0
    speculative_config: "SpeculativeConfig | dict | None" = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config", SpeculativeConfig.from_dict(self.speculative_config))
        _check(isinstance(self.model, str) and self.model != "", "model", "must be a directory path")
        _check(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        _check(self.device in DEVICES or str(self.device).startswith("cuda:"), "device",
               f"must be one of {DEVICES} or 'cuda:N', got {self.device!r}")
        _positive(self, "max_num_seqs", "max_num_batched_tokens", "block_size")
        _check(self.max_model_len is None or _pos_int(self.max_model_len), "max_model_len",
               f"must be a positive int, got {self.max_model_len!r}")
        _check(self.num_gpu_blocks_override is None or _pos_int(self.num_gpu_blocks_override),
               "num_gpu_blocks_override", f"must be a positive int, got {self.num_gpu_blocks_override!r}")
        _check(_number(self.gpu_memory_utilization) and 0 < self.gpu_memory_utilization <= 1,
               "gpu_memory_utilization", f"must be a number in (0, 1], got {self.gpu_memory_utilization!r}")
        _check(_number(self.cpu_kv_cache_space_gib) and self.cpu_kv_cache_space_gib > 0, "cpu_kv_cache_space_gib",
               f"must be a number > 0, got {self.cpu_kv_cache_space_gib!r}")
        _check(isinstance(self.seed, int) and not isinstance(self.seed, bool), "seed",
               f"must be an int, got {self.seed!r}")

    @property
    def num_speculative_tokens(self) -> int:
        return 0 if self.speculative_config is None else self.speculative_config.num_speculative_tokens


def _number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _pos_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def _positive(cfg: object, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        _check(_pos_int(value), name, f"must be a positive int, got {value!r}")


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name} {message}")


SPEC_METHODS = ("ngram", "draft_model", "mtp", "eagle")
MAX_SPECULATIVE_TOKENS = 64


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config`` keys."""

    method: str
    num_speculative_tokens: int
    model: str | None = None  # draft_model / eagle: the drafter's directory
    prompt_lookup_min: int | None = None  # ngram: shortest suffix n-gram to look up
    prompt_lookup_max: int | None = None  # ngram: longest

    def __post_init__(self) -> None:
        _check(self.method in SPEC_METHODS, "speculative_config.method",
               f"must be one of {SPEC_METHODS}, got {self.method!r}")
        k = self.num_speculative_tokens
        _check(_pos_int(k) and k <= MAX_SPECULATIVE_TOKENS, "speculative_config.num_speculative_tokens",
               f"must be an int in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        needs_model = self.method in ("draft_model", "eagle")
        _check(not needs_model or isinstance(self.model, str), "speculative_config.model",
               f"is required for method {self.method!r} (the drafter's directory)")
        if self.method == "ngram":  # vLLM: both default to 5; one given sets the other
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            object.__setattr__(self, "prompt_lookup_min", lo if lo is not None else (hi or 5))
            object.__setattr__(self, "prompt_lookup_max", hi if hi is not None else (lo or 5))
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            _check(_pos_int(lo) and _pos_int(hi) and lo <= hi, "speculative_config.prompt_lookup_min",
                   f"and prompt_lookup_max must satisfy 1 <= min <= max, got {lo!r}, {hi!r}")

    @classmethod
    def from_dict(cls, d: "dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        if d is None or isinstance(d, SpeculativeConfig):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(d).__name__}")
        known = {"method", "num_speculative_tokens", "model", "prompt_lookup_min", "prompt_lookup_max"}
        unknown = sorted(set(d) - known)
        _check(not unknown, "speculative_config", f"has unknown keys {unknown}; known: {sorted(known)}")
        _check("method" in d and "num_speculative_tokens" in d, "speculative_config",
               "needs 'method' and 'num_speculative_tokens'")
        return cls(**d)
