"""Triton kernels (src/truespec/kernels) against their torch references, which reuse the layers' own code.

Batches are ragged on purpose: plain decodes, 1+k verifies, prefill chunks continuing a cached prefix,
fresh prefills, an empty query, trailing padding tokens (slot -1) and an inert row (state_dst -1), with
random (never zero) inputs, caches and states. Without CUDA the kernels run in Triton's interpreter
(numpy executes every program on CPU tensors), so shapes are tiny; ``@pytest.mark.gpu`` tests rerun them
compiled at Qwen3.5-0.8B sizes.
"""

import os

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
    causal_conv1d,
    causal_conv1d_ref,
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

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
IS_INTERPRETED = not isinstance(_paged_attention_kernel, triton.runtime.JITFunction)
assert DEVICE.type == "cuda" or IS_INTERPRETED, "truespec.kernels was imported before TRITON_INTERPRET was set"
DTYPES = [torch.float32, torch.float64, torch.bfloat16]
TOL = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 3e-2}
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# Attention requests (num_cached, query_len): decode, 1+3 verify, prefill chunk on a cached prefix,
# fresh prefill, empty query, first token.
ATTN_REQS = [(9, 1), (5, 4), (6, 7), (0, 5), (4, 0), (0, 1)]
# GDN rows (query_len, state_src, state_dst, state_write_start) over groups of 4 slots: decode from a slot of
# its own group; verify whose source is its first destination slot (read before overwritten); empty query;
# fresh prefill keeping its last state; inert row; prefill chunk continuing a state.
GDN_ROWS = [(1, 2, 0, 0), (4, 4, 4, 0), (0, 9, 8, -1), (6, -1, 12, 5), (3, 17, -1, 0), (2, 21, 20, 1)]
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
def check_gdn_recurrent(
    dtype: torch.dtype, rows: list, hk: int, hv: int, dk: int, dv: int, l2norm: bool, tol_scale: float = 1.0
) -> None:
    gen = torch.Generator().manual_seed(4)
    batch = state_batch(rows)
    num_tokens, cdt = batch["query_start_loc"][-1].item() + NUM_PAD_TOKENS, compute_dtype(dtype)
    qkv = randn(num_tokens, 2 * hk * dk + hv * dv, dtype=dtype, gen=gen)  # q, k, v: strided views, as in the layer
    q, k, v = qkv.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.unflatten(-1, (hk, dk)), k.unflatten(-1, (hk, dk)), v.unflatten(-1, (hv, dv))
    if not l2norm:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    g = -F.softplus(randn(num_tokens, hv, dtype=cdt, gen=gen))  # log decay < 0
    beta = randn(num_tokens, hv, dtype=cdt, gen=gen).sigmoid()
    state = randn(NUM_SLOTS, hv, dk, dv, dtype=cdt, gen=gen) * 0.3
    expected_state = state.clone()
    args = (batch["query_start_loc"], batch["state_src"], batch["state_dst"], batch["state_write_start"])
    out = gdn_recurrent(q, k, v, g, beta, state, *args, use_qk_l2norm=l2norm)
    expected = gdn_recurrent_ref(q, k, v, g, beta, expected_state, *args, use_qk_l2norm=l2norm)
    assert_near(out, expected, dtype, tol_scale)
    assert_near(state, expected_state, cdt, tol_scale)
    kept = set(written_slots(rows))
    untouched = [s for s in range(NUM_SLOTS) if s not in kept]
    assert torch.equal(state[untouched], expected_state[untouched])
    assert torch.equal(out[-NUM_PAD_TOKENS:], torch.zeros_like(out[-NUM_PAD_TOKENS:]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gdn_recurrent_keeps_state_after_each_kept_position(dtype: torch.dtype) -> None:
    check_gdn_recurrent(dtype, GDN_ROWS, hk=2, hv=4, dk=12, dv=40, l2norm=True)


def test_gdn_recurrent_without_fused_l2norm() -> None:
    check_gdn_recurrent(torch.float64, GDN_ROWS, hk=2, hv=2, dk=8, dv=6, l2norm=False)


def check_causal_conv1d(
    dtype: torch.dtype, rows: list, channels: int, kernel: int, block_c: int, tol_scale: float = 1.0
) -> None:
    gen = torch.Generator().manual_seed(5)
    batch = state_batch(rows)
    num_tokens = batch["query_start_loc"][-1].item() + NUM_PAD_TOKENS
    x = randn(num_tokens, channels + 3, dtype=dtype, gen=gen)[:, :channels]  # strided rows
    weight = randn(channels, 1, kernel, dtype=dtype, gen=gen)
    conv_state = randn(NUM_SLOTS, channels, kernel - 1, dtype=dtype, gen=gen)
    expected_state = conv_state.clone()
    args = (batch["query_start_loc"], batch["state_src"], batch["state_dst"], batch["state_write_start"])
    out = causal_conv1d(x, weight, conv_state, *args, block_c=block_c)
    assert_near(out, causal_conv1d_ref(x, weight, expected_state, *args), dtype, tol_scale)
    assert torch.equal(conv_state, expected_state)  # windows are copies of inputs: exact
    assert torch.equal(out[-NUM_PAD_TOKENS:], torch.zeros_like(out[-NUM_PAD_TOKENS:]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_conv1d_keeps_window_after_each_kept_position(dtype: torch.dtype) -> None:
    check_causal_conv1d(dtype, GDN_ROWS, channels=40, kernel=4, block_c=16)


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
