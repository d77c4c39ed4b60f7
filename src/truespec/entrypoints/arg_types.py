"""argparse types shared by the commands: checked while parsing, so a bad value fails before anything loads."""

import argparse
import os
from collections.abc import Callable
from pathlib import Path


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``low``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    return parse


def writable_path(text: str) -> Path:
    """An argparse type for an output file (``--json``): checked when parsing, so a bad path fails before the run
    instead of losing its results."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a directory")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"directory {path.parent} does not exist")
    if not os.access(path.parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {path}")
    return path
