"""Gated DeltaNet kernels (causal_conv1d with its gather_windows, gdn_recurrent with tensor or fused gates)
against their torch references, which are the layer's own code: each request's state kept after each kept
position (docs/ARCHITECTURE.md, invariant 2) and nowhere else, sources inside a request's own destination group
read before they are overwritten, gates computed in-kernel bitwise as ``gdn_gating``'s, and the kernels together giving
``GatedDeltaNet``'s output and states.

Batches are ragged on purpose: plain decodes, 1+k verifies, prefill chunks continuing a state, fresh prefills,
an empty query, trailing padding tokens and an inert row (state_dst -1), with random (never zero) inputs and
states. Without CUDA the kernels run in Triton's interpreter (see tests/helpers/kernels.py), so shapes are tiny;
``@pytest.mark.gpu`` tests rerun them compiled at Qwen3.5-0.8B sizes.
"""

import importlib
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from helpers.kernels import (
    DEVICE,
    DTYPES,
    GPU_DTYPES,
    GPU_TOL_SCALE,
    NUM_PAD_TOKENS,
    NUM_SLOTS,
    assert_near,
    assert_padding_zero,
    gpu,
    i64,
    make_context,
    needs_cuda,
    poisoned_empty,
    randn,
    state_batch,
)
from truespec.forward_context import set_forward_context
from truespec.kernels import (
    GateInputs,
    causal_conv1d,
    causal_conv1d_ref,
    gdn_gating,
    gdn_recurrent,
    gdn_recurrent_ref,
)
from truespec.layers.gdn import GatedDeltaNet
from truespec.ops.precision import compute_dtype

# the module, not the function the package re-exports under the same name
causal_conv1d_module = importlib.import_module("truespec.kernels.causal_conv1d")
# GDN rows (query_len, state_src, state_dst, state_write_start) over groups of 4 slots: decode from a slot of
# its own group; verify whose source is its first destination slot (read before overwritten); empty query;
# fresh prefill keeping its last state; inert row; prefill chunk continuing a state.
GDN_ROWS = [(1, 2, 0, 0), (4, 4, 4, 0), (0, 9, 8, -1), (6, -1, 12, 5), (3, 17, -1, 0), (2, 21, 20, 1)]
# Sources inside the request's own destination group, every position kept: a 1+3 verify starting from its last
# destination slot (overwritten by its last token), a verify from its middle slot, a decode overwriting its own
# source, a prefill chunk whose source is rewritten mid-chunk; a fresh 2-token prefill, a decode.
GDN_ROWS_OWN_SOURCES = [(4, 3, 0, 0), (3, 5, 4, 0), (1, 8, 8, 0), (5, 14, 12, 1), (2, -1, 16, 0), (1, 20, 21, 0)]
GDN_ROWS_OWN_SOURCES += [(0, -1, -1, 0)] * 2  # zero-length requests without slots, as a CUDA graph pads its rows
GDN_ROW_SETS = pytest.mark.parametrize("rows", [GDN_ROWS, GDN_ROWS_OWN_SOURCES], ids=["mixed", "own_sources"])


def written_slots(rows: list[tuple[int, int, int, int]]) -> list[int]:
    return [dst + t - ws for n, _, dst, ws in rows if dst >= 0 for t in range(max(ws, 0), n)]


