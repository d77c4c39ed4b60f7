"""A whole Qwen3.5 GDN decoder layer in one compiled call (cpu_kernels/gdn_layer.py, gdn_layer.c) against the same
layer stage by stage: output, residual stream and states on ragged batches (decodes, verifies keeping every position,
prefill chunks, an inert row, padding rows), with and without an incoming residual, float32 and float64; a request's
rows and kept states bitwise the same alone and inside the batch (invariant 4); bad shapes named."""

from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from helpers.kernels import NUM_PAD_TOKENS, NUM_SLOTS, assert_near, make_context, state_batch
from test_gdn_kernels import GDN_ROWS, written_slots
from truespec.cpu_kernels import build
from truespec.cpu_kernels import gdn_layer as cpu_gdn_layer
from truespec.forward_context import set_forward_context
from truespec.models.qwen3_5 import Qwen3_5DecoderLayer

pytestmark = pytest.mark.skipif(build.load() is None, reason="no C compiler: the CPU path keeps its torch ops")
HIDDEN = 24
DECODES = [(1, 3, 3, 0), (1, 5, 5, 0), (0, -1, -1, 0), (1, 9, 9, 0)]  # updated in their own slots


def decoder_layer(dtype: torch.dtype, seed: int = 5) -> tuple[Qwen3_5DecoderLayer, tuple[torch.Tensor, torch.Tensor]]:
    config = SimpleNamespace(hidden_size=HIDDEN, linear_num_key_heads=2, linear_num_value_heads=4,
                             linear_key_head_dim=12, linear_value_head_dim=10, linear_conv_kernel_dim=4,
                             rms_norm_eps=1e-6, hidden_act="silu", intermediate_size=20)  # fmt: skip
    layer = Qwen3_5DecoderLayer(config, "linear_attention").to(dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(*param.shape, generator=gen, dtype=dtype) * param.shape[-1] ** -0.5)
    conv = torch.randn(NUM_SLOTS, layer.linear_attn.conv_dim, 3, generator=gen, dtype=dtype)
    ssm = torch.randn(NUM_SLOTS, 4, 12, 10, generator=gen, dtype=dtype) * 0.3
    return layer, (conv, ssm)


