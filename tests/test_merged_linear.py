"""Merged projections (layers/linear.py): one GEMM per group of projections, checkpoints still in HF names.

The state dict of every truespec model must name its tensors exactly as the transformers model of the same
config does (the loader, the draft-head loaders and the test fixtures write and read them by those names),
while the module holds one merged parameter per group whose rows are the checkpoint tensors in order.
"""

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

from helpers.models import F as FULL
from helpers.models import L, build_hf_model, save_checkpoint, tiny_llama_config, tiny_qwen3_5_config, tiny_qwen3_config
from truespec.layers.linear import MergedLinear, use_checkpoint_names
from truespec.models import load_model
from truespec.models.registry import get_model_class

CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "qwen3_5": lambda: tiny_qwen3_5_config([L, FULL], tie=True),
    "qwen3_bias": lambda: tiny_qwen3_config(attention_bias=True),
    "llama_bias": lambda: tiny_llama_config(attention_bias=True, mlp_bias=True),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_state_dict_names_are_the_checkpoint_names(name: str) -> None:
    config = CONFIGS[name]()
    hf_names = set(build_hf_model(config).state_dict())
    if config.tie_word_embeddings:
        hf_names.discard("lm_head.weight")
    model = get_model_class(config.model_type)(config)
    assert set(model.state_dict()) == hf_names
    merged = [n for n, _ in model.named_parameters() if "qkv_proj" in n or "gate_up_proj" in n]
    assert merged, "the attention and MLP projections are merged parameters"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_loaded_merged_weight_rows_are_the_checkpoint_tensors(name: str, tmp_path: Path) -> None:
    hf = build_hf_model(CONFIGS[name]())
    model = load_model(save_checkpoint(hf, tmp_path / name), "float64").model
    expected = hf.state_dict()
    layer = model.model.layers[-1]
    prefix = f"model.layers.{len(model.model.layers) - 1}."
    groups = [
        (layer.self_attn.qkv_proj, "self_attn.", ("q_proj", "k_proj", "v_proj")),
        (layer.mlp.gate_up_proj, "mlp.", ("gate_proj", "up_proj")),
    ]
    for merged, scope, shards in groups:
        for suffix in ("weight", "bias"):
            if getattr(merged, suffix) is None:
                continue
            rows = torch.cat([expected[f"{prefix}{scope}{s}.{suffix}"] for s in shards])
            assert torch.equal(getattr(merged, suffix), rows), (scope, suffix)


def test_state_dict_views_write_through_and_round_trip() -> None:
    """The loaders copy into ``state_dict()`` entries: those must be views of the merged parameter."""
    torch.manual_seed(0)
    config = CONFIGS["qwen3_bias"]()
    a, b = (get_model_class(config.model_type)(config).double() for _ in range(2))
    with torch.no_grad():
        b.state_dict()["model.layers.0.self_attn.k_proj.weight"].fill_(2.5)
        b.state_dict()["model.layers.0.self_attn.v_proj.bias"].fill_(-1.5)
    qkv = b.model.layers[0].self_attn.qkv_proj
    rows = qkv.shard_rows()
    assert (qkv.weight[rows["k_proj"]] == 2.5).all() and (qkv.bias[rows["v_proj"]] == -1.5).all()
    assert not (qkv.weight[rows["q_proj"]] == 2.5).any()
    b.load_state_dict(a.state_dict())  # strict: the checkpoint names are all it expects
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name


def test_load_state_dict_names_an_absent_shard() -> None:
    module = torch.nn.Module()
    module.gate_up_proj = MergedLinear(6, {"gate_proj": 4, "up_proj": 4})
    use_checkpoint_names(module)
    state = module.state_dict()
    assert list(state) == ["gate_proj.weight", "up_proj.weight"]
    del state["up_proj.weight"]
    with pytest.raises(RuntimeError, match=r"(?s)Missing key.*gate_up_proj\.weight.*Unexpected key.*gate_proj\.weight"):
        module.load_state_dict(state)


def test_merged_projection_equals_the_separate_projections() -> None:
    gen = torch.Generator().manual_seed(1)
    merged = MergedLinear(24, {"q_proj": 16, "k_proj": 8, "v_proj": 8}, bias=True).double()
    x = torch.randn(7, 24, dtype=torch.float64, generator=gen)
    with torch.no_grad():
        merged.weight.copy_(torch.randn(32, 24, dtype=torch.float64, generator=gen))
        merged.bias.copy_(torch.randn(32, dtype=torch.float64, generator=gen))
        outputs = merged.split(merged(x))
    for out, rows in zip(outputs, merged.shard_rows().values(), strict=True):
        separate = F.linear(x, merged.weight[rows], merged.bias[rows])
        torch.testing.assert_close(out, separate, rtol=1e-13, atol=1e-13)
