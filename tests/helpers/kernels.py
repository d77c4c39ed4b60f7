"""What the Triton kernel tests share: Triton's interpreter on CPU, tolerances, random inputs, batch metadata.

Importing this module switches the kernels to Triton's interpreter when there is no CUDA (numpy executes every
program on CPU tensors), so test modules import it before truespec.kernels. Batches are ragged on purpose, with
NUM_PAD_TOKENS trailing padding tokens (slot -1); ``poisoned_empty`` fills fresh allocations with NaNs so that
an output a kernel leaves unwritten, or a buffer row it reads before writing, shows.
"""

import contextlib
import os
from collections.abc import Iterator
from unittest import mock

import pytest
import torch

if not torch.cuda.is_available():
    # There is no compiled backend without a GPU, so run the interpreter. ``@triton.jit`` picks compiled vs
    # interpreted when a kernel is *defined*: the switch must be on before truespec.kernels is first imported.
    # Triton itself may be imported earlier (conftest imports transformers, which imports it); the kernels
    # avoid triton's own @jit library functions (tl.sum, ...), which would then be compiled-mode objects.
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

from truespec.forward_context import ForwardContext  # noqa: E402
from truespec.kernels.paged_attention import _paged_attention_kernel  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
IS_INTERPRETED = not isinstance(_paged_attention_kernel, triton.runtime.JITFunction)
assert DEVICE.type == "cuda" or IS_INTERPRETED, "truespec.kernels was imported before TRITON_INTERPRET was set"
DTYPES = [torch.float32, torch.float64, torch.bfloat16]
TOL = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
GPU_DTYPES = [torch.bfloat16, torch.float32]
GPU_TOL_SCALE = 5.0  # compiled tl.exp / sqrt are approximate in fp32; long recurrences accumulate it
NUM_SLOTS, NUM_PAD_TOKENS = 24, 2


def i64(values: list[int] | list[list[int]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


def assert_near(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, tol_scale: float = 1.0) -> None:
    tol = TOL[dtype] * tol_scale
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


def randn(*shape: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device=DEVICE, dtype=dtype)


def paged_batch(
    reqs: list[tuple[int, int]], block_size: int, num_blocks: int, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """Metadata for requests (num_cached, query_len) with blocks handed out in random order, plus
    NUM_PAD_TOKENS padding tokens; ``is_live`` [num_blocks * block_size] marks slots holding a position."""
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables, qsl, seq_lens, slots, live = [], [0], [], [], []
    for cached, new in reqs:
        table = [free.pop() for _ in range(triton.cdiv(cached + new, block_size))]
        positions = [table[p // block_size] * block_size + p % block_size for p in range(cached + new)]
        tables.append(table)
        qsl.append(qsl[-1] + new)
        seq_lens.append(cached + new)
        slots += positions[cached:]
        live += positions
    width = max(len(t) for t in tables) + 1
    is_live = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    is_live[live] = True
    return dict(
        query_start_loc=i64(qsl),
        seq_lens=i64(seq_lens),
        slot_mapping=i64(slots + [-1] * NUM_PAD_TOKENS),
        block_tables=i64([t + [-1] * (width - len(t)) for t in tables]),
        is_live=is_live,
    )


def state_batch(rows: list[tuple[int, int, int, int]]) -> dict[str, torch.Tensor]:
    qsl = [0]
    for query_len, *_ in rows:
        qsl.append(qsl[-1] + query_len)
    src, dst, write_start = ([row[i] for row in rows] for i in (1, 2, 3))
    return dict(query_start_loc=i64(qsl), state_src=i64(src), state_dst=i64(dst), state_write_start=i64(write_start))


def make_context(batch: dict[str, torch.Tensor], num_tokens: int) -> ForwardContext:
    num_reqs = batch["query_start_loc"].shape[0] - 1
    none = torch.full((num_reqs,), -1, dtype=torch.int64, device=DEVICE)
    return ForwardContext(
        query_start_loc=batch["query_start_loc"],
        seq_lens=batch.get("seq_lens", none),
        slot_mapping=batch.get("slot_mapping", torch.full((num_tokens,), -1, device=DEVICE)),
        block_tables=batch.get("block_tables", none[:, None]),
        state_src=batch.get("state_src", none),
        state_dst=batch.get("state_dst", none),
        state_write_start=batch.get("state_write_start", none),
        logits_indices=torch.arange(num_tokens, device=DEVICE),
        query_start_loc_cpu=batch["query_start_loc"].tolist(),
        seq_lens_cpu=batch.get("seq_lens", none).tolist(),
    )


@contextlib.contextmanager
def poisoned_empty() -> Iterator[None]:
    """Fresh float tensors from torch.empty / empty_like hold NaNs, as reused memory may: a kernel that leaves
    some of its output unwritten, or reads a buffer's unwritten rows, shows it."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    with (
        mock.patch.object(torch, "empty", lambda *a, **kw: poison(empty(*a, **kw))),
        mock.patch.object(torch, "empty_like", lambda *a, **kw: poison(empty_like(*a, **kw))),
    ):
        yield


def assert_padding_zero(out: torch.Tensor) -> None:
    """Rows owned by no request are zeros, and no NaN of a poisoned allocation survives anywhere."""
    assert torch.equal(out[-NUM_PAD_TOKENS:], torch.zeros_like(out[-NUM_PAD_TOKENS:]))
    assert not out.isnan().any()
