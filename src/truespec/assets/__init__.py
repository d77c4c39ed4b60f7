"""The embedded default models (HF format), trained by `python -m truespec.training`; see MODEL.md.

DEFAULT_MODEL_DIR: hybrid Qwen3.5 text model (`qwen3_5_text`, GDN + gated attention 3:1) with one MTP layer
stored as `mtp.*`. DEFAULT_DRAFT_MODEL_DIR: a small dense `qwen3` draft model with the same tokenizer.
"""

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent
DEFAULT_MODEL_DIR = ASSETS_DIR / "stdlib-qwen35"
DEFAULT_DRAFT_MODEL_DIR = ASSETS_DIR / "stdlib-qwen3-draft"
DEFAULT_EAGLE_DIR = ASSETS_DIR / "stdlib-eagle"  # EAGLE head for the target (`python -m truespec.training.eagle`)

__all__ = ["ASSETS_DIR", "DEFAULT_DRAFT_MODEL_DIR", "DEFAULT_EAGLE_DIR", "DEFAULT_MODEL_DIR"]
