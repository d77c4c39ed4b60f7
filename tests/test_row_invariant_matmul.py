"""The row-invariant matmul (kernels/row_invariant_matmul.py): every projection of a CUDA step runs through it, so a
row's bits do not depend on the rest of the step (docs/ARCHITECTURE.md, invariant 4).

- It matches its torch reference (fp32 sums) on ragged shapes, strided rows, with and without bias, in bf16, fp16
  and fp32, and with act(gate) * up fused into its input it is bitwise the two launches it replaces.
- Row invariance, bitwise: every prefix of 1..64 rows equals the same rows of one larger call; a single row equals
  itself inside any batch; the decode rows of a step equal themselves beside a prefill chunk; across the tile paths
  (few rows: swapped tiles and parallel K segments; many rows: a large tile adding its segments itself).
- ``linear`` sends every CUDA 16/32-bit step to it (``batch_invariant=True``, the default) and fp64 / CPU to torch.
Without CUDA the kernel runs in Triton's interpreter on small shapes; ``@pytest.mark.gpu`` reruns the bitwise
checks at the Qwen3.5-0.8B projection shapes on the card (the tile paths agree there only if the card's MMA gives
each element the same bits whatever the tile's shape: this is the test that says so).
"""

import importlib
import os

import pytest
import torch

from truespec.ops.linear import padded_rows

if not torch.cuda.is_available():  # the interpreter must be on before truespec.kernels is first imported
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

import truespec.kernels.prefill_matmul as prefill_mod  # noqa: E402
import truespec.layers.activation as activation_mod  # noqa: E402
import truespec.layers.linear as linear_mod  # noqa: E402
from truespec.cpu_kernels import linear as cpu_linear  # noqa: E402
from truespec.kernels import act_mul, linear_ref, row_invariant_matmul  # noqa: E402
from truespec.layers.mlp import GatedMLP  # noqa: E402

rim = importlib.import_module("truespec.kernels.row_invariant_matmul")  # the module (the package exports the function)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BOUND = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}  # relative error vs fp32 sums
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, to compare exactly (torch.equal takes -0 for +0)."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def operands(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, row_stride: int | None = None,
             seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator(device=DEVICE).manual_seed(seed + m * 1000 + n + k)
    x = torch.randn(m, row_stride or k, generator=g, device=DEVICE).to(dtype)[:, :k]  # strided rows if wider
    w = (torch.randn(n, k, generator=g, device=DEVICE) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g, device=DEVICE).to(dtype) if bias else None
    return x, w, b


