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


def add_sparse_v_args(parser: argparse.ArgumentParser) -> None:
    """--sparse-v / --sparse-v-threshold / --sparse-v-ctx-threshold (unset: TRUESPEC_SPARSE_V* or the default)."""
    parser.add_argument("--sparse-v", choices=("off", "on", "auto"), default=None,
                        help="skip the V tiles whose softmax weights are all below --sparse-v-threshold (default off; "
                             "auto: rows with at least --sparse-v-ctx-threshold keys)")
    parser.add_argument("--sparse-v-threshold", type=float, default=None, help="default 1e-3 (0: never skips)")
    parser.add_argument("--sparse-v-ctx-threshold", type=at_least(0), default=None, help="default 8192")


def add_prefix_caching_args(parser: argparse.ArgumentParser) -> None:
    """--enable-prefix-caching / --no-enable-prefix-caching, --prefix-state-interval, --prefix-state-budget (unset: the
    engine's defaults: on; the interval from the model's sizes; 0.1)."""
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                        help="reuse the KV (and on hybrid models the recurrent-state checkpoints) of prompt prefixes "
                             "computed before, with the same tokens as without (default: on)")
    parser.add_argument("--prefix-state-interval", type=at_least(1), default=None,
                        help="hybrid models: tokens between recurrent-state checkpoints, a multiple of --block-size "
                             "(default: the fewest blocks whose KV costs one checkpoint, rounded up to a power of 2)")
    parser.add_argument("--prefix-state-budget", type=float, default=None,
                        help="hybrid models: share of the cache memory for state checkpoints, in [0, 1) (default 0.1)")


def prefix_caching_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """The ``LLM`` keywords of the prefix-caching flags that were given."""
    names = ("enable_prefix_caching", "prefix_state_interval", "prefix_state_budget")
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def sparse_v_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """The ``LLM`` keywords of the sparse-V flags that were given."""
    names = ("sparse_v", "sparse_v_threshold", "sparse_v_ctx_threshold")
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}
