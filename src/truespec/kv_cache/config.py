"""CacheConfig: what the user chooses about the cache (frozen, validated; errors name the field).

How many blocks fit is discovered when the engine sizes the pool (``sizing.py``) and lives in the
``KVCacheManager`` that holds them.
"""

import os
from dataclasses import dataclass

from truespec.config import EngineConfig, check, is_finite, is_pos_int

# "auto": the model's dtype; the others are described in formats.py (which imports torch: this module does not)
KV_CACHE_DTYPES = ("auto", "fp8", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")
SPARSE_V_MODES = ("off", "on", "auto")
# (EngineConfig field, environment variable read when the field is None, its parser, the default without either)
_SPARSE_V_SETTINGS = (("sparse_v", "TRUESPEC_SPARSE_V", str, "off"),
                      ("sparse_v_threshold", "TRUESPEC_SPARSE_V_THRESHOLD", float, 1e-3),
                      ("sparse_v_ctx_threshold", "TRUESPEC_SPARSE_V_CTX_THRESHOLD", int, 8192))


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    kv_cache_dtype: str = "auto"
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9  # share of the device's memory the engine may fill (CUDA)
    cpu_kv_cache_space_gib: float = 4.0  # KV pool size on CPU (vLLM's VLLM_CPU_KVCACHE_SPACE)
    # Sparse-V (attention kernels): a KV tile whose softmax weights, normalised by the running sum, are all below
    # sparse_v_threshold adds nothing measurable to the output, so its V is neither loaded nor decoded. "on": for
    # every row; "auto": for rows with at least sparse_v_ctx_threshold keys; "off" (and threshold 0) never skip.
    sparse_v: str = "off"
    sparse_v_threshold: float = 1e-3
    sparse_v_ctx_threshold: int = 8192
    # prefix caching: see EngineConfig; the interval's None is resolved from the model's sizes (sizing.py)
    enable_prefix_caching: bool = True
    prefix_state_interval: int | None = None
    prefix_state_budget: float = 0.1

    def __post_init__(self) -> None:
        check(is_pos_int(self.block_size), "block_size", f"must be a positive int, got {self.block_size!r}")
        check(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype",
              f"must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        check(self.num_gpu_blocks_override is None or is_pos_int(self.num_gpu_blocks_override),
              "num_gpu_blocks_override", f"must be a positive int, got {self.num_gpu_blocks_override!r}")
        check(is_finite(self.gpu_memory_utilization) and 0 < self.gpu_memory_utilization <= 1,
              "gpu_memory_utilization", f"must be a number in (0, 1], got {self.gpu_memory_utilization!r}")
        check(is_finite(self.cpu_kv_cache_space_gib) and self.cpu_kv_cache_space_gib > 0, "cpu_kv_cache_space_gib",
              f"must be a finite number > 0, got {self.cpu_kv_cache_space_gib!r}")
        check(self.sparse_v in SPARSE_V_MODES, "sparse_v", f"must be one of {SPARSE_V_MODES}, got {self.sparse_v!r}")
        check(is_finite(self.sparse_v_threshold) and 0 <= self.sparse_v_threshold < 1, "sparse_v_threshold",
              f"must be a number in [0, 1), got {self.sparse_v_threshold!r}")
        check(isinstance(self.sparse_v_ctx_threshold, int) and not isinstance(self.sparse_v_ctx_threshold, bool)
              and self.sparse_v_ctx_threshold >= 0, "sparse_v_ctx_threshold",
              f"must be an int >= 0, got {self.sparse_v_ctx_threshold!r}")

        interval, bs = self.prefix_state_interval, self.block_size
        check(interval is None or is_pos_int(interval) and interval % bs == 0, "prefix_state_interval",
              f"must be None or a positive multiple of block_size ({bs}), got {interval!r}")
        check(is_finite(self.prefix_state_budget) and 0 <= self.prefix_state_budget < 1, "prefix_state_budget",
              f"must be a number in [0, 1) (the share of the cache memory for state checkpoints), got "
              f"{self.prefix_state_budget!r}")

    @property
    def sparse_v_min_keys(self) -> int | None:
        """Rows with at least this many keys may skip V tiles; None: sparse-V is off (mode off or threshold 0)."""
        if self.sparse_v == "off" or self.sparse_v_threshold == 0:
            return None
        return self.sparse_v_ctx_threshold if self.sparse_v == "auto" else 0

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> "CacheConfig":
        """The cache settings of ``config``."""
        return cls(block_size=config.block_size, kv_cache_dtype=config.kv_cache_dtype,
                   num_gpu_blocks_override=config.num_gpu_blocks_override,
                   gpu_memory_utilization=config.gpu_memory_utilization,
                   cpu_kv_cache_space_gib=config.cpu_kv_cache_space_gib,
                   enable_prefix_caching=config.enable_prefix_caching,
                   prefix_state_interval=config.prefix_state_interval,
                   prefix_state_budget=config.prefix_state_budget, **_sparse_v_settings(config))


def _sparse_v_settings(config: EngineConfig) -> dict[str, object]:
    """The sparse-V fields: the config's, else the environment's (an unparsable value names its variable)."""
    settings: dict[str, object] = {}
    for name, env, parse, default in _SPARSE_V_SETTINGS:
        value = getattr(config, name)
        if value is None and os.environ.get(env):
            try:
                value = parse(os.environ[env])
            except ValueError:
                raise ValueError(f"{env}={os.environ[env]!r} is not a valid {name}") from None
        settings[name] = default if value is None else value
    return settings
