"""Builds and loads this package's C kernels (every ``*.c`` beside this file, one shared library): with the machine's
C compiler on first use, loaded with ctypes.

In torch, one layer of a decode step is a hundred or more small ops, each a few microseconds of dispatch for a few
hundred numbers of work: on a small model that dispatch, not arithmetic, is the CPU step. Each C kernel here computes
what a run of those ops computes, in one call: gdn_core.c (a GDN layer's core), attention_core.c (the attention of a
step's rows), norm_core.c (RMSNorm), rotary_core.c (q / k norms and RoPE), linear_core.c (projections),
activation_core.c (the attention's output gate); gdn_layer.c, attention_layer.c and mlp_block.c chain them into a layer
or half a layer, decoder_stack.c every layer of a step.

Built once per sources, compiler and CPU: ``$CC`` (else ``cc``) with -O3 -march=native -ffp-contract=off into
``$TRUESPEC_CACHE_DIR`` (else ``~/.cache/truespec``); ~1 s, then reused. No compiler, a failed build, or
``TRUESPEC_NATIVE=0``: ``function()`` returns None and the layers keep their torch ops (a warning says why once).
Only float32 / float64 models take them (the CPU dtypes; a 16-bit model on the CPU keeps torch's casts).
"""

import ctypes
import functools
import hashlib
import operator
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

SOURCES = sorted(Path(__file__).resolve().parent.glob("*.c"))
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared")
POINTER, INT = ctypes.c_void_p, ctypes.c_int64
_scratch = threading.local()  # work_buffer's, per thread
_DATA_PTR, _VERSION = torch.Tensor.data_ptr, operator.attrgetter("_version")
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
    texts = [path.read_text() for path in sorted(SOURCES[0].parent.glob("*.[ch]"))]  # sources and their headers
    key = hashlib.sha256("\0".join([*texts, version, _cpu_id(), *FLAGS]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("TRUESPEC_CACHE_DIR") or Path.home() / ".cache" / "truespec")
    target = cache / f"cpu_kernels-{key}.so"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:  # built aside, renamed into place: processes may race
            built = Path(tmp) / target.name
            subprocess.run([compiler, *FLAGS, "-o", str(built), *map(str, SOURCES), "-lm"], capture_output=True,
                           text=True, check=True)  # fmt: skip
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
    return lib


def as_int64(t: torch.Tensor) -> torch.Tensor:
    """Step metadata as the kernels read it: int64 with a unit last stride (``t`` itself when it already is)."""
    return t if t.dtype == torch.int64 and t.stride(-1) == 1 else t.to(torch.int64).contiguous()


def tracks_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd would record an op on ``tensors``: the kernels here write plain buffers, so such calls keep the
    torch ops (the engine runs under ``torch.inference_mode``)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def function(name: str, argtypes: list, restype: type = ctypes.c_int) -> ctypes._CFuncPtr | None:
    """The library's function ``name`` with its argument types set (int return by default: 0 on success), or None
    where the library is not built."""
    lib = load()
    if lib is None:
        return None
    fn = getattr(lib, name)  # the CDLL keeps this object: its types are set once
    if fn.argtypes != argtypes or fn.restype != restype:
        fn.argtypes, fn.restype = argtypes, restype
    return fn


class Bound:
    """A layer's bound call (gdn_layer.c's / attention_layer.c's ``*_bind``): the C block holding what a step does not
    change, freed with this object. ``keep`` holds the tensors its pointers read."""

    def __init__(self, bind_name: str, argtypes: list, args: tuple, keep: tuple) -> None:
        self.keep, self.address = keep, function(bind_name, argtypes, ctypes.c_void_p)(*args)
        if not self.address:
            raise MemoryError(f"{bind_name}: could not allocate")
        self._free = function("bound_free", [POINTER], None)

    def __del__(self) -> None:
        if getattr(self, "address", None):
            self._free(self.address)


def tensor_key(weights: list[torch.Tensor], states: list[torch.Tensor]) -> tuple | None:
    """What a kept kernel call (gdn_layer.py, attention_layer.py, mlp_block.py) binds of its tensors: ``storage_key``.
    None for inference-tensor weights, which have no version (they keep the stage-by-stage path, as in linear.py)."""
    if any(t.is_inference() for t in weights):
        return None
    return storage_key(weights, states)


def storage_key(weights: list[torch.Tensor], states: list[torch.Tensor]) -> tuple:
    """Each weight's identity, storage and version (a replaced, moved or in-place changed weight moves it), each
    state's identity and storage (kernels update states in place); ~20 us for 150 tensors."""
    return (tuple(map(id, weights)), tuple(map(_DATA_PTR, weights)), tuple(map(_VERSION, weights)),
            tuple(map(id, states)), tuple(map(_DATA_PTR, states)))


def work_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """At least ``numel`` elements of ``dtype``, reused by this thread's kernel calls (each call finishes with it
    before the next starts): a fresh buffer of > 128 KB each call was mmap-ed and faulted in. Kept at the largest size
    asked."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.dtype != dtype or buf.numel() < numel:
        buf = _scratch.buf = torch.empty(numel, dtype=dtype)
    return buf
