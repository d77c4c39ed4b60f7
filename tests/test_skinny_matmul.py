"""The skinny matmul (kernels/skinny_matmul.py, one-row projections on CUDA) against its torch reference, on
ragged shapes (row, column and reduction counts that are not multiples of the blocks), strided rows, with and
without bias; a row's result is bitwise the same alone or among other rows; ``layers.linear.linear`` sends only
one-row 16-bit steps to it. Without CUDA the kernel runs in Triton's interpreter on small shapes;
``@pytest.mark.gpu`` reruns it at the Qwen3.5-0.8B projection shapes."""

import os

import pytest
import torch

if not torch.cuda.is_available():  # the interpreter must be on before truespec.kernels is first imported
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

import truespec.layers.linear as linear_mod  # noqa: E402
from truespec.kernels import skinny_matmul, skinny_matmul_ref  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# relative error (Frobenius) bound per dtype: the kernel and the reference differ only in summation order
# (fp32 accumulation) and the final rounding to the output dtype
BOUND = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}


def check(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, row_stride: int | None = None,
          **blocks: int) -> None:
    g = torch.Generator(device=DEVICE).manual_seed(m * 1000 + n + k)
    base = torch.randn(m, row_stride or k, generator=g, device=DEVICE).to(dtype)
    x = base[:, :k]  # rows strided when row_stride > k (a view of a wider buffer, as the models pass them)
    w = (torch.randn(n, k, generator=g, device=DEVICE) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g, device=DEVICE).to(dtype) if bias else None
    y = skinny_matmul(x, w, b, **blocks)
    ref = skinny_matmul_ref(x, w, b)
    assert y.shape == (m, n) and y.dtype == dtype
    err = ((y.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < BOUND[dtype], (m, n, k, dtype, err)
    for i in {0, m // 2, m - 1}:  # each row alone: bitwise what it was in the batch
        assert torch.equal(skinny_matmul(x[i:i + 1], w, b, **blocks)[0], y[i])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m, n, k", [(1, 40, 70), (3, 33, 130), (8, 16, 512), (11, 24, 600)])
def test_skinny_matmul_matches_reference(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    check(m, n, k, dtype, bias=m % 2 == 1, row_stride=k + 24 if m > 1 else None, block_n=8, block_k=64)


def test_linear_sends_only_one_row_16bit_steps_to_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear_mod, "use_kernels", lambda t: True)  # as on CUDA with the triton backend
    calls = []
    monkeypatch.setattr(linear_mod.kernels(), "skinny_matmul", lambda *a: calls.append(a) or skinny_matmul(*a))
    w = torch.randn(24, 40, device=DEVICE).to(torch.bfloat16)
    one, two = (torch.randn(n, 40, device=DEVICE).to(torch.bfloat16) for n in (1, 2))
    assert torch.equal(linear_mod.linear(one, w), skinny_matmul(one, w)) and len(calls) == 1
    assert torch.equal(linear_mod.linear(two, w), torch.nn.functional.linear(two, w)) and len(calls) == 1
    one32, w32 = one.float(), w.float()  # fp32 / fp64 models keep torch (exactness tests run them)
    assert torch.equal(linear_mod.linear(one32, w32), torch.nn.functional.linear(one32, w32)) and len(calls) == 1
    layer = linear_mod.Linear(40, 24, bias=True).to(device=DEVICE, dtype=torch.bfloat16)
    assert torch.equal(layer(one), skinny_matmul(one, layer.weight, layer.bias)) and len(calls) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_skinny_matmul_at_qwen3_5_size(dtype: torch.dtype) -> None:
    for n, k in [(5120, 1024), (1024, 2048), (7168, 1024), (1024, 3584), (8224, 1024), (248320, 1024)]:
        for m in (1, 3, 8):
            check(m, n, k, dtype, bias=False)
