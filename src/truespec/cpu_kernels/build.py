"""Builds and loads the C kernels of this package: built with the machine's C compiler on first use, loaded with
ctypes.

In torch, one GDN layer of a decode step is ~150 small ops (conv taps, norms, gates, the delta rule's passes), each
a few microseconds of dispatch for a few hundred floats of work: on a small model that dispatch, not arithmetic, is
the CPU step. gdn_core.c computes the same layer core in one call (ops/gdn.py and ops/conv.py give its formulas).

Built once per source, compiler and CPU: ``$CC`` (else ``cc``) with -O3 -march=native -ffp-contract=off into
``$TRUESPEC_CACHE_DIR`` (else ``~/.cache/truespec``); ~0.5 s, then reused. No compiler, a failed build, or
``TRUESPEC_NATIVE=0``: ``load()`` returns None and the layers keep their torch ops (a warning says why once). Only
float32 / float64 models take it (the CPU dtypes; a 16-bit model on the CPU keeps torch's casts).
"""

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).resolve().parent / "gdn_core.c"
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared")
_POINTER, _INT = ctypes.c_void_p, ctypes.c_int64
SCALARS = {torch.float32: ("f32", ctypes.c_float), torch.float64: ("f64", ctypes.c_double)}


def _cpu_id() -> str:
    """What the build depends on besides source and compiler: the CPU's feature flags (for -march=native)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform

        return platform.processor() + platform.machine()
    return next((line for line in lines if line.startswith(("flags", "Features"))), "")


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), version, _cpu_id(), *FLAGS]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("TRUESPEC_CACHE_DIR") or Path.home() / ".cache" / "truespec")
    target = cache / f"{SOURCE.stem}-{key}.so"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:  # built aside, renamed into place: processes may race
            built = Path(tmp) / target.name
            subprocess.run([compiler, *FLAGS, "-o", str(built), str(SOURCE), "-lm"], capture_output=True, text=True,
                           check=True)  # fmt: skip
            built.replace(target)
    return target


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled library, built if needed; None (with a warning) where it cannot be."""
    if os.environ.get("TRUESPEC_NATIVE", "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CC") or "cc")
    try:
        if compiler is None:
            raise FileNotFoundError(f"no C compiler {os.environ.get('CC') or 'cc'!r} on PATH")
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = e.stderr.strip()[-500:] if isinstance(e, subprocess.CalledProcessError) else str(e)
        warnings.warn(f"truespec: the CPU kernels (cpu_kernels/) are not built ({detail}); the CPU path uses torch ops",
                      RuntimeWarning, stacklevel=2)  # fmt: skip
        return None
    for suffix, scalar in SCALARS.values():
        fn = getattr(lib, f"gdn_core_{suffix}")
        fn.argtypes = [_POINTER, _INT, _POINTER, _INT, _POINTER, _POINTER, _INT, *[_POINTER] * 4, _POINTER, _INT,
                       _POINTER, _INT, *[_POINTER] * 4, *[_INT] * 6, scalar, scalar, scalar, _POINTER]  # fmt: skip
        fn.restype = ctypes.c_int
    return lib
