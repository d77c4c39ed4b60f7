"""Qwen3 dense: Llama with per-head q/k RMSNorm (plain weight) before RoPE."""

from typing import Any

from truespec.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True

    def __init__(self, config: Any, tie_word_embeddings: bool | None = None) -> None:
        if "sliding_attention" in (getattr(config, "layer_types", None) or []):
            raise ValueError("qwen3 with sliding-window attention layers is not supported")
        super().__init__(config, tie_word_embeddings)
