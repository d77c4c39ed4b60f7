"""worker/piecewise_graphs.py: steps with fla's chunk kernel replayed in pieces between its calls.

CUDA graphs do not exist on the CPU; what a replay relies on does, and is tested here under the Triton interpreter:
a GDN layer run with the pieces' recorder (flags and conv output in static buffers, fla's call through the recorder)
in a step padded to its bucket gives the real rows of the unpadded eager step bit for bit, with the same states, and
zeros in the padding rows; the static inputs pad requests apart from tokens; the conv writes into a given buffer.
The GPU test compares whole engines: piecewise graphs (FULL) against eager prefill steps (FULL_DECODE_ONLY).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before truespec.kernels is imported: see tests/helpers/kernels.py

pytest.importorskip("triton")

from test_gdn_chunked import bf16_layer_with_chunk_kernel, reference_chunk_kernel  # noqa: E402
from truespec.forward_context import set_forward_context  # noqa: E402
from truespec.kernels import causal_conv1d  # noqa: E402
from truespec.worker.input_builder import ContextRow, build_forward_context, build_step  # noqa: E402
from truespec.worker.piecewise_graphs import PieceRecorder, bucket_sizes, fill_flags  # noqa: E402

CPU = torch.device("cpu")


def test_buckets_keep_the_matmul_path_of_the_steps_they_serve() -> None:
    assert bucket_sizes(8192) == [256, 512] + [1024 * i for i in range(1, 9)]
    assert bucket_sizes(5000) == [256, 512, 1024, 2048, 3072, 4096, 5000]
    assert bucket_sizes(512) == [256, 512] and bucket_sizes(300) == [256, 300]
    # a step of a capped prompt chunk (2,048 by default) and up to 256 decode / verify rows
    assert bucket_sizes(8192, 2048) == [256, 512, 1024, 2048, 2304, 3072] + [1024 * i for i in range(4, 9)]
    assert bucket_sizes(2048, 2048) == [256, 512, 1024, 2048]


def test_static_inputs_pad_requests_apart_from_tokens() -> None:
    rows = [ContextRow([0, 1], 0, 20, -1, 0, 19, 1, 20, True), ContextRow([2], 3, 1, 4, 4, 0, 1, 0, False)]
    step = build_step(rows, list(range(21)), list(range(20)) + [3], 16, CPU, pad_to=32, width=4, pad_reqs_to=5)
    ctx = step.ctx
    assert step.input_ids.shape[0] == 32 and ctx.slot_mapping[21:].eq(-1).all()
    assert ctx.query_start_loc.tolist() == [0, 20, 21, 21, 21, 21]
    assert ctx.state_dst.tolist() == [0, 4, -1, -1, -1] and ctx.block_tables.shape == (5, 4)
    assert ctx.query_start_loc_cpu == [0, 20, 21] and ctx.gdn_chunked_cpu == [True, False, False, False, False]
    with pytest.raises(ValueError, match="pad_reqs_to=1"):
        build_step(rows, list(range(21)), list(range(21)), 16, CPU, pad_to=32, width=4, pad_reqs_to=1)


def test_conv_writes_into_a_given_buffer() -> None:
    gen = torch.Generator().manual_seed(3)
    x, weight = torch.randn(9, 12, generator=gen), torch.randn(12, 4, generator=gen)
    state = torch.randn(2, 12, 3, generator=gen)
    meta = [torch.tensor(v) for v in ([0, 6, 9], [0, -1], [0, 1], [5, 2])]
    expected = causal_conv1d(x, weight, state.clone(), *meta, split=(4, 4, 4))
    buffer = torch.full((200,), float("nan"))
    got = causal_conv1d(x, weight, state.clone(), *meta, split=(4, 4, 4), out=buffer)
    assert all(torch.equal(a, b) and a.data_ptr() >= buffer.data_ptr() for a, b in zip(got, expected, strict=True))
    with pytest.raises(ValueError, match="out must be"):
        causal_conv1d(x, weight, state.clone(), *meta, split=(4, 4, 4), out=torch.empty(100))


class _Owner:
    """PiecewiseGraphs' side of the recorder, without CUDA: static flags and shared buffers."""

    def __init__(self, num_reqs: int) -> None:
        self.flags, self.plan, self.buffers = torch.full((num_reqs,), 7, dtype=torch.int64), None, {}

    def buffer(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.buffers.setdefault(name, torch.full((numel,), float("nan"), dtype=dtype))[:numel]


@torch.no_grad()
@pytest.mark.parametrize("flagged", [True, False])
def test_a_padded_step_through_the_pieces_hooks_gives_the_eager_steps_bits(
    flagged: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bf16 GDN layer, a prompt chunk beside a decode and a verify: the eager step (unpadded) against the same step
    padded to a bucket (7 more token rows, 2 more requests) through the recorder's hooks, its flags filled from the
    plan as a replay does: equal rows and states bit for bit, zeros in the padding rows. The chunk flagged for fla
    (eager: the chunked path), or not (eager: the token loop with its gates fused; pieces: gates as tensors)."""
    layer, conv_state, ssm_state, gen = bf16_layer_with_chunk_kernel(monkeypatch, reference_chunk_kernel, 12, seed=12)
    rows = [ContextRow([6], 6, 1, 5, 5, 0, 1, 0, False), ContextRow(list(range(5)), 0, 70, -1, 2, 69, 1, 70, flagged),
            ContextRow([7], 9, 3, 8, 8, 0, 3, 0, False)]  # fmt: skip
    num_tokens = 74
    x = torch.randn(num_tokens + 7, 32, generator=gen).to(torch.bfloat16)
    results = []
    for padded in (False, True):
        layer.conv_state, layer.ssm_state = conv_state.clone(), ssm_state.clone()
        if padded:
            step = build_step(rows, [0] * num_tokens, [0] * num_tokens, 16, CPU, pad_to=num_tokens + 7, width=5,
                              pad_reqs_to=5)  # fmt: skip
            ctx, owner = step.ctx, _Owner(5)
            ctx.pieces = PieceRecorder(owner, capturing=False)
        else:
            ctx = build_forward_context(rows, 16, CPU)
        with set_forward_context(ctx):
            if padded:  # what PiecewiseGraphs._replay does before the first piece
                fill_flags(owner.flags, layer._chunked_plan, ctx)
            out = layer._forward_kernels(x if padded else x[:num_tokens], ctx)
        results.append((out, layer.conv_state, layer.ssm_state))
    (eager, conv_e, ssm_e), (pieces, conv_p, ssm_p) = results
    assert owner.plan is not None and {"gdn_conv", "gdn_gates"} <= owner.buffers.keys()  # the hooks were taken
    assert torch.equal(pieces[:num_tokens], eager) and pieces[num_tokens:].eq(0).all()
    assert torch.equal(conv_p, conv_e) and torch.equal(ssm_p, ssm_e)


@torch.no_grad()
def test_a_step_planned_ahead_through_the_pieces_hooks_gives_the_eager_steps_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step planned ahead (a decode and a verify moved on the device by what the step before accepted, a short
    prompt joining them unmoved), padded to a bucket and moved by ``shift_positions`` as PiecewiseGraphs.run does: its
    host copies of the state sources are gone, so the GDN layer's call between two pieces takes the token loop on the
    device's metadata, and gives the bits of the eager step built at the moved positions (no plan built, flags 0)."""
    from truespec.worker.input_builder import shift_positions

    layer, conv_state, ssm_state, gen = bf16_layer_with_chunk_kernel(monkeypatch, reference_chunk_kernel, 12, seed=13)
    rows = [ContextRow([6], 6, 1, 5, 5, 0, 1, 0, False), ContextRow(list(range(5)), 0, 70, -1, 2, 69, 1, 70, False),
            ContextRow([7], 9, 3, 8, 8, 0, 3, 0, False)]  # fmt: skip
    moved = [ContextRow([6], 7, 1, 6, 5, 0, 1, 0, False), rows[1], ContextRow([7], 11, 3, 10, 8, 0, 3, 0, False)]
    num_tokens = 74
    x = torch.randn(num_tokens + 7, 32, generator=gen).to(torch.bfloat16)
    layer.conv_state, layer.ssm_state = conv_state.clone(), ssm_state.clone()
    eager_ctx = build_forward_context(moved, 16, CPU)
    with set_forward_context(eager_ctx):
        eager = layer._forward_kernels(x[:num_tokens], eager_ctx)
    expected = (eager, layer.conv_state, layer.ssm_state)
    layer.conv_state, layer.ssm_state = conv_state.clone(), ssm_state.clone()
    step = build_step(rows, [0] * num_tokens, [0] * num_tokens, 16, CPU, pad_to=num_tokens + 7, width=5, pad_reqs_to=5)
    shift_positions(step, torch.tensor([1, 0, 2]), num_tokens, 3, 16)
    ctx, owner = step.ctx, _Owner(5)
    ctx.pieces = PieceRecorder(owner, capturing=False)
    assert ctx.state_cpu is None and ctx.state_src.tolist()[:3] == [6, -1, 10]
    fill_flags(owner.flags, layer._chunked_plan, ctx)  # as PiecewiseGraphs._replay: a moved step builds no plan
    assert owner.flags.eq(0).all()
    with set_forward_context(ctx):
        pieces = layer._forward_kernels(x, ctx)
    assert torch.equal(pieces[:num_tokens], expected[0]) and pieces[num_tokens:].eq(0).all()
    assert torch.equal(layer.conv_state, expected[1]) and torch.equal(layer.ssm_state, expected[2])


def test_gating_writes_into_a_given_buffer() -> None:
    from truespec.kernels import gating_buffer_size, gdn_gating

    gen = torch.Generator().manual_seed(4)
    a, b = torch.randn(7, 3, generator=gen), torch.randn(7, 3, generator=gen)
    A_log, dt_bias = torch.randn(3, generator=gen), torch.randn(3, generator=gen)  # noqa: N806
    assert gating_buffer_size(7, 3) == 48  # beta from element 24: 16-byte aligned
    buffer = torch.full((60,), float("nan"))
    got, expected = gdn_gating(a, b, A_log, dt_bias, buffer), gdn_gating(a, b, A_log, dt_bias)
    assert all(torch.equal(x, y) for x, y in zip(got, expected, strict=True))
    assert got[1].data_ptr() == buffer.data_ptr() + 24 * 4
    with pytest.raises(ValueError, match="out must be"):
        gdn_gating(a, b, A_log, dt_bias, torch.empty(40))


def test_static_inputs_fill_one_buffer_through_each_sizes_views() -> None:
    """worker/static_inputs.py (the full graphs' and the piecewise graphs' inputs): every size's views cut one buffer;
    a step written into them is what build_step makes of it unpadded, padding inert."""
    from truespec.worker.static_inputs import StaticInputs

    inputs = StaticInputs([8, 32], width=4, block_size=16, device=CPU, num_staging=0, num_reqs=3)
    rows = [ContextRow([0, 1], 0, 20, -1, 0, 19, 1, 20, True), ContextRow([2], 3, 1, 4, 4, 0, 1, 0, False)]
    ids, pos = list(range(21)), list(range(20)) + [3]
    step, plain = inputs.build(rows, ids, pos, 32), build_step(rows, ids, pos, 16, CPU)
    assert step.input_ids.data_ptr() == inputs.buffer.data_ptr() and step.input_ids.shape[0] == 32
    assert torch.equal(step.input_ids[:21], plain.input_ids) and step.ctx.slot_mapping[21:].eq(-1).all()
    assert torch.equal(step.ctx.slot_mapping[:21], plain.ctx.slot_mapping)
    assert step.ctx.query_start_loc.tolist() == [0, 20, 21, 21] and step.ctx.state_dst.tolist() == [0, 4, -1]
    small = inputs.build(rows[1:], [7], [3], 8)
    assert small.input_ids.tolist() == [7] + [0] * 7 and small.ctx.query_start_loc.tolist() == [0, 1, 1, 1]
