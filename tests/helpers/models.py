"""Test helpers for model-level tests: tiny random HF checkpoints, a ForwardContext built by hand,
and a minimal cache-owning runner (the engine has its own; this one is deliberately naive)."""

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch.overrides import TorchFunctionMode
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen3_5Config,
    Qwen3_5TextConfig,
    Qwen3Config,
)

from helpers import VOCAB_SIZE
from truespec.forward_context import ForwardContext, set_forward_context
from truespec.models.base import CausalLM

L, F = "linear_attention", "full_attention"


# ---------------------------------------------------------------------------------------------- configs
def tiny_qwen3_5_config(
    layer_types: list[str],
    *,
    tie: bool = False,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    partial_rotary_factor: float = 0.25,
    linear_num_key_heads: int = 2,
    linear_num_value_heads: int = 4,
    linear_key_head_dim: int = 12,
    linear_value_head_dim: int = 10,
) -> Qwen3_5TextConfig:
    """Odd sizes on purpose (hidden 72, intermediate 97); value heads grouped 2 per key head by default."""
    return Qwen3_5TextConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=72,
        intermediate_size=97,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        linear_num_key_heads=linear_num_key_heads,
        linear_num_value_heads=linear_num_value_heads,
        linear_key_head_dim=linear_key_head_dim,
        linear_value_head_dim=linear_value_head_dim,
        linear_conv_kernel_dim=4,
        tie_word_embeddings=tie,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial_rotary_factor},
        max_position_embeddings=256,
    )


def tiny_qwen3_config(*, tie: bool = True, attention_bias: bool = False) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=72,
        intermediate_size=97,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=20,
        tie_word_embeddings=tie,
        attention_bias=attention_bias,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        max_position_embeddings=256,
    )


def tiny_llama_config(
    *, rope_parameters: dict[str, Any] | None = None, attention_bias: bool = False, mlp_bias: bool = False
) -> LlamaConfig:
    """head_dim = 72 / 6 = 12 (derived, not set); 3 kv heads for 6 query heads."""
    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=72,
        intermediate_size=97,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=3,
        attention_bias=attention_bias,
        mlp_bias=mlp_bias,
        rope_parameters=rope_parameters or {"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=64,
    )


# ------------------------------------------------------------------------------------------ checkpoints
@torch.no_grad()
def build_hf_model(config: PretrainedConfig, seed: int = 0) -> PreTrainedModel:
    """A float64 transformers model (eager attention) with every parameter randomised around its init:
    matrices ~ N(0, 1/fan_in) so activations stay O(1); vectors (norms, A_log, dt_bias, biases) get
    N(0, 0.1) noise added to their init so (1 + w) norms, decays and biases are all non-trivial."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64, attn_implementation="eager")
    for param in model.parameters():
        if param.ndim >= 2:
            param.normal_(0.0, param.shape[-1] ** -0.5)
        else:
            param.add_(0.1 * torch.randn_like(param))
    return model.eval()


def save_checkpoint(model: PreTrainedModel, path: Path) -> Path:
    model.save_pretrained(path)
    return path


def save_multimodal_qwen3_5_checkpoint(text_model: PreTrainedModel, path: Path) -> dict[str, torch.Tensor]:
    """Re-save a qwen3_5_text model as a multimodal ``qwen3_5`` checkpoint in 2 shards: nested text_config,
    weights under ``model.language_model.``, plus fake ``model.visual.*`` and ``mtp.*`` tensors.
    Returns the mtp tensors written."""
    path.mkdir(parents=True, exist_ok=True)
    text_config = text_model.config
    config = Qwen3_5Config(text_config=text_config.to_dict(), tie_word_embeddings=text_config.tie_word_embeddings)
    config.save_pretrained(path)
    tensors = {}
    for name, tensor in text_model.state_dict().items():
        if name == "lm_head.weight" and text_config.tie_word_embeddings:
            continue
        tensors[name.replace("model.", "model.language_model.", 1)] = tensor.contiguous()
    gen = torch.Generator().manual_seed(1)
    hidden = text_config.hidden_size
    tensors["model.visual.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 2, 2, dtype=torch.float64, generator=gen)
    tensors["model.visual.merger.linear_fc2.bias"] = torch.randn(hidden, dtype=torch.float64, generator=gen)
    mtp = {
        "mtp.fc.weight": torch.randn(hidden, 2 * hidden, dtype=torch.float64, generator=gen),
        "mtp.norm.weight": torch.randn(hidden, dtype=torch.float64, generator=gen),
    }
    tensors.update(mtp)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(path / shard))
        weight_map.update(dict.fromkeys(shard_names, shard))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return mtp


class transformers_in_float64(TorchFunctionMode):  # noqa: N801 (used like a function: `with ...():`)
    """Rewrites every float32 cast inside transformers' forward to float64.

    transformers runs RMSNorm, RoPE angles, GDN and softmax in float32 even for a float64 model, which
    bounds its agreement with an all-float64 implementation at ~1e-6. Under this mode its forward is
    float64 throughout (RoPE ``inv_freq`` stays the float32-derived table computed at init, as ours),
    so the remaining difference is summation order only (~1e-14): a much sharper parity check.
    """

    def __torch_function__(
        self, func: Callable, types: tuple, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func is torch.Tensor.float:
            return args[0].double()
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        kwargs = {k: torch.float64 if v is torch.float32 else v for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)


@torch.no_grad()
def hf_logits(model: PreTrainedModel, token_ids: list[int], upcast: bool = False) -> torch.Tensor:
    """transformers' own logits for one unpadded sequence: [len, vocab] (all-float64 if ``upcast``)."""
    if upcast:
        with transformers_in_float64():
            return model(torch.tensor([token_ids])).logits[0]
    return model(torch.tensor([token_ids])).logits[0]


