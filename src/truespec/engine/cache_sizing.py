"""How many KV blocks the pool gets, and the longest sequence the engine accepts."""

import torch
from transformers import PretrainedConfig

from truespec.config import EngineConfig
from truespec.engine.model_runner import ModelRunner


def resolve_max_model_len(config: EngineConfig, hf_config: PretrainedConfig) -> int:
    model_max = getattr(hf_config, "max_position_embeddings", None)
    if config.max_model_len is None:
        return model_max or 2048
    if model_max is not None and config.max_model_len > model_max:
        raise ValueError(f"max_model_len={config.max_model_len} is larger than the model's "
                         f"max_position_embeddings={model_max}")
    return config.max_model_len


def size_kv_pool(config: EngineConfig, runner: ModelRunner, max_model_len: int, num_state_slots: int) -> int:
    """Number of KV blocks: the override, else what memory allows (never more than can be used)."""
    bs = config.block_size
    useful = config.max_num_seqs * -(-max_model_len // bs)  # every running request at full length
    bytes_per_block = runner.kv_bytes_per_token * bs
    if config.num_gpu_blocks_override is not None:
        num_blocks = config.num_gpu_blocks_override
    elif bytes_per_block == 0:
        num_blocks = useful
    else:
        num_blocks = min(useful, _kv_budget_bytes(config, runner, num_state_slots) // bytes_per_block)
    if num_blocks * bs < max_model_len:
        raise ValueError(f"the KV cache holds {num_blocks} blocks x {bs} tokens = {num_blocks * bs} tokens, "
                         f"fewer than max_model_len={max_model_len}: lower max_model_len or give the cache "
                         "more room (num_gpu_blocks_override / gpu_memory_utilization)")
    return num_blocks


def _kv_budget_bytes(config: EngineConfig, runner: ModelRunner, num_state_slots: int) -> int:
    state_bytes = runner.state_bytes_per_slot * num_state_slots
    if runner.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(runner.device)
        budget = int(total * config.gpu_memory_utilization) - (total - free)
    else:
        budget = int(config.cpu_kv_cache_space_gib * 2**30)
    return max(0, budget - state_bytes)
