"""The CPU path's compiled projection (cpu_kernels/linear.py and linear_core.c) against ``linear_ref``: any row count
(1, a verify's 4, blocks of 4 plus a remainder), outputs that do not fill a panel, an odd K, bias, strided rows,
float32 and float64; a row's bits the same alone and among any other rows (invariant 4 on the CPU); the packed copy
renewed when the weight changes in place; a weight too large to pack keeps torch's BLAS."""

import pytest
import torch

from helpers.kernels import assert_near
from truespec.cpu_kernels import build
from truespec.cpu_kernels import linear as cpu_linear
from truespec.layers.linear import linear
from truespec.ops.linear import linear_ref

pytestmark = pytest.mark.skipif(build.load() is None, reason="no C compiler: the CPU path keeps its torch ops")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("num_out", "num_in"), [(776, 256), (37, 13), (130, 64)])
def test_rows_match_the_reference_and_do_not_depend_on_each_other(dtype: torch.dtype, num_out: int,
                                                                   num_in: int) -> None:  # fmt: skip
    gen = torch.Generator().manual_seed(num_out)
    weight = torch.randn(num_out, num_in, generator=gen, dtype=dtype) * num_in**-0.5
    bias = torch.randn(num_out, generator=gen, dtype=dtype)
    wide = torch.randn(11, num_in + 5, generator=gen, dtype=dtype)
    x = wide[:, 2 : 2 + num_in]  # strided rows
    for b in (None, bias):
        out = cpu_linear.linear(x, weight, b)
        assert_near(out, linear_ref(x, weight, b), dtype)
        for start, stop in [(0, 1), (3, 4), (4, 8), (1, 5), (2, 11), (7, 11)]:  # alone, a verify, blocks + remainder
            assert torch.equal(cpu_linear.linear(x[start:stop], weight, b), out[start:stop])


def test_the_packed_weight_follows_in_place_changes() -> None:
    weight, x = torch.randn(70, 32), torch.randn(3, 32)
    first = cpu_linear.linear(x, weight)
    with torch.no_grad():
        weight.mul_(2)
    assert_near(cpu_linear.linear(x, weight), 2 * first, torch.float32)


def test_the_layer_function_takes_it_unless_the_weight_is_too_large(monkeypatch: pytest.MonkeyPatch) -> None:
    weight, x = torch.randn(70, 32), torch.randn(3, 32)
    assert cpu_linear.can_run(x, weight)
    assert torch.equal(linear(x, weight), cpu_linear.linear(x, weight))
    monkeypatch.setattr(cpu_linear, "MAX_PACKED_ELEMENTS", weight.numel() - 1)
    assert not cpu_linear.can_run(x, weight)
    assert_near(linear(x, weight), linear_ref(x, weight), torch.float32)


def test_an_inference_tensor_weight_keeps_torch_blas() -> None:
    with torch.inference_mode():
        weight, x = torch.randn(70, 32), torch.randn(3, 32)
        assert not cpu_linear.can_run(x, weight)  # no version counter: a packed copy could not follow changes
        assert_near(linear(x, weight), linear_ref(x, weight), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bf16_valued_weights_pack_narrow_with_the_same_bits(dtype: torch.dtype,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A weight of bfloat16 values (a bf16 checkpoint run in float32 / float64) is packed as bfloat16, a half (float64:
    a quarter) of the bytes, and every row of every block size keeps the bits of the wide packing, with and without
    bias; one value that is not a bfloat16 value keeps the whole weight wide."""
    gen = torch.Generator().manual_seed(3)
    weight = (torch.randn(130, 40, generator=gen, dtype=dtype) * 0.2).to(torch.bfloat16).to(dtype)
    bias = torch.randn(130, generator=gen, dtype=dtype)
    x = torch.randn(9, 40, generator=gen, dtype=dtype)
    outs = {}
    for narrow in (True, False):
        monkeypatch.setattr(cpu_linear, "NARROW", narrow)
        packed = cpu_linear._packed(weight)
        assert packed.stored == (cpu_linear.STORED_BF16 if narrow else cpu_linear.STORED_SAME)
        blocks = [(0, 1), (0, 4), (0, 9)]  # alone, a block of 4, blocks + a remainder
        outs[narrow] = [cpu_linear.linear(x[a:b], weight, bb) for a, b in blocks for bb in (None, bias)]
        outs[narrow, "bytes"] = packed.packed.numel()
    assert all(torch.equal(n, w) for n, w in zip(outs[True], outs[False], strict=True))
    assert outs[True, "bytes"] - 64 == (outs[False, "bytes"] - 64) * 2 // weight.element_size()
    with torch.no_grad():
        weight[7, 3] += weight[7, 3] * 2**-12  # no longer a bfloat16 value
    monkeypatch.setattr(cpu_linear, "NARROW", True)
    assert cpu_linear._packed(weight).stored == cpu_linear.STORED_SAME
    assert_near(cpu_linear.linear(x, weight), linear_ref(x, weight), dtype)
