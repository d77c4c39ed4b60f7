"""The skinny matmul (kernels/skinny_matmul.py, one-row projections on CUDA when ``batch_invariant=False``)
against its torch reference, on ragged shapes (row, column and reduction counts that are not multiples of the
blocks), strided rows, with and without bias; a row's result is bitwise the same alone or among other rows; with
``batch_invariant=False`` ``layers.linear.linear`` sends only one-row 16-bit steps to it. With act(gate) * up
fused into its input (a gated MLP's down projection) it is bitwise the two launches it replaces (act_mul, then
skinny_matmul), and ``GatedMLP`` fuses only where those two launches would run. Without CUDA the kernel runs in
Triton's interpreter on small shapes; ``@pytest.mark.gpu`` reruns it at the Qwen3.5-0.8B projection shapes."""

import os
from collections.abc import Callable

import pytest
import torch

from truespec.ops.linear import padded_rows

if not torch.cuda.is_available():  # the interpreter must be on before truespec.kernels is first imported
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

import truespec.layers.activation as activation_mod  # noqa: E402
import truespec.layers.linear as linear_mod  # noqa: E402
from truespec.kernels import act_mul, linear_ref, skinny_matmul  # noqa: E402
from truespec.kernels.triton_utils import is_interpreter  # noqa: E402
from truespec.layers.mlp import GatedMLP  # noqa: E402
from truespec.ops.activation import act_mul_ref  # noqa: E402

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
    ref = linear_ref(x, w, b)
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
    """Off the batch-invariant path (``batch_invariant=False``): the earlier dispatch."""
    monkeypatch.setattr(linear_mod, "use_kernels", lambda t: True)  # as on CUDA with the triton backend
    calls = []
    monkeypatch.setattr(linear_mod.kernels(), "skinny_matmul", lambda *a: calls.append(a) or skinny_matmul(*a))
    w = torch.randn(24, 40, device=DEVICE).to(torch.bfloat16)
    one, two = (torch.randn(n, 40, device=DEVICE).to(torch.bfloat16) for n in (1, 2))
    assert torch.equal(linear_mod.linear(one, w, batch_invariant=False), skinny_matmul(one, w)) and len(calls) == 1
    assert torch.equal(linear_mod.linear(two, w, batch_invariant=False), torch.nn.functional.linear(two, w))
    assert len(calls) == 1
    one32, w32 = one.float(), w.float()  # fp32 / fp64 models keep torch (exactness tests run them)
    assert torch.equal(linear_mod.linear(one32, w32, batch_invariant=False), torch.nn.functional.linear(one32, w32))
    assert len(calls) == 1
    layer = linear_mod.Linear(40, 24, bias=True).to(device=DEVICE, dtype=torch.bfloat16)
    linear_mod.set_batch_invariant(layer, False)
    assert torch.equal(layer(one), skinny_matmul(one, layer.weight, layer.bias)) and len(calls) == 2


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, to compare exactly (torch.equal takes -0 for +0)."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def fused_ref(gate_up: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, act: str) -> torch.Tensor:
    """fp32 sums of torch's act(gate) * up in the model dtype. Triton 3.6's interpreter rounds fp32 -> bf16
    toward zero (numpy has no bf16), so there a bf16 act_mul output sits up to an ulp below torch's
    (tests/test_fused_kernels.py bounds that): the sums then start from the act_mul kernel's output."""
    if is_interpreter() and gate_up.dtype == torch.bfloat16:
        return linear_ref(act_mul(*gate_up.chunk(2, dim=-1), act), w, b)
    return linear_ref(gate_up, w, b, input_act=act)


