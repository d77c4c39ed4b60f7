"""Shared fixtures: tiny random models of each architecture, saved in float64 with a real tokenizer."""

from pathlib import Path

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from helpers import VOCAB_SIZE
from helpers.tokenizer import save_tokenizer

# One thread: on the 2-core CI machine, torch's thread pool contending with itself makes tests ~20x slower.
torch.set_num_threads(1)

# Large init so tiny random models give varied, low-margin-free greedy continuations.
COMMON = dict(vocab_size=VOCAB_SIZE, max_position_embeddings=1024, eos_token_id=None, initializer_range=0.3)


def _hybrid() -> torch.nn.Module:
    cfg = Qwen3_5TextConfig(**COMMON, hidden_size=48, intermediate_size=72, num_hidden_layers=4,
                            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=8,
                            linear_value_head_dim=12, linear_num_key_heads=2, linear_num_value_heads=4,
                            tie_word_embeddings=False)
    return Qwen3_5ForCausalLM(cfg)


def _qwen3() -> torch.nn.Module:
    cfg = Qwen3Config(**COMMON, hidden_size=40, intermediate_size=56, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=10, tie_word_embeddings=True)
    return Qwen3ForCausalLM(cfg)


def _llama() -> torch.nn.Module:
    cfg = LlamaConfig(**COMMON, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
                      num_key_value_heads=3, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


BUILDERS = {"hybrid": _hybrid, "qwen3": _qwen3, "llama": _llama}


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Name -> directory of a saved float64 random model (with tokenizer)."""
    root = tmp_path_factory.mktemp("tiny_models")
    dirs = {}
    for name, build in BUILDERS.items():
        torch.manual_seed(0)
        model = build().to(torch.float64).eval()
        model.save_pretrained(root / name)
        save_tokenizer(root / name, VOCAB_SIZE - 8)
        dirs[name] = root / name
    return dirs


def _add_random_mtp(model_dir: Path) -> None:
    """Append random ``mtp.*`` tensors (Qwen3.5 naming) to a saved hybrid checkpoint."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from truespec.models.mtp import MTPHead

    config = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(1)
    head = MTPHead(config, target=None).to(torch.float64)
    weights = load_file(str(model_dir / "model.safetensors"))
    for name, tensor in head.state_dict().items():
        weights["mtp." + name] = tensor.normal_(0, 0.3) if "norm" not in name else tensor.uniform_(-0.2, 0.2)
    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})


def _random_eagle_head(out: Path, target_config: object) -> None:
    from transformers import Qwen3Config

    from truespec.models.eagle import EagleHead, save_eagle_head

    layer = Qwen3Config(hidden_size=target_config.hidden_size, intermediate_size=40, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=12, vocab_size=VOCAB_SIZE, max_position_embeddings=1024)
    torch.manual_seed(2)
    head = EagleHead(layer, target=None).to(torch.float64)
    for name, p in head.named_parameters():
        p.data.normal_(0, 0.3) if "norm" not in name else p.data.uniform_(0.8, 1.2)
    save_eagle_head(out, layer, head.state_dict(), dtype=torch.float64)


@pytest.fixture(scope="session")
def hybrid_with_heads(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A hybrid checkpoint with random MTP weights, and random EAGLE heads for it and for the dense qwen3."""
    import shutil

    from transformers import AutoConfig

    root = tmp_path_factory.mktemp("heads")
    shutil.copytree(tiny_models["hybrid"], root / "hybrid_mtp")
    _add_random_mtp(root / "hybrid_mtp")
    _random_eagle_head(root / "eagle", AutoConfig.from_pretrained(tiny_models["hybrid"]))
    _random_eagle_head(root / "eagle_dense", AutoConfig.from_pretrained(tiny_models["qwen3"]))
    return {"target": root / "hybrid_mtp", "eagle": root / "eagle", "eagle_dense": root / "eagle_dense"}
