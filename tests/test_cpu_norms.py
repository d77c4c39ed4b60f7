"""The CPU path's norms (layers/norm.py: one ``F.rms_norm`` call for float32 / float64) give the torch reference's
bits (ops/norm.py), on contiguous inputs and on the strided head views the attention's q/k norms get, and follow a
weight changed in place (the cached ``1 + w``)."""

import pytest
import torch

from truespec.layers.norm import GatedRMSNorm, RMSNorm
from truespec.ops.norm import add_rms_norm_ref, rms_norm_ref

SHAPES = [(1, 256), (16, 256), (33, 256), (5, 4, 64), (3, 2, 64)]


def _inputs(shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    """A contiguous x and a strided view of the same shape (a slice of a wider projection output)."""
    wide = torch.randn(shape[0], 3, *shape[1:], dtype=dtype) * 3
    return [torch.randn(*shape, dtype=dtype) * 3, wide[:, 1]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("unit_offset", [False, True])
def test_cpu_rms_norm_is_bitwise_the_reference(dtype: torch.dtype, shape: tuple[int, ...], unit_offset: bool) -> None:
    torch.manual_seed(0)
    norm = RMSNorm(shape[-1], 1e-6, unit_offset=unit_offset).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
        for x in _inputs(shape, dtype):
            assert torch.equal(norm(x), rms_norm_ref(x, norm.weight, 1e-6, unit_offset))
            residual = torch.randn(*shape, dtype=dtype)
            for got, want in zip(norm.add_norm(x, residual), add_rms_norm_ref(x, residual, norm.weight, 1e-6,
                                                                               unit_offset), strict=True):
                assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SHAPES)
def test_cpu_gated_rms_norm_is_bitwise_the_reference(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    torch.manual_seed(1)
    norm = GatedRMSNorm(shape[-1], 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
        for x in _inputs(shape, dtype):
            gate = torch.randn(*shape, dtype=dtype)
            assert torch.equal(norm(x, gate), rms_norm_ref(x, norm.weight, 1e-6, gate=gate))


def test_cpu_unit_offset_scale_follows_a_weight_loaded_in_place() -> None:
    norm = RMSNorm(64, 1e-6, unit_offset=True)
    x = torch.randn(2, 64)
    with torch.inference_mode():
        norm(x)  # caches 1 + w
    with torch.no_grad():
        norm.state_dict()["weight"].copy_(torch.randn(64))  # how the loader fills a model
    with torch.inference_mode():
        assert torch.equal(norm(x), rms_norm_ref(x, norm.weight, 1e-6, unit_offset=True))
