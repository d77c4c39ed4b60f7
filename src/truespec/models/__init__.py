"""Model implementations (torch reference paths), the model_type registry and the checkpoint loader."""

from truespec.models.base import CausalLM
from truespec.models.loader import LoadedModel, load_model, resolve_dtype
from truespec.models.registry import get_model_class, supported_model_types

__all__ = ["CausalLM", "LoadedModel", "get_model_class", "load_model", "resolve_dtype", "supported_model_types"]
