"""Load an HF-format checkpoint directory (config.json + safetensors) into a truespec model.

Multimodal checkpoints (``qwen3_5``) nest the text config under ``text_config`` and the weights under
``model.language_model.``; the vision tower (``model.visual.*``) is ignored. ``mtp.*`` weights are not
part of the model but are returned in ``LoadedModel.mtp_weights`` for an MTP drafter.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open

from truespec.dtypes import DTYPE_NAMES
from truespec.models.base import CausalLM
from truespec.models.registry import get_model_class

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, attr) for name, attr in DTYPE_NAMES.items()}
_INDEX_FILE = "model.safetensors.index.json"
_TEXT_PREFIX, _MULTIMODAL_TEXT_PREFIX = "model.", "model.language_model."
_IGNORED_PREFIXES = ("model.visual.", "visual.")


@dataclass
class LoadedModel:
    model: CausalLM
    hf_config: PretrainedConfig  # the text config (the nested one for multimodal checkpoints)
    dtype: torch.dtype
    mtp_weights: dict[str, torch.Tensor]  # checkpoint name ("mtp.fc.weight") -> tensor in dtype on device


def _parse_dtype(value: str | torch.dtype) -> torch.dtype:
    if isinstance(value, torch.dtype):
        if value not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {value}; supported: float16, bfloat16, float32, float64")
        return value
    name = value.removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {value!r}; supported: 'auto', {sorted(_DTYPES)}")
    return _DTYPES[name]


def resolve_dtype(
    dtype: str | torch.dtype, config_dtype: str | torch.dtype | None, device: torch.device
) -> torch.dtype:
    """``"auto"`` = the checkpoint's dtype (float32 if unset), with float16/bfloat16 -> float32 on CPU."""
    if not (isinstance(dtype, str) and dtype == "auto"):
        return _parse_dtype(dtype)
    resolved = torch.float32 if config_dtype is None else _parse_dtype(config_dtype)
    if device.type == "cpu" and resolved in (torch.float16, torch.bfloat16):
        return torch.float32
    return resolved


def _read_config(root: Path) -> tuple[PretrainedConfig, type[CausalLM]]:
    if not root.is_dir():
        raise FileNotFoundError(f"model directory not found: {root}")
    config_path = root / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"config.json not found in {root}")
    try:
        model_type = json.loads(config_path.read_text()).get("model_type")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise ValueError(f"cannot parse {config_path}: {e}") from e
    cls = get_model_class(str(model_type))  # before AutoConfig: our error names what *we* support
    from transformers import AutoConfig  # imported when a model is loaded, not with truespec

    return AutoConfig.from_pretrained(root, local_files_only=True), cls


def read_text_config(model_dir: str | Path) -> PretrainedConfig:
    """The text model's config of a checkpoint directory, without loading any weight."""
    return _read_config(Path(model_dir))[0].get_text_config()


def checkpoint_tensor_names(model_dir: str | Path) -> list[str]:
    """The tensor names a checkpoint's safetensors files hold (read from their headers, no weight loaded)."""
    names = []
    for path in _weight_files(Path(model_dir)):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                names += list(f.keys())
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ValueError(f"cannot read safetensors file {path}: {e}") from e
    return names


def _weight_files(root: Path) -> list[Path]:
    index = root / _INDEX_FILE
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as e:
            raise ValueError(f"cannot parse {index}: {e}") from e
        files = [root / s for s in shards]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"shard {f} listed in {index} not found")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {root}")
    return files


def _read_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of one file; an unreadable or corrupt file is a ValueError naming it."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)
    except (SafetensorError, OSError, RuntimeError) as e:
        raise ValueError(f"cannot read safetensors file {path}: {e}") from e


def _model_name(name: str) -> str | None:
    """The model parameter a checkpoint tensor maps to; None for tensors the model ignores."""
    if name.startswith(_IGNORED_PREFIXES):
        return None
    if name.startswith(_MULTIMODAL_TEXT_PREFIX):
        return _TEXT_PREFIX + name.removeprefix(_MULTIMODAL_TEXT_PREFIX)
    return name


@torch.no_grad()
def _load_weights(model: CausalLM, files: list[Path], dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    # Checkpoint names; a merged projection's (q_proj, gate_proj, ...) are row views of its merged weight
    # (layers/linear.py), so copying into them fills the merged parameter in place.
    params = model.state_dict()
    loaded: set[str] = set()
    unexpected: list[str] = []
    mtp_weights: dict[str, torch.Tensor] = {}
    for path in files:
        for name, tensor in _read_tensors(path):
            target = _model_name(name)
            if name.startswith("mtp."):
                mtp_weights[name] = tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else None)
            elif target is None or (target == "lm_head.weight" and model.lm_head is None):
                continue  # vision tower; a stored copy of tied embeddings
            elif target not in params:
                unexpected.append(name)
            elif tensor.shape != params[target].shape:
                raise ValueError(
                    f"tensor {name} in {path.name} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(params[target].shape)}"
                )
            else:
                params[target].copy_(tensor)
                loaded.add(target)
    if unexpected:
        raise ValueError(f"unexpected tensors in checkpoint {[f.name for f in files]}: {sorted(unexpected)}")
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"missing tensors {missing} in checkpoint files {[str(f) for f in files]}")
    return mtp_weights


def load_model(
    model_dir: str | Path, dtype: str | torch.dtype = "auto", device: torch.device | str = "cpu"
) -> LoadedModel:
    """Build the model for ``model_dir``'s config and load its safetensors weights (local files only)."""
    root, device = Path(model_dir), torch.device(device)
    config, cls = _read_config(root)
    text_config = config.get_text_config()
    config_dtype = getattr(text_config, "dtype", None) or getattr(config, "dtype", None)
    dtype = resolve_dtype(dtype, config_dtype, device)
    files = _weight_files(root)
    with torch.device("meta"):  # no host allocation or random init for weights we overwrite anyway
        model = cls(text_config, tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)))
    # to_empty's empty_like on meta tensors runs torch's Python refs, which import sympy (~1 s): torch.empty instead
    model = model._apply(lambda t: torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype,
                                               device=device))
    mtp_weights = _load_weights(model, files, dtype, device)
    model.init_buffers(device)
    model.eval().requires_grad_(False)
    return LoadedModel(model=model, hf_config=text_config, dtype=dtype, mtp_weights=mtp_weights)
