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

    def __post_init__(self) -> None:
        _check(isinstance(self.model, str) and self.model != "", "model", "must be a directory path")
        _check(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        _check(self.device in DEVICES or str(self.device).startswith("cuda:"), "device",
               f"must be one of {DEVICES} or 'cuda:N', got {self.device!r}")
        _positive(self, "max_num_seqs", "max_num_batched_tokens", "block_size")
        _check(self.max_model_len is None or _pos_int(self.max_model_len), "max_model_len",
               f"must be a positive int, got {self.max_model_len!r}")
        _check(self.num_gpu_blocks_override is None or _pos_int(self.num_gpu_blocks_override),
               "num_gpu_blocks_override", f"must be a positive int, got {self.num_gpu_blocks_override!r}")
        _check(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization",
               f"must be in (0, 1], got {self.gpu_memory_utilization!r}")
        _check(self.cpu_kv_cache_space_gib > 0, "cpu_kv_cache_space_gib", "must be > 0")
        _check(isinstance(self.seed, int), "seed", f"must be an int, got {self.seed!r}")


def _pos_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def _positive(cfg: object, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        _check(_pos_int(value), name, f"must be a positive int, got {value!r}")


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name} {message}")
