"""Triton kernels (src/truespec/kernels) against their torch references, which reuse the layers' own code.

Batches are ragged on purpose: plain decodes, 1+k verifies, prefill chunks continuing a cached prefix,
fresh prefills, an empty query, trailing padding tokens (slot -1) and an inert row (state_dst -1), with
random (never zero) inputs, caches and states. Without CUDA the kernels run in Triton's interpreter
(numpy executes every program on CPU tensors), so shapes are tiny; ``@pytest.mark.gpu`` tests rerun them
compiled at Qwen3.5-0.8B sizes.
"""

import contextlib
import importlib
import os
from collections.abc import Iterator
from unittest import mock

import pytest
import torch

if not torch.cuda.is_available():
    # There is no compiled backend without a GPU, so run the interpreter. ``@triton.jit`` picks compiled vs
    # interpreted when a kernel is *defined*: the switch must be on before truespec.kernels is first imported.
    # Triton itself may be imported earlier (conftest imports transformers, which imports it); the kernels
    # avoid triton's own @jit library functions (tl.sum, ...), which would then be compiled-mode objects.
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

from truespec.forward_context import ForwardContext, set_forward_context  # noqa: E402
from truespec.kernels import (  # noqa: E402
    GateInputs,
    causal_conv1d,
    causal_conv1d_ref,
    gdn_gating,
    gdn_recurrent,
    gdn_recurrent_ref,
    paged_attention,
    paged_attention_ref,
    reshape_and_cache,
    reshape_and_cache_ref,
    rms_norm,
    rms_norm_ref,
)
from truespec.kernels.paged_attention import _paged_attention_kernel  # noqa: E402
from truespec.layers.attention import PagedAttention  # noqa: E402
from truespec.layers.gdn import GatedDeltaNet  # noqa: E402
from truespec.layers.precision import compute_dtype  # noqa: E402

# the module, not the function the package re-exports under the same name
causal_conv1d_module = importlib.import_module("truespec.kernels.causal_conv1d")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
IS_INTERPRETED = not isinstance(_paged_attention_kernel, triton.runtime.JITFunction)
assert DEVICE.type == "cuda" or IS_INTERPRETED, "truespec.kernels was imported before TRITON_INTERPRET was set"
DTYPES = [torch.float32, torch.float64, torch.bfloat16]
TOL = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# Attention requests (num_cached, query_len): decode, 1+3 verify, prefill chunk on a cached prefix,
# fresh prefill, empty query, first token.
ATTN_REQS = [(9, 1), (5, 4), (6, 7), (0, 5), (4, 0), (0, 1)]
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
NUM_SLOTS, NUM_PAD_TOKENS = 24, 2


