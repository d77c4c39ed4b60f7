"""Write a model directory *shaped* like Qwen3.5-0.8B's text model (random weights, bf16 safetensors) with the
embedded model's tokenizer, so the engine can be timed at real size without downloading weights.

    python3 benchmarks/qwen35_shape.py --out /tmp/qwen35-0.8b-shape [--seed 0] [--tiny] [--device cuda]

The config is the embedded model's (src/truespec/assets/stdlib-qwen35/config.json) with Qwen3.5-0.8B's sizes.
The vocabulary is Qwen3.5's 248320 ids; the tokenizer knows only the first 2048, which is fine for random-id
prompts (unknown ids decode to nothing). There are no ``mtp.*`` weights, so ``mtp_num_hidden_layers`` is dropped.
``--tiny`` writes a 2-layer model (one GDN layer, one gated-attention layer) with a 4096-id vocabulary for CPU tests.
"""

import argparse
import json
import shutil
from pathlib import Path

import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from truespec.assets import DEFAULT_MODEL_DIR

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")

# Qwen3.5-0.8B's text model: 24 layers, 3 GDN (linear_attention) then 1 gated full_attention, six times.
QWEN35_08B = dict(
    vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
    layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=8, num_key_value_heads=2,
    head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=262144, rms_norm_eps=1e-6,
    tie_word_embeddings=True, hidden_act="silu",
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
)
TINY = dict(
    QWEN35_08B, vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    layer_types=["linear_attention", "full_attention"], num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
)


def shaped_config(tiny: bool) -> Qwen3_5TextConfig:
    """The embedded model's config with the sizes replaced (layer_types repeated to num_hidden_layers)."""
    base = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    for key in ("transformers_version", "mtp_num_hidden_layers", "dtype"):
        base.pop(key, None)
    sizes = dict(TINY if tiny else QWEN35_08B)
    pattern = sizes["layer_types"]
    sizes["layer_types"] = pattern * (sizes["num_hidden_layers"] // len(pattern))
    base.update(sizes, partial_rotary_factor=sizes["rope_parameters"]["partial_rotary_factor"])
    return Qwen3_5TextConfig(**base)


def write_model(out: Path, seed: int = 0, tiny: bool = False, device: str = "cpu") -> dict[str, int]:
    """Random weights (transformers' default init) in bf16, config and tokenizer in ``out``; returns sizes."""
    config = shaped_config(tiny)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3_5ForCausalLM(config).to(torch.bfloat16).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(DEFAULT_MODEL_DIR / name, out / name)
    unique = {p.data_ptr(): p for p in model.parameters()}.values()  # tied lm_head counted once
    return {"num_params": sum(p.numel() for p in unique),
            "num_bytes": sum(p.numel() * p.element_size() for p in unique)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer small model for CPU tests")
    parser.add_argument("--device", default="cpu", help="where to initialise the weights (cuda is faster)")
    args = parser.parse_args()
    if args.tiny:  # CPU tests on small machines: one thread avoids the pool contending with itself
        torch.set_num_threads(1)
    sizes = write_model(args.out, args.seed, args.tiny, args.device)
    print(f"wrote {args.out}: {sizes['num_params'] / 1e6:.1f}M parameters, {sizes['num_bytes'] / 2**30:.3f} GiB "
          f"({sizes['num_bytes']} bytes) in bf16")


if __name__ == "__main__":
    main()
