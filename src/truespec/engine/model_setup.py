"""What an engine runs, set up before its first step: the target model (and a drafter's weights) loaded and bound to
the engine's settings, the model runner with its KV cache and state slots sized and allocated, and the kernels and
CUDA graphs compiled / captured ahead of the first prompt (engine/llm_engine.py calls these in order)."""

import torch
from torch import nn

from truespec.config import EngineConfig
from truespec.core.gdn_prefill_rule import GdnPrefillRule
from truespec.core.scheduler import Scheduler
from truespec.kv_cache.config import CacheConfig
from truespec.kv_cache.layout import set_sparse_v
from truespec.kv_cache.manager import KVCacheManager
from truespec.kv_cache.sizing import make_kv_cache, resolve_max_model_len
from truespec.layers.linear import set_batch_invariant
from truespec.layers.rotary import share_fixed_tables
from truespec.models.loader import LoadedModel, load_model
from truespec.spec_decode.interface import Proposer
from truespec.spec_decode.model_drafter import ModelDrafter
from truespec.spec_decode.proposer import load_drafter, prefix_cache_extra_tokens
from truespec.worker.cpu_threads import configure_cpu_threads
from truespec.worker.graph_runner import GraphSettings
from truespec.worker.model_runner import ModelRunner


def max_positions(config: EngineConfig, max_model_len: int) -> int:
    """Positions a request's KV (its drafts' included) may reach: its block tables' length and the RoPE table's."""
    return max_model_len + config.num_speculative_tokens + 1


def load_models(config: EngineConfig, cache: CacheConfig, device: torch.device
                ) -> tuple[LoadedModel, nn.Module | None, int]:  # fmt: skip
    """The target model, the drafter's weights (None without a model drafter; its KV pool is sized later) and the
    engine's max_model_len (checked against the model's config). Each model gets the engine's batch invariance and
    sparse-V settings; on CUDA their RoPE rows are gathered from one table of ``max_positions`` rows (built before
    any capture: 5 launches a forward fewer); on the CPU the threads are configured for the model's size."""
    loaded = load_model(config.model, config.dtype, device)
    if device.type == "cpu":
        configure_cpu_threads(config.cpu_threads, loaded.hf_config.hidden_size)
    max_model_len = resolve_max_model_len(config.max_model_len, loaded.hf_config)
    drafter = load_drafter(config.speculative_config, loaded, device)
    models = [loaded.model] if drafter is None else [loaded.model, drafter]
    for model in models:
        set_batch_invariant(model, config.batch_invariant)
        set_sparse_v(model, cache)
    if device.type == "cuda":
        share_fixed_tables(models, max_positions(config, max_model_len), loaded.dtype)
    return loaded, drafter, max_model_len


def make_runner(config: EngineConfig, cache: CacheConfig, device: torch.device, loaded: LoadedModel,
                drafter: nn.Module | None, eos_token_ids: set[int], max_model_len: int
                ) -> tuple[ModelRunner, KVCacheManager, GraphSettings]:  # fmt: skip
    """The model runner, its cache manager (the KV pool what memory allows after the state slots: kv_cache/sizing.py)
    with the caches allocated, and the CUDA graph settings it was initialised with."""
    runner = ModelRunner(loaded.model, device, loaded.dtype, config.seed, eos_token_ids, cache.kv_cache_dtype)
    kv = make_kv_cache(cache, runner.kv_bytes_per_token, runner.state_bytes_per_slot, max_model_len,
                       config.max_num_seqs, config.num_speculative_tokens, device,
                       prefix_cache_extra_tokens(drafter), has_drafter_cache=drafter is not None)  # fmt: skip
    runner.allocate_caches(kv.blocks.num_ids, cache.block_size, kv.num_state_slots)
    capture_tokens = config.max_num_batched_tokens + config.max_num_seqs * config.num_speculative_tokens
    graphs = GraphSettings(mode=config.cudagraph_mode, block_size=cache.block_size,
                           capture_sizes=config.compilation_config.capture_sizes(capture_tokens),
                           max_blocks_per_req=-(-max_positions(config, max_model_len) // cache.block_size))  # fmt: skip
    runner.init_graphs(graphs)
    return runner, kv, graphs


def warm_up(config: EngineConfig, runner: ModelRunner, scheduler: Scheduler, proposer: Proposer | None,
            gdn_rule: GdnPrefillRule | None, num_blocks: int, block_size: int) -> None:
    """Compile the step's kernels now, not in a first prompt; with fla's GDN prefill also capture the piecewise
    graphs between its calls; a model drafter's graphs too."""
    runner.graphs.warm_up(config.max_num_batched_tokens, num_blocks, gdn_chunked=gdn_rule is not None)
    if gdn_rule is not None:
        runner.graphs.capture_piecewise(min(config.max_num_batched_tokens, num_blocks * block_size),
                                        config.max_num_seqs, scheduler.chunks.mixed_prefill_cap)  # fmt: skip
    if isinstance(proposer, ModelDrafter):
        proposer.graphs.warm_up(config.max_num_batched_tokens, num_blocks)
