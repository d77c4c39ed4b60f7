"""HF ``model_type`` -> truespec model class."""

from truespec.models.base import CausalLM
from truespec.models.llama import LlamaForCausalLM
from truespec.models.qwen3 import Qwen3ForCausalLM
from truespec.models.qwen3_5 import Qwen3_5ForCausalLM

_MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "qwen3_5": Qwen3_5ForCausalLM,  # multimodal checkpoint: text config nested, vision tower ignored
    "qwen3_5_text": Qwen3_5ForCausalLM,
}


def supported_model_types() -> list[str]:
    return sorted(_MODEL_CLASSES)


def get_model_class(model_type: str) -> type[CausalLM]:
    """The class for ``model_type``; ValueError naming it and the supported types otherwise."""
    if model_type not in _MODEL_CLASSES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {supported_model_types()}")
    return _MODEL_CLASSES[model_type]