def check_fused(m: int, n: int, k: int, dtype: torch.dtype, act: str, bias: bool, row_stride: int | None = None,
                **blocks: int) -> None:
    """skinny_matmul(gate_up, w, b, input_act=act) is bitwise act_mul then skinny_matmul, and near the fp32
    reference; gate_up [m, 2k] rows are views of a wider buffer when ``row_stride`` > 2k."""
    g = torch.Generator(device=DEVICE).manual_seed(m * 1000 + n + k)
    gate_up = (3 * torch.randn(m, row_stride or 2 * k, generator=g, device=DEVICE)).to(dtype)[:, : 2 * k]
    w = (torch.randn(n, k, generator=g, device=DEVICE) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g, device=DEVICE).to(dtype) if bias else None
    fused = skinny_matmul(gate_up, w, b, input_act=act, **blocks)
    two_step = skinny_matmul(act_mul(*gate_up.chunk(2, dim=-1), act), w, b, **blocks)
    assert fused.shape == (m, n) and fused.dtype == dtype
    assert torch.equal(bits(fused), bits(two_step)), (m, n, k, dtype, act)
    ref = fused_ref(gate_up, w, b, act)
    err = ((fused.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < BOUND[dtype], (m, n, k, dtype, act, err)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", ["silu", "sigmoid"])
@pytest.mark.parametrize("m, n, k", [(1, 40, 70), (1, 33, 130), (3, 24, 200)])
def test_fused_act_mul_input_is_bitwise_the_two_step_path(m: int, n: int, k: int, act: str,
                                                          dtype: torch.dtype) -> None:
    check_fused(m, n, k, dtype, act, bias=n % 2 == 1, row_stride=2 * k + 24 if k != 130 else None,
                block_n=8, block_k=64)


def test_fused_act_mul_input_at_the_default_blocks() -> None:
    check_fused(1, 24, 1100, torch.bfloat16, "silu", bias=True, row_stride=2300)  # K = 1024 + a ragged 76


def spy(monkeypatch: pytest.MonkeyPatch, name: str) -> list[str | None]:
    """Record the ``input_act`` of each call to ``kernels().<name>`` (None: none given)."""
    calls, real = [], getattr(linear_mod.kernels(), name)

    def record(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(kwargs.get("input_act"))
        return real(*args, **kwargs)

    monkeypatch.setattr(linear_mod.kernels(), name, record)
    return calls


def two_step_mlp(mlp: GatedMLP, x: torch.Tensor, matmul: Callable, act_mul_fn: Callable) -> torch.Tensor:
    gate, up = matmul(x, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias).chunk(2, dim=-1)
    return matmul(act_mul_fn(gate, up, mlp.hidden_act), mlp.down_proj.weight, mlp.down_proj.bias)


def test_gated_mlp_fuses_act_mul_only_into_one_row_16bit_kernel_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off the batch-invariant path (``batch_invariant=False``): the earlier dispatch."""
    torch.manual_seed(0)
    x64 = torch.randn(1, 40, dtype=torch.float64)  # the CPU float64 path (exactness tests): torch, on 4 rows
    mlp64 = GatedMLP(40, 70, "silu", bias=True).to(torch.float64)

    def padded_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return torch.nn.functional.linear(padded_rows(x), w, b)[:x.shape[0]]
    assert torch.equal(bits(mlp64(x64)), bits(two_step_mlp(mlp64, x64, padded_linear, act_mul_ref)))
    skinny_calls, act_mul_calls = spy(monkeypatch, "skinny_matmul"), spy(monkeypatch, "act_mul")
    cases = [  # (kernels on, dtype, rows, activation, the input_act of each skinny call, number of act_mul calls)
        (True, torch.bfloat16, 1, "silu", [None, "silu"], 0),  # one row: gate_up, then down with act_mul fused in
        (True, torch.float16, 1, "sigmoid", [None, "sigmoid"], 0),
        (True, torch.bfloat16, 2, "silu", [], 1),  # two rows: cuBLAS, the act_mul kernel, cuBLAS
        (True, torch.float32, 1, "silu", [], 1),  # fp32 models keep cuBLAS
        (True, torch.bfloat16, 1, "gelu", [None, None], 0),  # no act_mul kernel for it: torch gelu * up between
        (False, torch.bfloat16, 1, "silu", [], 0),  # TRUESPEC_BACKEND=torch: all torch
    ]
    for kernels_on, dtype, rows, act, skinny_acts, num_act_mul in cases:
        for module in (linear_mod, activation_mod):
            monkeypatch.setattr(module, "use_kernels", lambda t, on=kernels_on: on)  # as on CUDA
        skinny_calls.clear()
        act_mul_calls.clear()
        mlp = GatedMLP(40, 70, act, bias=rows == 1).to(device=DEVICE, dtype=dtype)
        linear_mod.set_batch_invariant(mlp, False)
        x = torch.randn(rows, 40, device=DEVICE).to(dtype)
        y = mlp(x)
        assert skinny_calls == skinny_acts and len(act_mul_calls) == num_act_mul, (kernels_on, dtype, rows, act)
        matmul = skinny_matmul if skinny_acts else torch.nn.functional.linear
        act_fn = act_mul if kernels_on and act in activation_mod.KERNEL_ACTIVATIONS else act_mul_ref
        assert torch.equal(bits(y), bits(two_step_mlp(mlp, x, matmul, act_fn))), (kernels_on, dtype, rows, act)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_skinny_matmul_at_qwen3_5_size(dtype: torch.dtype) -> None:
    for n, k in [(5120, 1024), (1024, 2048), (7168, 1024), (1024, 3584), (8224, 1024), (248320, 1024)]:
        for m in (1, 3, 8):
            check(m, n, k, dtype, bias=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_fused_mlp_down_projection_is_bitwise_at_qwen3_5_size(dtype: torch.dtype) -> None:
    for m in (1, 3):  # hidden 1024, intermediate 3584 (K = 3.5 blocks of 1024)
        check_fused(m, 1024, 3584, dtype, "silu", bias=False)
        check_fused(m, 1024, 3584, dtype, "silu", bias=False, row_stride=2 * 3584 + 64)
    torch.manual_seed(0)
    mlp = GatedMLP(1024, 3584, "silu").to(device=DEVICE, dtype=dtype)
    linear_mod.set_batch_invariant(mlp, False)
    x = torch.randn(1, 1024, device=DEVICE).to(dtype)
    assert torch.equal(bits(mlp(x)), bits(two_step_mlp(mlp, x, skinny_matmul, act_mul)))
