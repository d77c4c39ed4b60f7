"""A decoder layer's post-attention add + RMSNorm and SwiGLU MLP in one compiled call (cpu_kernels/mlp_block.py,
mlp_block.c) against the same stages as modules: output and residual stream, float32 and float64; a row bitwise the
same alone and inside batches (invariant 4); bad shapes named; an attention layer of the model takes it."""

import pytest
import torch

from helpers.kernels import assert_near
from truespec.cpu_kernels import build
from truespec.cpu_kernels import mlp_block as cpu_mlp_block
from truespec.layers.mlp import GatedMLP
from truespec.layers.norm import RMSNorm

pytestmark = pytest.mark.skipif(build.load() is None, reason="no C compiler: the CPU path keeps its torch ops")
HIDDEN, INTER = 24, 20


def modules(dtype: torch.dtype) -> tuple[RMSNorm, GatedMLP]:
    norm, mlp = RMSNorm(HIDDEN, 1e-6, unit_offset=True).to(dtype), GatedMLP(HIDDEN, INTER, "silu").to(dtype)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in (*norm.parameters(), *mlp.parameters()):
            param.copy_(torch.randn(*param.shape, generator=gen, dtype=dtype) * param.shape[-1] ** -0.5)
    return norm, mlp


def block(norm: RMSNorm, mlp: GatedMLP) -> cpu_mlp_block.MlpBlockCall:
    return cpu_mlp_block.MlpBlockCall(norm.weight, norm.eps, norm.unit_offset, mlp.gate_up_proj.weight,
                                      mlp.down_proj.weight)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@torch.no_grad()
def test_block_gives_the_stage_by_stage_result(dtype: torch.dtype) -> None:
    norm, mlp = modules(dtype)
    gen = torch.Generator().manual_seed(1)
    x, stream = (torch.randn(7, HIDDEN, generator=gen, dtype=dtype) for _ in range(2))
    assert cpu_mlp_block.can_run(x, norm.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight)
    out, stream_out = block(norm, mlp)(x, stream)
    normed, expected_stream = norm.add_norm(x, stream)
    assert torch.equal(stream_out, expected_stream)  # the same add
    assert_near(out, mlp(normed), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@torch.no_grad()
def test_a_row_gives_the_same_bits_alone_and_in_batches(dtype: torch.dtype) -> None:
    norm, mlp = modules(dtype)
    call = block(norm, mlp)
    gen = torch.Generator().manual_seed(2)
    x, stream = (torch.randn(17, HIDDEN, generator=gen, dtype=dtype) for _ in range(2))
    out, stream_out = call(x, stream)
    for rows in (slice(0, 1), slice(3, 7), slice(5, 6), slice(8, 17)):
        alone, alone_stream = call(x[rows], stream[rows])
        assert torch.equal(alone, out[rows]) and torch.equal(alone_stream, stream_out[rows])


def test_bad_shapes_are_named() -> None:
    norm, mlp = modules(torch.float32)
    with pytest.raises(ValueError, match=r"down \(24, 19\) do not fit hidden size 24"):
        cpu_mlp_block.MlpBlockCall(norm.weight, 1e-6, True, mlp.gate_up_proj.weight, mlp.down_proj.weight[:, :-1])


def test_attention_layers_take_the_block(monkeypatch: pytest.MonkeyPatch) -> None:
    from truespec import LLM, SamplingParams
    from truespec.assets import DEFAULT_MODEL_DIR
    from truespec.cpu_kernels import attention_layer as cpu_attention_layer

    monkeypatch.setattr(cpu_attention_layer, "ENABLED", False)  # the whole-layer call runs the block inside C
    calls = []
    call = cpu_mlp_block.MlpBlockCall.__call__
    monkeypatch.setattr(cpu_mlp_block.MlpBlockCall, "__call__", lambda *a, f=call: calls.append(1) or f(*a))
    llm = LLM(str(DEFAULT_MODEL_DIR), dtype="float32", device="cpu", max_model_len=256)
    llm.generate(["def f(x):"], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    attention_layers = sum(1 for t in llm.llm_engine.hf_config.layer_types if t == "full_attention")
    assert len(calls) == 3 * attention_layers  # a prompt step and two decodes; GDN layers run whole
