"""CacheConfig: what the user chooses about the cache (frozen, validated; errors name the field).

How many blocks fit is discovered when the engine sizes the pool (``sizing.py``) and lives in the
``KVCacheManager`` that holds them.
"""

from dataclasses import dataclass

from truespec.config import EngineConfig, check, is_finite, is_pos_int

# "auto": the model's dtype; the others are described in formats.py (which imports torch: this module does not)
KV_CACHE_DTYPES = ("auto", "fp8", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    kv_cache_dtype: str = "auto"
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9  # share of the device's memory the engine may fill (CUDA)
    cpu_kv_cache_space_gib: float = 4.0  # KV pool size on CPU (vLLM's VLLM_CPU_KVCACHE_SPACE)

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

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> "CacheConfig":
        return cls(block_size=config.block_size, kv_cache_dtype=config.kv_cache_dtype,
                   num_gpu_blocks_override=config.num_gpu_blocks_override,
                   gpu_memory_utilization=config.gpu_memory_utilization,
                   cpu_kv_cache_space_gib=config.cpu_kv_cache_space_gib)