# -------------------------------------------------------------------------------------- forward context
@dataclass
class StepRequest:
    """One request's part of a step: ``num_new`` tokens after ``num_cached`` already in its KV/state."""

    num_cached: int
    num_new: int
    block_table: list[int]
    state_src: int = -1  # slot holding the state after the last cached token; -1 = zeros
    state_dst: int = -1  # first slot of the request's group; -1 = inert (padding)
    state_write_start: int | None = None  # default: write only the last token's state
    is_padding: bool = False  # padding rows write no KV (slot -1)


def make_forward_context(
    reqs: list[StepRequest], block_size: int, num_pad_tokens: int = 0, device: torch.device | str = "cpu"
) -> ForwardContext:
    """A ForwardContext for ``reqs`` packed in order (tensors on ``device``); ``num_pad_tokens`` trailing
    tokens belong to no request (slot -1), like a batch padded up to a captured size."""
    query_start_loc, slot_mapping = [0], []
    for req in reqs:
        query_start_loc.append(query_start_loc[-1] + req.num_new)
        for pos in range(req.num_cached, req.num_cached + req.num_new):
            block = req.block_table[pos // block_size]
            slot_mapping.append(-1 if req.is_padding else block * block_size + pos % block_size)
    slot_mapping += [-1] * num_pad_tokens
    max_blocks = max(len(r.block_table) for r in reqs)
    block_tables = [r.block_table + [-1] * (max_blocks - len(r.block_table)) for r in reqs]
    seq_lens = [r.num_cached + r.num_new for r in reqs]
    write_start = [r.num_new - 1 if r.state_write_start is None else r.state_write_start for r in reqs]

    def i64(values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return ForwardContext(
        query_start_loc=i64(query_start_loc),
        seq_lens=i64(seq_lens),
        slot_mapping=i64(slot_mapping),
        block_tables=i64(block_tables),
        state_src=i64([r.state_src for r in reqs]),
        state_dst=i64([r.state_dst for r in reqs]),
        state_write_start=i64(write_start),
        logits_indices=torch.arange(query_start_loc[-1], dtype=torch.int64, device=device),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )


class NaiveRunner:
    """Binds caches to a model (filled with NaN, so reading anything never written poisons the output)
    and runs one step for explicit StepRequests."""

    def __init__(self, model: CausalLM, num_blocks: int = 32, block_size: int = 4, num_slots: int = 16) -> None:
        self.model, self.block_size = model, block_size
        self.device = device = model.embed_tokens.weight.device
        for layer in model.attention_layers():
            shape = layer.kv_cache_shape(num_blocks, block_size)
            layer.kv_cache = torch.full(shape, float("nan"), dtype=model.dtype, device=device)
        for layer in model.gdn_layers():
            (conv_shape, ssm_shape), (conv_dtype, ssm_dtype) = layer.state_shapes(), layer.state_dtypes()
            layer.conv_state = torch.full((num_slots, *conv_shape), float("nan"), dtype=conv_dtype, device=device)
            layer.ssm_state = torch.full((num_slots, *ssm_shape), float("nan"), dtype=ssm_dtype, device=device)

    def step(self, reqs: list[StepRequest], token_ids: list[list[int]], num_pad_tokens: int = 0) -> list[torch.Tensor]:
        """Run one packed forward; returns each request's logits [num_new, vocab]."""
        ctx = make_forward_context(reqs, self.block_size, num_pad_tokens, self.device)
        flat_ids = [t for ids in token_ids for t in ids] + [0] * num_pad_tokens
        positions = [p for r in reqs for p in range(r.num_cached, r.num_cached + r.num_new)] + [0] * num_pad_tokens
        with torch.no_grad(), set_forward_context(ctx):
            hidden = self.model(torch.tensor(flat_ids, device=self.device), torch.tensor(positions, device=self.device))
        logits = self.model.compute_logits(hidden)
        qsl = ctx.query_start_loc_cpu
        return [logits[qsl[i] : qsl[i + 1]] for i in range(len(reqs))]

    def _cache_tensors(self) -> list[torch.Tensor]:
        tensors = [layer.kv_cache for layer in self.model.attention_layers()]
        for layer in self.model.gdn_layers():
            tensors += [layer.conv_state, layer.ssm_state]
        return tensors

    def snapshot(self) -> list[torch.Tensor]:
        """Clones of every bound cache tensor (to check what a step wrote, or to rewind)."""
        return [t.clone() for t in self._cache_tensors()]

    def restore(self, snapshot: list[torch.Tensor]) -> None:
        for tensor, saved in zip(self._cache_tensors(), snapshot, strict=True):
            tensor.copy_(saved)