@torch.no_grad()
def run(layer: Qwen3_5DecoderLayer, states: tuple, rows: list, h: torch.Tensor, residual: torch.Tensor | None,
        whole: bool, monkeypatch: pytest.MonkeyPatch) -> tuple:  # fmt: skip
    """(output, residual, conv_state, ssm_state) of one forward over ``rows`` from copies of ``states``."""
    gdn = layer.linear_attn
    gdn.conv_state, gdn.ssm_state = (s.clone() for s in states)
    monkeypatch.setattr(cpu_gdn_layer, "ENABLED", whole)
    calls = []
    call = cpu_gdn_layer.GdnLayerCall.__call__
    monkeypatch.setattr(cpu_gdn_layer.GdnLayerCall, "__call__", lambda *a, f=call: calls.append(1) or f(*a))
    with set_forward_context(make_context(state_batch(rows), h.shape[0])):
        out, res = layer(h, residual, None, None)
    assert len(calls) == int(whole)
    return out, res, gdn.conv_state, gdn.ssm_state


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows", [GDN_ROWS, DECODES], ids=["mixed", "decodes"])
@pytest.mark.parametrize("has_residual", [True, False], ids=["residual", "first_layer"])
def test_whole_layer_gives_the_stage_by_stage_result(dtype: torch.dtype, rows: list, has_residual: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    layer, states = decoder_layer(dtype)
    gen = torch.Generator().manual_seed(1)
    num_rows = sum(r[0] for r in rows) + NUM_PAD_TOKENS
    h = torch.randn(num_rows, HIDDEN, generator=gen, dtype=dtype)
    residual = torch.randn(num_rows, HIDDEN, generator=gen, dtype=dtype) if has_residual else None
    got = run(layer, states, rows, h, residual, True, monkeypatch)
    expected = run(layer, states, rows, h, residual, False, monkeypatch)
    for a, b in zip(got, expected, strict=True):
        assert_near(a, b, dtype)
    assert torch.equal(got[2], expected[2])  # conv windows are copies of inputs
    untouched = [s for s in range(NUM_SLOTS) if s not in set(written_slots(rows))]
    assert torch.equal(got[3][untouched], states[1][untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("batch", [GDN_ROWS, DECODES], ids=["mixed", "decodes"])
def test_a_request_gives_the_same_bits_alone_and_in_the_batch(dtype: torch.dtype, batch: list,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    rows = [r for r in batch if r[0] > 0]
    layer, states = decoder_layer(dtype, seed=3)
    gen = torch.Generator().manual_seed(2)
    h = torch.randn(sum(r[0] for r in rows), HIDDEN, generator=gen, dtype=dtype)
    residual = torch.randn(h.shape, generator=gen, dtype=dtype)
    out, res, conv, ssm = run(layer, states, rows, h, residual, True, monkeypatch)
    start = 0
    for row in rows:
        mine = slice(start, start + row[0])
        alone = run(layer, states, [row], h[mine], residual[mine], True, monkeypatch)
        assert torch.equal(alone[0], out[mine]) and torch.equal(alone[1], res[mine])
        kept = written_slots([row])
        assert torch.equal(alone[2][kept], conv[kept]) and torch.equal(alone[3][kept], ssm[kept])
        start += row[0]


def test_bad_shapes_are_named() -> None:
    layer, (conv, ssm) = decoder_layer(torch.float32)
    gdn, mlp = layer.linear_attn, layer.mlp
    w = cpu_gdn_layer.GdnLayerWeights(
        layer.input_layernorm.weight, 1e-6, True, layer.post_attention_layernorm.weight, 1e-6, True,
        gdn.in_proj.weight, gdn.out_proj.weight[:, :-1], mlp.gate_up_proj.weight, mlp.down_proj.weight,
        gdn.conv1d.weight, gdn.A_log, gdn.dt_bias, gdn.norm.weight, 1e-6, (2, 4, 12, 10))  # fmt: skip
    meta = tuple(torch.tensor(x) for x in ([0, 1], [3], [3], [0]))
    with torch.no_grad(), pytest.raises(ValueError, match=r"out_proj \(24, 39\) \(expected \(24, 40\)\)"):
        cpu_gdn_layer.gdn_layer(torch.randn(1, HIDDEN), None, w, conv, ssm, meta)


@pytest.mark.parametrize("change", ["none", "in_place", "replaced", "data", "states"])
@torch.no_grad()
def test_kept_call_follows_changed_weights_and_states(change: str) -> None:
    # the layer keeps its compiled call between steps: a weight changed in place, a replaced parameter, new data under
    # the same parameter, or newly bound states must each rebuild it and give the changed layer's result
    dtype = torch.float64
    layer, states = decoder_layer(dtype)
    gdn, mlp = layer.linear_attn, layer.mlp
    h = torch.randn(sum(r[0] for r in DECODES), HIDDEN, generator=torch.Generator().manual_seed(4), dtype=dtype)
    context = make_context(state_batch(DECODES), h.shape[0])
    gdn.conv_state, gdn.ssm_state = (s.clone() for s in states)
    with set_forward_context(context):
        layer(h, None, None, None)  # builds and keeps the call
    kept = layer.cpu_calls.kept("gdn_layer")
    if change == "in_place":
        mlp.down_proj.weight.mul_(-2.0)
    elif change == "replaced":
        gdn.A_log = torch.nn.Parameter(gdn.A_log + 0.5)
    elif change == "data":
        layer.input_layernorm.weight.data = layer.input_layernorm.weight.data + 1.0
    elif change == "states":
        gdn.conv_state, gdn.ssm_state = gdn.conv_state.clone(), gdn.ssm_state.clone()
    before = (gdn.conv_state.clone(), gdn.ssm_state.clone())
    with set_forward_context(context):
        got = layer(h, None, None, None)
    assert (layer.cpu_calls.kept("gdn_layer") is kept) == (change == "none")
    got_states = (gdn.conv_state.clone(), gdn.ssm_state.clone())
    gdn.conv_state, gdn.ssm_state = before
    with set_forward_context(context), mock.patch.object(cpu_gdn_layer, "ENABLED", False):
        expected = layer(h, None, None, None)
    for a, b in zip((*got, *got_states), (*expected, gdn.conv_state, gdn.ssm_state), strict=True):
        assert_near(a, b, dtype)


def test_inference_tensor_weights_keep_the_stage_by_stage_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # weights made under torch.inference_mode have no version counter, so a kept call could not see them change:
    # such a layer takes the stage-by-stage path (as linear.py's packed copies do)
    calls = []
    call = cpu_gdn_layer.GdnLayerCall.__call__
    monkeypatch.setattr(cpu_gdn_layer.GdnLayerCall, "__call__", lambda *a, f=call: calls.append(1) or f(*a))
    with torch.inference_mode():
        layer, states = decoder_layer(torch.float32)
        gdn = layer.linear_attn
        gdn.conv_state, gdn.ssm_state = states
        h = torch.randn(sum(r[0] for r in DECODES), HIDDEN, generator=torch.Generator().manual_seed(6))
        with set_forward_context(make_context(state_batch(DECODES), h.shape[0])):
            out, _ = layer(h, None, None, None)
    assert not calls and layer.cpu_calls.kept("gdn_layer") is None and out.isfinite().all()