def assert_rows_invariant(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, prefixes: list[int],
                          singles: list[int]) -> torch.Tensor:
    full = bits(row_invariant_matmul(x, w, b))
    for m in prefixes:
        assert torch.equal(bits(row_invariant_matmul(x[:m], w, b)), full[:m]), f"prefix of {m} rows"
    for i in singles:
        assert torch.equal(bits(row_invariant_matmul(x[i:i + 1], w, b)), full[i:i + 1]), f"row {i} alone"
    return full


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k", [(1, 40, 70), (3, 33, 130), (17, 24, 600), (40, 72, 1100)])
def test_row_invariant_matmul_matches_reference(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    x, w, b = operands(m, n, k, dtype, bias=m % 2 == 1, row_stride=k + 24 if m > 1 else None)
    y = row_invariant_matmul(x, w, b)
    ref = linear_ref(x, w, b)
    assert y.shape == (m, n) and y.dtype == dtype
    err = ((y.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < BOUND[dtype], (m, n, k, dtype, err)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_1_to_64_are_bitwise_the_rows_of_a_larger_call(dtype: torch.dtype) -> None:
    # K = 1100: a narrow weight gets parallel K segments (plan), the last chunk ragged
    x, w, b = operands(70, 40, 1100, dtype, bias=True)
    assert rim.plan(40, 1100) > 1
    assert_rows_invariant(x, w, b, prefixes=list(range(1, 65)), singles=[0, 31, 69])


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_rows_beside_a_prefill_chunk_are_bitwise_the_decode_rows_alone(dtype: torch.dtype) -> None:
    """A step [3 decode rows | a 4-row verify | a 40-row prefill chunk]: each request's rows alone, bitwise."""
    x, w, b = operands(47, 56, 300, dtype, bias=False)
    step = bits(row_invariant_matmul(x, w, b))
    for start, end in [(0, 1), (1, 2), (2, 3), (3, 7), (7, 47)]:
        assert torch.equal(bits(row_invariant_matmul(x[start:end], w, b)), step[start:end]), (start, end)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_tile_paths_give_the_same_bits(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """Few rows (swapped tile, parallel segments) vs many rows (plain large tile, segments added in-program: fp32, or
    16-bit rows TMA cannot stream, as these K = 1100 ones): the thresholds are lowered so that the interpreter
    reaches the large path on small shapes."""
    monkeypatch.setattr(rim, "TILES", [(4, (64, 16, 128, 4, 3, True)), (None, (32, 32, 64, 4, 3, False))])
    monkeypatch.setattr(rim, "PARALLEL_MAX_M", 4)
    x, w, b = operands(50, 72, 1100, dtype, bias=True)
    assert_rows_invariant(x, w, b, prefixes=[1, 3, 4, 5, 16, 33], singles=[0, 49])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", [None, "silu"])
def test_the_prefill_path_gives_the_bits_of_the_small_tiles(monkeypatch: pytest.MonkeyPatch, act: str | None,
                                                           dtype: torch.dtype) -> None:
    """Long chunks of 16-bit rows take the persistent TMA kernel (kernels/prefill_matmul.py): every row, with bias
    or a fused act(gate) * up input (act_mul first there), bitwise the rows of the swapped few-row tiles. The
    thresholds and tile are lowered so that the interpreter reaches it on small shapes; 4 programs walk 9 tiles."""
    monkeypatch.setattr(rim, "PARALLEL_MAX_M", 4)
    monkeypatch.setattr(prefill_mod, "TILE", (16, 32, 64, 1, 4))
    calls = []
    real = prefill_mod.prefill_matmul
    monkeypatch.setattr(prefill_mod, "prefill_matmul", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    k = 1100 - 1100 % 128 + 128  # the TMA path needs K chunks that tile each segment
    x, w, b = operands(50, 72, 2 * k if act else k, dtype, bias=act is None)
    w = w[:, :k].contiguous()
    assert rim.plan(72, k) > 1  # segments added in order, as the other paths add them
    full = bits(row_invariant_matmul(x, w, b, input_act=act))
    assert calls, "the prefill kernel did not run"
    for m in (1, 3, 4):
        assert torch.equal(bits(row_invariant_matmul(x[:m], w, b, input_act=act)), full[:m]), m
    assert torch.equal(bits(row_invariant_matmul(x[17:18], w, b, input_act=act)), full[17:18])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", ["silu", "sigmoid"])
def test_fused_act_mul_input_is_bitwise_the_two_step_path(act: str, dtype: torch.dtype) -> None:
    g = torch.Generator(device=DEVICE).manual_seed(1)
    k = 300
    gate_up = (3 * torch.randn(20, 2 * k + 24, generator=g, device=DEVICE)).to(dtype)[:, :2 * k]  # strided rows
    w = (torch.randn(40, k, generator=g, device=DEVICE) / k**0.5).to(dtype)
    fused = bits(row_invariant_matmul(gate_up, w, input_act=act))
    two_step = bits(row_invariant_matmul(act_mul(*gate_up.chunk(2, dim=-1), act), w))
    assert torch.equal(fused, two_step)
    for m in (1, 4, 19):
        assert torch.equal(bits(row_invariant_matmul(gate_up[:m], w, input_act=act)), fused[:m])


def test_bad_shapes_and_activations_are_refused() -> None:
    x, w, _ = operands(2, 8, 16, torch.bfloat16, bias=False)
    with pytest.raises(ValueError, match="do not match"):
        row_invariant_matmul(x, w[:, :8])
    with pytest.raises(ValueError, match="input_act"):
        row_invariant_matmul(torch.cat([x, x], dim=1), w, input_act="gelu")
    assert row_invariant_matmul(x[:0], w).shape == (0, 8)


def test_linear_sends_every_cuda_step_to_the_invariant_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in (linear_mod, activation_mod):
        monkeypatch.setattr(module, "use_kernels", lambda t: t.dtype != torch.float64)  # as on CUDA
    calls: list[str | None] = []
    real = linear_mod.kernels().row_invariant_matmul
    monkeypatch.setattr(linear_mod.kernels(), "row_invariant_matmul",
                        lambda *a, **kw: calls.append(kw.get("input_act")) or real(*a, **kw))
    w = torch.randn(24, 40, device=DEVICE)
    for dtype in DTYPES:
        for rows in (1, 2, 9):
            x = torch.randn(rows, 40, device=DEVICE).to(dtype)
            assert torch.equal(linear_mod.linear(x, w.to(dtype)), real(x, w.to(dtype)))
    assert calls == [None] * 9
    x64 = torch.randn(2, 40, dtype=torch.float64, device=DEVICE)  # fp64 (the CPU exactness path): not the kernel
    if cpu_linear.can_run(x64, w.double()):  # on the CPU: the compiled projection (tests/test_cpu_kernels_linear.py)
        expected = cpu_linear.linear(x64, w.double())
    else:  # torch, on the CPU on a multiple of 4 rows
        padded = padded_rows(x64) if x64.device.type == "cpu" else x64
        expected = torch.nn.functional.linear(padded, w.double())[:2]
    assert torch.equal(linear_mod.linear(x64, w.double()), expected)
    assert len(calls) == 9
    mlp = GatedMLP(40, 70, "silu").to(device=DEVICE, dtype=torch.bfloat16)  # down: act(gate) * up fused in
    mlp(torch.randn(3, 40, device=DEVICE).to(torch.bfloat16))
    assert calls[9:] == [None, "silu"]


def test_set_batch_invariant_switches_every_linear_and_the_logits() -> None:
    from truespec.models.base import CausalLM

    mlp = GatedMLP(8, 16, "silu")
    linear_mod.set_batch_invariant(mlp, False)
    assert not mlp.gate_up_proj.batch_invariant and not mlp.down_proj.batch_invariant
    linear_mod.set_batch_invariant(mlp, True)
    assert mlp.gate_up_proj.batch_invariant and mlp.down_proj.batch_invariant
    assert CausalLM.batch_invariant  # the class default: the logits' projection is invariant too


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_rows_are_bitwise_invariant_at_qwen3_5_size(dtype: torch.dtype) -> None:
    """Every projection shape of the 0.8B model: prefixes 1..64 (decode / verify steps), 65..600 (verify batches
    and prefill chunks, both tile paths), single rows, and the fused MLP input; near the fp32 reference."""
    for n, k in [(5120, 1024), (1024, 2048), (7168, 1024), (1024, 3584), (8224, 1024), (248320, 1024)]:
        x, w, _ = operands(600, n, k, dtype, bias=False)
        full = assert_rows_invariant(x, w, None, prefixes=list(range(1, 65)) + [65, 100, 128, 300, 512, 513, 599],
                                     singles=[0, 17, 333, 599])
        ref = linear_ref(x[:64], w)
        err = ((full[:64].view(dtype).double() - ref.double()).norm() / ref.double().norm()).item()
        assert err < BOUND[dtype], (n, k, err)
    gate_up = torch.randn(600, 2 * 3584, device=DEVICE).to(dtype)
    w = (torch.randn(1024, 3584, device=DEVICE) / 60).to(dtype)
    fused = bits(row_invariant_matmul(gate_up, w, input_act="silu"))
    assert torch.equal(fused, bits(row_invariant_matmul(act_mul(*gate_up.chunk(2, dim=-1), "silu"), w)))
    for m in (1, 3, 64, 65):
        assert torch.equal(bits(row_invariant_matmul(gate_up[:m], w, input_act="silu")), fused[:m])
