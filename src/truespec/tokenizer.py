"""Loading a model directory's tokenizer (offline) with a clear error when it is missing."""

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    if not Path(path).is_dir():
        raise FileNotFoundError(f"tokenizer directory not found: {path}")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"could not load a tokenizer from {path}: {e}") from e