def i64(values: list[int] | list[list[int]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


def assert_near(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, tol_scale: float = 1.0) -> None:
    tol = TOL[dtype] * tol_scale
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


def randn(*shape: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device=DEVICE, dtype=dtype)


def paged_batch(
    reqs: list[tuple[int, int]], block_size: int, num_blocks: int, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """Metadata for requests (num_cached, query_len) with blocks handed out in random order, plus
    NUM_PAD_TOKENS padding tokens; ``is_live`` [num_blocks * block_size] marks slots holding a position."""
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables, qsl, seq_lens, slots, live = [], [0], [], [], []
    for cached, new in reqs:
        table = [free.pop() for _ in range(triton.cdiv(cached + new, block_size))]
        positions = [table[p // block_size] * block_size + p % block_size for p in range(cached + new)]
        tables.append(table)
        qsl.append(qsl[-1] + new)
        seq_lens.append(cached + new)
        slots += positions[cached:]
        live += positions
    width = max(len(t) for t in tables) + 1
    is_live = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    is_live[live] = True
    return dict(
        query_start_loc=i64(qsl),
        seq_lens=i64(seq_lens),
        slot_mapping=i64(slots + [-1] * NUM_PAD_TOKENS),
        block_tables=i64([t + [-1] * (width - len(t)) for t in tables]),
        is_live=is_live,
    )


def state_batch(rows: list[tuple[int, int, int, int]]) -> dict[str, torch.Tensor]:
    qsl = [0]
    for query_len, *_ in rows:
        qsl.append(qsl[-1] + query_len)
    src, dst, write_start = ([row[i] for row in rows] for i in (1, 2, 3))
    return dict(query_start_loc=i64(qsl), state_src=i64(src), state_dst=i64(dst), state_write_start=i64(write_start))


def written_slots(rows: list[tuple[int, int, int, int]]) -> list[int]:
    return [dst + t - ws for n, _, dst, ws in rows if dst >= 0 for t in range(max(ws, 0), n)]


@contextlib.contextmanager
def poisoned_empty() -> Iterator[None]:
    """Fresh float tensors from torch.empty / empty_like hold NaNs, as reused memory may: a kernel that leaves
    some of its output unwritten, or reads a buffer's unwritten rows, shows it."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    with (
        mock.patch.object(torch, "empty", lambda *a, **kw: poison(empty(*a, **kw))),
        mock.patch.object(torch, "empty_like", lambda *a, **kw: poison(empty_like(*a, **kw))),
    ):
        yield


def assert_padding_zero(out: torch.Tensor) -> None:
    """Rows owned by no request are zeros, and no NaN of a poisoned allocation survives anywhere."""
    assert torch.equal(out[-NUM_PAD_TOKENS:], torch.zeros_like(out[-NUM_PAD_TOKENS:]))
    assert not out.isnan().any()


# --------------------------------------------------------------------------------------------- attention
@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_writes_only_real_slots(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    batch = paged_batch(ATTN_REQS, block_size=4, num_blocks=16, gen=gen)
    num_tokens = batch["slot_mapping"].shape[0]
    kv = randn(num_tokens, 2, 2, 24, dtype=dtype, gen=gen)  # k and v as strided views, like a qkv split
    cache = randn(2, 16, 4, 2, 24, dtype=dtype, gen=gen)
    expected = cache.clone()
    reshape_and_cache(kv[:, 0], kv[:, 1], cache, batch["slot_mapping"])
    reshape_and_cache_ref(kv[:, 0], kv[:, 1], expected, batch["slot_mapping"])
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(6, 2, 24), (4, 4, 16)])
def test_paged_attention_matches_reference_on_ragged_batch(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    gen = torch.Generator().manual_seed(1)
    batch = paged_batch(ATTN_REQS, block_size=4, num_blocks=24, gen=gen)
    cache = randn(2, 24, 4, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    cache.view(2, -1, num_kv_heads, head_dim)[:, ~batch["is_live"]] = float("nan")  # never read
    q = randn(batch["slot_mapping"].shape[0], num_heads, head_dim, dtype=dtype, gen=gen)
    args = (q, cache, batch["query_start_loc"], batch["seq_lens"], batch["block_tables"], head_dim**-0.5)
    out = paged_attention(*args, block_n=16)
    assert_near(out, paged_attention_ref(*args), dtype)
    assert torch.equal(out[-NUM_PAD_TOKENS:], torch.zeros_like(out[-NUM_PAD_TOKENS:]))


def check_rows_same_in_decode_verify_and_prefill(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, context: int, k: int
) -> None:
    """Rows at positions context-1-k .. context-1 of one sequence, computed as k+1 separate decodes, as one
    1+k verify, and inside a prefill chunk (each batch also holding an unrelated request), must be equal."""
    gen = torch.Generator().manual_seed(2)
    num_blocks = 2 * triton.cdiv(context, block_size) + 2
    blocks = torch.randperm(num_blocks, generator=gen).tolist()
    table = blocks[: triton.cdiv(context, block_size)]
    other = blocks[-2:]  # an unrelated request of 2 * block_size tokens
    width = len(table)
    cache = randn(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    rows = randn(k + 1, num_heads, head_dim, dtype=dtype, gen=gen)
    first = context - 1 - k

    def run(reqs: list[tuple[list[int], int, int]], q_other: int, q_rows: torch.Tensor) -> torch.Tensor:
        """reqs: (block table, seq_len, query_len); the first request is the unrelated one."""
        qsl = [0]
        for _, _, query_len in reqs:
            qsl.append(qsl[-1] + query_len)
        tables = i64([t + [-1] * (width - len(t)) for t, _, _ in reqs])
        q = torch.cat([randn(q_other, num_heads, head_dim, dtype=dtype, gen=gen), q_rows])
        out = paged_attention(q, cache, i64(qsl), i64([s for _, s, _ in reqs]), tables, head_dim**-0.5)
        return out[-(k + 1) :]

    decodes = run([(other, 2 * block_size, 2)] + [(table, first + i + 1, 1) for i in range(k + 1)], 2, rows)
    verify = run([(other, 2 * block_size, 1), (table, context, k + 1)], 1, rows)
    prefill_q = torch.cat([randn(2, num_heads, head_dim, dtype=dtype, gen=gen), rows])
    prefill = run([(other, block_size, 1), (table, context, k + 3)], 1, prefill_q)
    assert torch.equal(decodes, verify)
    assert torch.equal(decodes, prefill)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_row_is_bitwise_same_in_decode_verify_and_prefill(dtype: torch.dtype) -> None:
    check_rows_same_in_decode_verify_and_prefill(dtype, 4, 2, 24, block_size=4, context=11, k=3)


def test_attention_kernels_reproduce_paged_attention_layer() -> None:
    """The wiring recipe: reshape_and_cache + paged_attention == PagedAttention.forward (float64)."""
    gen = torch.Generator().manual_seed(3)
    batch = paged_batch(ATTN_REQS, block_size=4, num_blocks=24, gen=gen)
    layer = PagedAttention(6, 2, 24, scale=24**-0.5)
    layer.kv_cache = randn(2, 24, 4, 2, 24, dtype=torch.float64, gen=gen)
    cache = layer.kv_cache.clone()
    num_tokens = batch["slot_mapping"].shape[0]
    q, k, v = randn(num_tokens, 10, 24, dtype=torch.float64, gen=gen).split([6, 2, 2], dim=1)
    with set_forward_context(make_context(batch, num_tokens)):
        expected = layer(q, k, v)
    reshape_and_cache(k, v, cache, batch["slot_mapping"])
    out = paged_attention(q, cache, batch["query_start_loc"], batch["seq_lens"], batch["block_tables"], 24**-0.5)
    assert_near(out, expected, torch.float64)
    assert torch.equal(cache, layer.kv_cache)


def make_context(batch: dict[str, torch.Tensor], num_tokens: int) -> ForwardContext:
    num_reqs = batch["query_start_loc"].shape[0] - 1
    none = torch.full((num_reqs,), -1, dtype=torch.int64, device=DEVICE)
    return ForwardContext(
        query_start_loc=batch["query_start_loc"],
        seq_lens=batch.get("seq_lens", none),
        slot_mapping=batch.get("slot_mapping", torch.full((num_tokens,), -1, device=DEVICE)),
        block_tables=batch.get("block_tables", none[:, None]),
        state_src=batch.get("state_src", none),
        state_dst=batch.get("state_dst", none),
        state_write_start=batch.get("state_write_start", none),
        logits_indices=torch.arange(num_tokens, device=DEVICE),
        query_start_loc_cpu=batch["query_start_loc"].tolist(),
        seq_lens_cpu=batch.get("seq_lens", none).tolist(),
    )


# ------------------------------------------------------------------------------------------- gated deltanet
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
    dtype: torch.dtype, rows: list, channels: int, kernel: int, block_c: int, tol_scale: float = 1.0
) -> None:
    """Against the reference, and bit for bit against the same kernel fed by torch's index_select gather (the
    gather kernel it replaced). Windows of requests without a source stay unwritten (NaN here): never read."""
    gen = torch.Generator().manual_seed(5)
    batch = state_batch(rows)
    num_tokens = batch["query_start_loc"][-1].item() + NUM_PAD_TOKENS
    x = randn(num_tokens, channels + 3, dtype=dtype, gen=gen)[:, :channels]  # strided rows
    weight = randn(channels, 1, kernel, dtype=dtype, gen=gen)
    conv_state = randn(NUM_SLOTS, channels, kernel - 1, dtype=dtype, gen=gen)
    expected_state, index_select_state = conv_state.clone(), conv_state.clone()
    args = (batch["query_start_loc"], batch["state_src"], batch["state_dst"], batch["state_write_start"])
    with poisoned_empty():
        out = causal_conv1d(x, weight, conv_state, *args, block_c=block_c)
    assert_near(out, causal_conv1d_ref(x, weight, expected_state, *args), dtype, tol_scale)
    assert torch.equal(conv_state, expected_state)  # windows are copies of inputs: exact
    assert_padding_zero(out)
    with mock.patch.object(causal_conv1d_module, "gather_windows", index_select_gather):
        assert torch.equal(out, causal_conv1d(x, weight, index_select_state, *args, block_c=block_c))
    assert torch.equal(conv_state, index_select_state)


def index_select_gather(conv_state: torch.Tensor, state_src: torch.Tensor) -> torch.Tensor:
    """The gather causal_conv1d ran before gather_windows (two launches: clamp, index_select)."""
    return conv_state.index_select(0, state_src.clamp(min=0)).contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
@GDN_ROW_SETS
def test_causal_conv1d_keeps_window_after_each_kept_position(dtype: torch.dtype, rows: list) -> None:
    check_causal_conv1d(dtype, rows, channels=40, kernel=4, block_c=16)


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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", ["plain", "unit_offset", "gated", "gated_strided"])
def test_rms_norm_matches_reference(dtype: torch.dtype, form: str) -> None:
    gen = torch.Generator().manual_seed(6)
    x = randn(5, 3, 20, dtype=dtype, gen=gen)
    gate = randn(5, 3, 20, dtype=dtype, gen=gen) if form == "gated" else None
    if form == "gated_strided":  # heads sliced out of a wider projection output, read in place
        gate = randn(5, 7 + 3 * 20, dtype=dtype, gen=gen)[:, 7:].unflatten(-1, (3, 20))
    weight = 1 + 0.2 * randn(20, dtype=dtype, gen=gen)
    args = (x, weight, 1e-6, form == "unit_offset", gate)
    assert_near(rms_norm(*args), rms_norm_ref(*args), dtype)


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
GPU_DTYPES = [torch.bfloat16, torch.float32]
GPU_TOL_SCALE = 5.0  # compiled tl.exp / sqrt are approximate in fp32; long recurrences accumulate it


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_paged_attention_at_qwen3_5_size(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(10)
    reqs = [(1000, 1), (2043, 5), (300, 64), (0, 128), (57, 0), (4095, 1), (16, 1)]
    batch = paged_batch(reqs, block_size=16, num_blocks=600, gen=gen)
    cache = randn(2, 600, 16, 2, 256, dtype=dtype, gen=gen)
    qkv = randn(batch["slot_mapping"].shape[0], 12, 256, dtype=dtype, gen=gen)
    q, k, v = qkv.split([8, 2, 2], dim=1)
    expected_cache = cache.clone()
    reshape_and_cache(k, v, cache, batch["slot_mapping"])
    reshape_and_cache_ref(k, v, expected_cache, batch["slot_mapping"])
    assert torch.equal(cache, expected_cache)
    args = (q, cache, batch["query_start_loc"], batch["seq_lens"], batch["block_tables"], 256**-0.5)
    assert_near(paged_attention(*args), paged_attention_ref(*args), dtype, GPU_TOL_SCALE)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_attention_row_invariance_at_qwen3_5_size(dtype: torch.dtype) -> None:
    check_rows_same_in_decode_verify_and_prefill(dtype, 8, 2, 256, block_size=16, context=3001, k=5)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_gdn_kernels_at_qwen3_5_size(dtype: torch.dtype) -> None:
    rows = [(1, 2, 0, 0), (4, 4, 4, 0), (64, -1, 8, 63), (3, 13, -1, 0), (33, 17, 16, 32), (0, 21, 20, -1)]
    check_gdn_recurrent(dtype, rows, hk=16, hv=16, dk=128, dv=128, l2norm=True, tol_scale=GPU_TOL_SCALE)
    check_fused_gates(dtype, rows, hk=16, hv=16, dk=128, dv=128, tol_scale=GPU_TOL_SCALE)
    check_causal_conv1d(dtype, rows, channels=6144, kernel=4, block_c=128, tol_scale=GPU_TOL_SCALE)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_rms_norms_at_qwen3_5_size(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    core, gate = randn(37, 16, 128, dtype=dtype, gen=gen), randn(37, 16, 128, dtype=dtype, gen=gen)
    hidden = randn(37, 1024, dtype=dtype, gen=gen)
    for x, z, unit_offset in [(core, gate, False), (hidden, None, True), (hidden, None, False)]:
        weight = 1 + 0.2 * randn(x.shape[-1], dtype=dtype, gen=gen)
        args = (x, weight, 1e-6, unit_offset, z)
        assert_near(rms_norm(*args), rms_norm_ref(*args), dtype, GPU_TOL_SCALE)
