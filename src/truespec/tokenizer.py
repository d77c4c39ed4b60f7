"""Loading a model directory's tokenizer (offline) with a clear error when it is missing or empty."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


# the files one of which every transformers tokenizer is saved with
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")
HINT = "pass tokenizer=DIR, or skip_tokenizer_init=True to give prompts as token ids (outputs then carry no text)"


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"tokenizer directory not found: {path}")
    if not any((root / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): {HINT}")
    try:
        from transformers import AutoTokenizer  # imported when a tokenizer is loaded, not with truespec

        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"could not load a tokenizer from {path}: {e}") from e
    if len(tokenizer) < 2:  # transformers builds an empty tokenizer from a config that names no vocabulary
        raise ValueError(f"the tokenizer in {path} is empty ({len(tokenizer)} token): {HINT}")
    return tokenizer
