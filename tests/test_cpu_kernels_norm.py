"""The CPU path's compiled RMSNorm (cpu_kernels/norm.py and norm_core.c) against ops/norm.py: plain and unit-offset
weights, with and without the residual add, float32 and float64, a width that is not a multiple of the kernel's 16
partial sums; a row's bits the same alone and among other rows; and RMSNorm using it."""

import pytest
import torch

from helpers.kernels import assert_near
from truespec.cpu_kernels import build
from truespec.cpu_kernels import norm as cpu_norm
from truespec.layers.norm import RMSNorm
from truespec.ops.norm import add_rms_norm_ref, rms_norm_ref

pytestmark = pytest.mark.skipif(build.load() is None, reason="no C compiler: the CPU path keeps its torch ops")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("dim", [256, 37])
def test_rms_norm_matches_the_reference(dtype: torch.dtype, unit_offset: bool, dim: int) -> None:
    gen = torch.Generator().manual_seed(dim)
    x, residual = (torch.randn(9, dim, generator=gen, dtype=dtype) for _ in range(2))
    weight = torch.randn(dim, generator=gen, dtype=dtype) * 0.1
    out, same = cpu_norm.rms_norm(x, weight, 1e-6, unit_offset)
    assert same is x
    assert_near(out, rms_norm_ref(x, weight, 1e-6, unit_offset), dtype)
    out, total = cpu_norm.rms_norm(x, weight, 1e-6, unit_offset, residual)
    expected, expected_total = add_rms_norm_ref(x, residual, weight, 1e-6, unit_offset)
    assert torch.equal(total, expected_total)
    assert_near(out, expected, dtype)
    for row in range(x.shape[0]):  # a row alone: the same bits
        alone = cpu_norm.rms_norm(x[row : row + 1], weight, 1e-6, unit_offset, residual[row : row + 1])[0]
        assert torch.equal(alone, out[row : row + 1])


def test_the_module_takes_it_where_autograd_records_nothing() -> None:
    norm = RMSNorm(64, 1e-6, unit_offset=True)
    x, residual = torch.randn(3, 64), torch.randn(3, 64)
    assert not cpu_norm.can_run(x, norm.weight)  # the weight requires grad: torch ops, gradients flow
    norm(x).sum().backward()
    assert norm.weight.grad is not None
    with torch.no_grad():
        assert cpu_norm.can_run(x, norm.weight)
        out, total = norm.add_norm(x, residual)
        assert_near(out, add_rms_norm_ref(x, residual, norm.weight, 1e-6, True)[0], torch.float32)
        assert_near(norm(x), rms_norm_ref(x, norm.weight, 1e-6, True), torch.float32)
