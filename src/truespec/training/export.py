"""Writing the HF-format asset directories: bf16 safetensors (target + `mtp.*`), configs, tokenizer."""

import copy
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerFast

from .models import MTPHead


def _save_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    model = copy.deepcopy(model).to(device="cpu", dtype=torch.bfloat16).eval()
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(
        eos_token_id=model.config.eos_token_id, pad_token_id=model.config.pad_token_id, do_sample=False
    )
    model.save_pretrained(out_dir)
    (out_dir / "model.safetensors").chmod(0o644)
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)  # chat template inside tokenizer_config.json


def save_target(model: PreTrainedModel, mtp: MTPHead, tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    """The Qwen3.5 checkpoint plus its MTP layer stored under `mtp.*`, as Qwen3.5 checkpoints store it."""
    _save_model(model, tokenizer, out_dir)
    path = out_dir / "model.safetensors"
    tensors = load_file(path)
    for name, tensor in mtp.state_dict().items():
        tensors[f"mtp.{name}"] = tensor.detach().to("cpu", torch.bfloat16).contiguous()
    save_file(dict(sorted(tensors.items())), path, metadata={"format": "pt"})
    path.chmod(0o644)


def save_draft(draft: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    _save_model(draft, tokenizer, out_dir)


def load_mtp(model_dir: Path, config) -> MTPHead:  # noqa: ANN001 - a Qwen3_5TextConfig
    """The MTP head of a saved target directory (for evaluation and tests)."""
    mtp = MTPHead(config)
    tensors = load_file(model_dir / "model.safetensors")
    mtp.load_state_dict({k.removeprefix("mtp."): v for k, v in tensors.items() if k.startswith("mtp.")})
    return mtp


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