def gdn_qkv(
    num_tokens: int, hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k [T, hk, dk], v [T, hv, dv]: strided views of one conv output, as in the layer."""
    qkv = randn(num_tokens, 2 * hk * dk + hv * dv, dtype=dtype, gen=gen)
    q, k, v = qkv.split([hk * dk, hk * dk, hv * dv], dim=-1)
    return q.unflatten(-1, (hk, dk)), k.unflatten(-1, (hk, dk)), v.unflatten(-1, (hv, dv))


def check_gdn_recurrent(
    dtype: torch.dtype, rows: list, hk: int, hv: int, dk: int, dv: int, l2norm: bool, tol_scale: float = 1.0
) -> None:
    gen = torch.Generator().manual_seed(4)
    batch = state_batch(rows)
    num_tokens, cdt = batch["query_start_loc"][-1].item() + NUM_PAD_TOKENS, compute_dtype(dtype)
    q, k, v = gdn_qkv(num_tokens, hk, hv, dk, dv, dtype, gen)
    if not l2norm:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    g = -F.softplus(randn(num_tokens, hv, dtype=cdt, gen=gen))  # log decay < 0
    beta = randn(num_tokens, hv, dtype=cdt, gen=gen).sigmoid()
    state = randn(NUM_SLOTS, hv, dk, dv, dtype=cdt, gen=gen) * 0.3
    expected_state = state.clone()
    args = (batch["query_start_loc"], batch["state_src"], batch["state_dst"], batch["state_write_start"])
    with poisoned_empty():
        out = gdn_recurrent(q, k, v, g, beta, state, *args, use_qk_l2norm=l2norm)
    expected = gdn_recurrent_ref(q, k, v, g, beta, expected_state, *args, use_qk_l2norm=l2norm)
    assert_near(out, expected, dtype, tol_scale)
    assert_near(state, expected_state, cdt, tol_scale)
    kept = set(written_slots(rows))
    untouched = [s for s in range(NUM_SLOTS) if s not in kept]
    assert torch.equal(state[untouched], expected_state[untouched])
    assert_padding_zero(out)


@pytest.mark.parametrize("dtype", DTYPES)
@GDN_ROW_SETS
def test_gdn_recurrent_keeps_state_after_each_kept_position(dtype: torch.dtype, rows: list) -> None:
    check_gdn_recurrent(dtype, rows, hk=2, hv=4, dk=12, dv=40, l2norm=True)


def test_gdn_recurrent_without_fused_l2norm() -> None:
    check_gdn_recurrent(torch.float64, GDN_ROWS, hk=2, hv=2, dk=8, dv=6, l2norm=False)


def check_fused_gates(
    dtype: torch.dtype, rows: list, hk: int, hv: int, dk: int, dv: int, tol_scale: float = 1.0
) -> None:
    """gdn_recurrent given the raw gate inputs == gdn_gating then gdn_recurrent, bit for bit (outputs and every
    state), and == the reference within its tolerance. a and b are column slices of one merged projection
    output, scaled so that a + dt_bias reaches softplus' pass-through branch (> 20) too."""
    gen = torch.Generator().manual_seed(9)
    batch = state_batch(rows)
    num_tokens, cdt = batch["query_start_loc"][-1].item() + NUM_PAD_TOKENS, compute_dtype(dtype)
    q, k, v = gdn_qkv(num_tokens, hk, hv, dk, dv, dtype, gen)
    merged = randn(num_tokens, 3 + 2 * hv, dtype=dtype, gen=gen) * 12
    gates = GateInputs(merged[:, 3 + hv :], merged[:, 3 : 3 + hv], randn(hv, dtype=dtype, gen=gen),
                       randn(hv, dtype=dtype, gen=gen))  # fmt: skip
    states = [randn(NUM_SLOTS, hv, dk, dv, dtype=cdt, gen=gen) * 0.3]
    states += [states[0].clone(), states[0].clone()]
    args = (batch["query_start_loc"], batch["state_src"], batch["state_dst"], batch["state_write_start"])
    g, beta = gdn_gating(gates.a, gates.b, gates.A_log, gates.dt_bias)
    with poisoned_empty():
        separate = gdn_recurrent(q, k, v, g, beta, states[0], *args)
        fused = gdn_recurrent(q, k, v, None, None, states[1], *args, gate_inputs=gates)
    expected = gdn_recurrent_ref(q, k, v, None, None, states[2], *args, gate_inputs=gates)
    assert torch.equal(fused, separate)
    assert torch.equal(states[1], states[0])
    assert_near(fused, expected, dtype, tol_scale)
    # beta is rounded to the model dtype (torch's sigmoid vs the kernel's may round one ulp apart), so the states
    # carry the model dtype's tolerance here, not the compute dtype's
    assert_near(states[1], states[2], dtype, tol_scale)
    assert_padding_zero(fused)


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16])
@GDN_ROW_SETS
def test_gdn_recurrent_fused_gates_are_bitwise_the_gating_kernels(dtype: torch.dtype, rows: list) -> None:
    check_fused_gates(dtype, rows, hk=2, hv=4, dk=12, dv=8)


def test_gdn_recurrent_takes_exactly_one_source_of_gates() -> None:
    q, v = torch.ones(3, 1, 4, device=DEVICE), torch.ones(3, 1, 4, device=DEVICE)
    state, g = torch.zeros(2, 1, 4, 4, device=DEVICE), torch.zeros(3, 1, device=DEVICE)
    meta = (i64([0, 3]), i64([-1]), i64([-1]), i64([0]))
    gates = GateInputs(g, g, torch.zeros(1, device=DEVICE), torch.zeros(1, device=DEVICE))
    with pytest.raises(ValueError, match="g and beta"):
        gdn_recurrent(q, q, v, g, None, state, *meta)
    with pytest.raises(ValueError, match="gate_inputs"):
        gdn_recurrent(q, q, v, g, g, state, *meta, gate_inputs=gates)
    with pytest.raises(ValueError, match="need a torch.float32 state"):
        gdn_recurrent(q, q, v, None, None, state.double(), *meta, gate_inputs=gates)
    with pytest.raises(ValueError, match="A_log"):
        GateInputs(g, g, torch.zeros(2, device=DEVICE), torch.zeros(1, device=DEVICE))


