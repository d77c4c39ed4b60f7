"""The training corpus: the .py files of the running interpreter's standard library, split by path hash."""

import hashlib
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

HELDOUT_PER_MILLE = 30  # ~3% of files are held out (test), chosen by path hash (independent of the seed)
VAL_PER_MILLE = 20  # the next ~2% validate during training (checkpoint selection); never trained on
MAX_FILE_BYTES = 400_000  # a handful of generated data tables are larger; they teach nothing about code
EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class SourceFile:
    path: str  # posix path relative to the stdlib root: the split key
    text: str


@dataclass(frozen=True)
class Corpus:
    python_version: str
    stdlib_root: str
    num_files_found: int
    train: list[SourceFile]
    val: list[SourceFile]
    heldout: list[SourceFile]


def _bucket(rel_path: str) -> int:
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") % 1000


def split_of(rel_path: str) -> str:
    """"heldout" (~3%), "val" (~2%) or "train", from a hash of the path relative to the stdlib root."""
    bucket = _bucket(rel_path)
    if bucket < HELDOUT_PER_MILLE:
        return "heldout"
    return "val" if bucket < HELDOUT_PER_MILLE + VAL_PER_MILLE else "train"


def _read(path: Path) -> str | None:
    data = path.read_bytes()
    if len(data) > MAX_FILE_BYTES:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:  # a few test files use other encodings on purpose
        return None


def _subsample(paths: list[Path], num: int) -> list[Path]:
    return paths[:: max(1, len(paths) // num)][:num]


def collect_corpus(max_files: int | None = None) -> Corpus:
    """All stdlib .py files (sorted by path), split into train / held-out by a hash of the path.

    max_files (smoke runs) keeps a deterministic, spread-out subset of each side of the split.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(
        p for p in root.rglob("*.py") if p.is_file() and not EXCLUDED_DIRS.intersection(p.relative_to(root).parts)
    )
    rel = {p: p.relative_to(root).as_posix() for p in paths}
    splits: dict[str, list[Path]] = {"train": [], "val": [], "heldout": []}
    for p in paths:
        splits[split_of(rel[p])].append(p)
    if max_files is not None:
        splits = {k: _subsample(v, max_files if k == "train" else max(2, max_files // 8)) for k, v in splits.items()}
    files = {k: [SourceFile(rel[p], t) for p in v if (t := _read(p)) and t.strip()] for k, v in splits.items()}
    return Corpus(platform.python_version(), str(root), len(paths), files["train"], files["val"], files["heldout"])
