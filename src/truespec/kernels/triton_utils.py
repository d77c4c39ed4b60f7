"""Small helpers shared by the Triton kernels: padded tile sizes, dtypes, reductions, interpreter quirks.

Kernels here call only Triton *builtins* (no ``tl.sum`` / ``tl.max`` / ``tl.zeros``, which are themselves
``@triton.jit`` functions): those library functions are compiled-mode objects whenever triton was imported
before ``TRITON_INTERPRET=1`` was set (transformers imports triton), and then fail in the interpreter.
``reduce_sum`` / ``reduce_max`` / ``reduce_min`` build the same ``tl.reduce`` as ``tl.sum`` / ``tl.max`` /
``tl.min`` do for floats, with the same combine functions, which the interpreter recognises and runs as one numpy
reduction (an unknown combine function falls back to a per-element Python loop, about 4x slower).
"""

import torch
import triton
import triton.language as tl
from triton.language.standard import _elementwise_max, _elementwise_min, _sum_combine

from truespec.ops.precision import compute_dtype

_TL_DTYPES = {torch.float32: tl.float32, torch.float64: tl.float64}


def is_interpreter() -> bool:
    """True under ``TRITON_INTERPRET=1`` (kernels run as numpy on CPU tensors)."""
    return bool(triton.knobs.runtime.interpret)


def pad_pow2(n: int, minimum: int = 16) -> int:
    """Tile size for a dim of ``n``: the next power of two, at least ``minimum`` (tl.dot needs >= 16)."""
    return max(minimum, triton.next_power_of_2(n))


def tl_compute_dtype(dtype: torch.dtype) -> tl.dtype:
    """The Triton accumulator dtype for a model dtype: fp64 for fp64, else fp32 (as ``compute_dtype``)."""
    return _TL_DTYPES[compute_dtype(dtype)]


def needs_dot_upcast(dtype: torch.dtype) -> bool:
    """The Triton 3.6 interpreter multiplies the raw uint16 bits of bf16 ``tl.dot`` operands (numpy has
    no bf16). Upcasting them to fp32 first is exact (a bf16 product fits in fp32), so it emulates the
    GPU's bf16 MMA with fp32 accumulation."""
    return is_interpreter() and dtype == torch.bfloat16


@triton.jit
def reduce_sum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _sum_combine)


@triton.jit
def reduce_max(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _elementwise_max)


@triton.jit
def reduce_min(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _elementwise_min)


@triton.jit
def mma(a, b, UPCAST: tl.constexpr, acc=None):
    """``a @ b`` (``acc + a @ b`` given ``acc``) accumulated in fp32 (fp64 for fp64 operands), IEEE fp32 products
    (never tf32)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def find_request(query_start_loc_ptr, num_reqs, token):
    """Index r of the request owning packed token ``token`` (largest r with qsl[r] <= token; requests
    with an empty query are skipped), by binary search so no per-step token->request map is needed."""
    lo = tl.full([], 0, tl.int32)  # tensors, not constexprs: both are loop-carried
    hi = lo + num_reqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        is_at_or_before = tl.load(query_start_loc_ptr + mid) <= token
        lo = tl.where(is_at_or_before, mid, lo)
        hi = tl.where(is_at_or_before, hi, mid - 1)
    return lo


@triton.jit
def find_requests(query_start_loc_ptr, num_reqs, tokens):
    """``find_request`` for a vector of packed tokens: [BLOCK_T], the largest r < num_reqs with qsl[r] <= token
    (requests with an empty query skipped). Binary lifting: r climbs by each power of two below num_reqs, largest
    first, while qsl stays <= token (qsl is nondecreasing); log2(R) gathers of BLOCK_T entries."""
    r = tokens * 0
    step = tl.full([], 1, tl.int32)  # a tensor, not a constexpr: loop-carried
    while step * 2 < num_reqs:
        step = step * 2
    while step > 0:
        up = r + step
        is_in_range = up < num_reqs
        is_at_or_before = is_in_range & (tl.load(query_start_loc_ptr + up, mask=is_in_range, other=0) <= tokens)
        r = tl.where(is_at_or_before, up, r)
        step = step // 2
    return r


def _fix_interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter turns a scalar into an int with ``int(array_of_shape_1)``, which numpy
    >= 2.4 rejects, so ``range(start, end)`` with runtime bounds fails in every interpreted kernel.
    Re-patch ``tensor.__index__`` to read the single element (compiled kernels are unaffected)."""
    from triton.runtime import interpreter

    patch_lang_tensor = interpreter._patch_lang_tensor
    if getattr(patch_lang_tensor, "is_truespec_fix", False):
        return

    def patched(tensor: type, scope: object) -> None:
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.is_truespec_fix = True
    interpreter._patch_lang_tensor = patched


if is_interpreter():
    _fix_interpreter_scalar_index()