def check_causal_conv1d(
    dtype: torch.dtype, rows: list, channels: int, kernel: int, block_c: int, block_t: int = 32, tol_scale: float = 1.0
) -> None:
    """Against the reference, and bit for bit against the same kernel fed by torch's index_select gather (the
    gather kernel it replaced). Windows of requests without a source stay unwritten (NaN here): never read."""
    gen = torch.Generator().manual_seed(5)
    batch = state_batch(rows)
    num_tokens = batch["query_start_loc"][-1].item() + NUM_PAD_TOKENS
    x = randn(num_tokens, channels + 3, dtype=dtype, gen=gen)[:, :channels]  # strided rows
    weight = randn(channels, 1, kernel, dtype=dtype, gen=gen)
    conv_state = randn(NUM_SLOTS, channels, kernel - 1, dtype=dtype, gen=gen)
    expected_state, index_select_state, plain_state = conv_state.clone(), conv_state.clone(), conv_state.clone()
    args = (batch["query_start_loc"], batch["state_src"], batch["state_dst"], batch["state_write_start"])
    with poisoned_empty():
        out = causal_conv1d(x, weight, conv_state, *args, block_t=block_t, block_c=block_c)
    assert_near(out, causal_conv1d_ref(x, weight, expected_state, *args), dtype, tol_scale)
    assert torch.equal(conv_state, expected_state)  # windows are copies of inputs: exact
    assert_padding_zero(out)
    with mock.patch.object(causal_conv1d_module, "gather_windows", index_select_gather):
        assert torch.equal(out, causal_conv1d(x, weight, index_select_state, *args, block_t=block_t, block_c=block_c))
    assert torch.equal(conv_state, index_select_state)
    plain = causal_conv1d(x, weight, plain_state, *args, block_t=block_t, block_c=block_c, plain_tiles=True)
    assert torch.equal(plain, out) and torch.equal(plain_state, conv_state)


def index_select_gather(conv_state: torch.Tensor, state_src: torch.Tensor) -> torch.Tensor:
    """The gather causal_conv1d ran before gather_windows (two launches: clamp, index_select)."""
    return conv_state.index_select(0, state_src.clamp(min=0)).contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
