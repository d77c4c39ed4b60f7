"""kernels/hadamard.py (the fast Walsh-Hadamard transform) against ``x @ H`` (ops/kv_quant.py ``rotate``): random
rows at every power-of-two head dim the formats use, fp32 / fp64 / bf16 inputs, rows strided as q's heads are;
each row's bits the same alone and in any batch (invariant 4). Under Triton's interpreter without CUDA."""

import pytest
import torch

from helpers.kernels import DEVICE, gpu, needs_cuda  # noqa: F401 (switches to the interpreter first)
from truespec.kernels.hadamard import rotate_rows
from truespec.ops.kv_quant import hadamard


@pytest.mark.parametrize("head_dim", [2, 16, 64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_rotate_rows_equals_the_hadamard_product(head_dim: int, dtype: torch.dtype) -> None:
    """19 random rows (past one block of 16, ragged): close to the float64 product in the compute dtype's rounding,
    and an orthonormal rotation (H is its own inverse)."""
    x = torch.randn(19, head_dim, generator=torch.Generator().manual_seed(head_dim), dtype=torch.float64)
    x = x.to(dtype).to(DEVICE)
    rot = rotate_rows(x)
    assert rot.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    exact = x.double() @ hadamard(head_dim, torch.float64, x.device)
    tol = 2e-14 if dtype == torch.float64 else 2e-6  # measured: <= 6e-15 / <= 8e-7 (the output is scaled by H[0, 0])
    torch.testing.assert_close(rot.double(), exact, rtol=0, atol=tol)
    torch.testing.assert_close(rotate_rows(rot).double(), x.double(), rtol=0, atol=4 * tol)


def test_rotate_rows_reads_strided_heads() -> None:
    """q's heads inside a projection's output (each head followed by its gate: row stride 2 D): the rows rotated,
    the gates ignored; a [T, heads, D] view keeps its shape."""
    head_dim = 32
    qg = torch.randn(5, 4, 2 * head_dim, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    q = qg[..., :head_dim]  # [T, heads, D], strides (4 * 2D, 2D, 1)
    rot = rotate_rows(q)
    assert rot.shape == q.shape
    assert torch.equal(rot, rotate_rows(q.contiguous()))


def test_rotated_rows_do_not_depend_on_the_batch() -> None:
    """A row rotated alone, among 1 + 3 rows (a verify), or among 40: the same bits."""
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    full = rotate_rows(x)
    for rows in (slice(7, 8), slice(7, 11), slice(0, 40)):
        assert torch.equal(rotate_rows(x[rows]), full[rows])


def test_rotate_rows_rejects_other_head_dims() -> None:
    with pytest.raises(ValueError, match="power-of-two last dim"):
        rotate_rows(torch.zeros(2, 24, device=DEVICE))


@gpu
@needs_cuda
def test_gpu_rotate_rows_at_qwen35_size() -> None:
    """Compiled, 2048 rows of 256 from bf16: close to the float64 product; each row's bits the same alone."""
    x = torch.randn(2048, 256, generator=torch.Generator().manual_seed(3)).to(DEVICE, torch.bfloat16)
    rot = rotate_rows(x)
    exact = x.double() @ hadamard(256, torch.float64, x.device)
    torch.testing.assert_close(rot.double(), exact, rtol=0, atol=2e-6)
    for rows in (slice(100, 101), slice(100, 104)):
        assert torch.equal(rotate_rows(x[rows]), rot[rows])