@GDN_ROW_SETS
def test_causal_conv1d_keeps_window_after_each_kept_position(dtype: torch.dtype, rows: list) -> None:
    check_causal_conv1d(dtype, rows, channels=40, kernel=4, block_c=16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_conv1d_tile_rows_take_their_own_request(dtype: torch.dtype) -> None:
    """Tiles of 8 rows x 16 channels: the first spans a decode, a 1+3 verify keeping every position and another
    decode, with empty queries between them; 20- and 19-token prefill chunks (> 2 tiles; fresh, and continuing a
    window) start and end mid-tile; the last tile holds a fresh prefill, an inert row, padding and rows past T."""
    rows = [(1, 5, 1, 0), (0, 9, 8, -1), (0, -1, -1, 0), (4, 3, 4, 0), (1, 12, 12, 0), (0, -1, -1, 0)]
    rows += [(20, -1, 13, 19), (3, 16, 14, 0), (19, 18, 17, 18), (2, -1, 20, 1), (1, 22, -1, 0)]
    check_causal_conv1d(dtype, rows, channels=40, kernel=4, block_c=16, block_t=8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_conv1d_plain_tiles_inside_a_long_prompt(dtype: torch.dtype) -> None:
    """A 45-token prompt keeping its last window between a decode and a verify: tiles of 8 rows wholly inside it
    take ``plain_tiles``' branch, its first and last tiles and the others the general one; the same bits
    (check_causal_conv1d compares both)."""
    rows = [(1, 5, 1, 0), (45, -1, 13, 44), (3, 16, 14, 0), (40, 18, -1, 0)]
    check_causal_conv1d(dtype, rows, channels=40, kernel=4, block_c=16, block_t=8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("widths", [(16, 8, 16), (7, 13, 20)])
def test_causal_conv1d_split_output_holds_the_same_values(dtype: torch.dtype, widths: tuple) -> None:
    """``split`` writes q / k / v as three contiguous tensors (fla's chunk kernel takes them so, in fp32): each the
    plain output's columns bit for bit, in x's dtype or exactly widened to fp32, with the same window updates; tiles
    of 8 rows x 16 channels that straddle both requests and blocks (widths not multiples of 16 included)."""
    gen = torch.Generator().manual_seed(6)
    rows = [(1, 5, 1, 0), (4, 3, 4, 0), (20, -1, 13, 19), (19, 18, 17, 18), (2, -1, 20, 1)]
    batch = state_batch(rows)
    num_tokens = batch["query_start_loc"][-1].item() + NUM_PAD_TOKENS
    x = randn(num_tokens, 40, dtype=dtype, gen=gen)
    weight = randn(40, 1, 4, dtype=dtype, gen=gen)
    conv_state = randn(NUM_SLOTS, 40, 3, dtype=dtype, gen=gen)
    args = (batch["query_start_loc"], batch["state_src"], batch["state_dst"], batch["state_write_start"])
    plain_state = conv_state.clone()
    plain = causal_conv1d(x, weight, plain_state, *args, block_t=8, block_c=16)
    expected = plain.split(list(widths), dim=-1)
    for out_dtype in (None, torch.float32):
        state = conv_state.clone()
        with poisoned_empty():
            parts = causal_conv1d(x, weight, state, *args, block_t=8, block_c=16, split=widths, out_dtype=out_dtype)
        assert torch.equal(state, plain_state)
        for part, want in zip(parts, expected, strict=True):
            assert part.is_contiguous() and part.dtype == (out_dtype or dtype)
            assert torch.equal(part, want.to(part.dtype))
        state = conv_state.clone()
        parts = causal_conv1d(x, weight, state, *args, block_t=8, block_c=16, split=widths, out_dtype=out_dtype,
                              plain_tiles=True)  # fmt: skip
        assert torch.equal(state, plain_state)
        assert all(torch.equal(part, want.to(part.dtype)) for part, want in zip(parts, expected, strict=True))
    with pytest.raises(ValueError, match="three positive widths"):
        causal_conv1d(x, weight, conv_state, *args, split=(20, 20, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_window_gather_is_index_select_where_a_source_exists(dtype: torch.dtype) -> None:
    """gather_windows copies slot state_src[r] bit for bit, from a strided state too (a view of wider slots),
    across several gather blocks; rows without a source (-1) are left as they were (never read)."""
    gen = torch.Generator().manual_seed(12)
    conv_state = randn(NUM_SLOTS, 50, 5, dtype=dtype, gen=gen)[:, 3:43, :3]  # [slots, C=40, K-1=3], strided
    src = i64([7, -1, 0, 23, 7, -1])
    with poisoned_empty():
        init = causal_conv1d_module.gather_windows(conv_state, src, block=32)
    has_src = src >= 0
    assert torch.equal(init[has_src], index_select_gather(conv_state, src)[has_src])
    assert init[~has_src].isnan().all()


@torch.no_grad()
def test_gdn_kernels_reproduce_gated_deltanet_layer() -> None:
    """The layer's CUDA path (``_forward_kernels``) gives its reference forward's output and states (float64)."""
    gen = torch.Generator().manual_seed(7)
    layer = GatedDeltaNet(24, 2, 4, 12, 10, 4, 1e-6, "silu").to(device=DEVICE, dtype=torch.float64)
    for param in layer.parameters():
        param.copy_(randn(*param.shape, dtype=torch.float64, gen=gen) * param.shape[-1] ** -0.5)
    layer.conv_state = randn(NUM_SLOTS, layer.conv_dim, 3, dtype=torch.float64, gen=gen)
    layer.ssm_state = randn(NUM_SLOTS, 4, 12, 10, dtype=torch.float64, gen=gen) * 0.3
    states = layer.conv_state.clone(), layer.ssm_state.clone()
    batch = state_batch(GDN_ROWS)
    x = randn(batch["query_start_loc"][-1].item() + NUM_PAD_TOKENS, 24, dtype=torch.float64, gen=gen)
    ctx = make_context(batch, x.shape[0])
    with set_forward_context(ctx):
        expected = layer(x)
    expected_states = layer.conv_state, layer.ssm_state
    layer.conv_state, layer.ssm_state = states
    assert_near(layer._forward_kernels(x, ctx), expected, torch.float64)
    assert torch.equal(layer.conv_state, expected_states[0])
    assert_near(layer.ssm_state, expected_states[1], torch.float64)


# ------------------------------------------------------------------------- GPU: Qwen3.5-0.8B sizes, compiled
@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [*GPU_DTYPES, torch.float16])  # fp16: the fused gates' bits in the models' dtypes
def test_gpu_gdn_kernels_at_qwen3_5_size(dtype: torch.dtype) -> None:
    rows = [(1, 2, 0, 0), (4, 4, 4, 0), (64, -1, 8, 63), (3, 13, -1, 0), (33, 17, 16, 32), (0, 21, 20, -1)]
    check_gdn_recurrent(dtype, rows, hk=16, hv=16, dk=128, dv=128, l2norm=True, tol_scale=GPU_TOL_SCALE)
    check_fused_gates(dtype, rows, hk=16, hv=16, dk=128, dv=128, tol_scale=GPU_TOL_SCALE)
    check_causal_conv1d(dtype, rows, channels=6144, kernel=4, block_c=128, tol_scale=GPU_TOL_SCALE)
