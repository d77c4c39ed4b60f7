"""The CPU path's batched ops (ops/attention_batched.py, ops/gdn_batched.py) against the request-by-request torch
references, and a row's bits alone and inside bigger batches (docs/ARCHITECTURE.md invariant 4)."""

import dataclasses

import pytest
import torch

from helpers.attention_rows import attention_batch, model_cache, packed_batch, packed_cache, rows_alone_and_in_batches
from helpers.kernels import assert_near
from truespec.kv_cache.formats import kv_format
from truespec.ops.attention import paged_attention_ref
from truespec.ops.attention_batched import TILE, paged_attention_batched
from truespec.ops.conv import causal_conv1d_ref
from truespec.ops.gdn import gdn_recurrent_ref
from truespec.ops.gdn_batched import StepRows, causal_conv1d_batched, gdn_recurrent_batched
from truespec.ops.state_slots import StateSlots

RAGGED = [(0, 7), (37, 1), (0, 1), (150, 4), (9, 20), (300, 1), (5, 3)]  # (num_cached, query_len)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_batched_attention_matches_reference_on_ragged_batch(dtype: torch.dtype) -> None:
    args = attention_batch(RAGGED, num_heads=4, num_kv_heads=2, head_dim=16, dtype=dtype, seed=3)
    out = paged_attention_batched(*args)
    assert_near(out, paged_attention_ref(*args), dtype)
    assert torch.equal(out[-2:], torch.zeros_like(out[-2:]))  # padding rows


def test_batched_attention_matches_reference_over_packed_cache() -> None:
    fmt = kv_format("turboquant_k8v4")
    q, cache, qsl, lens, tables, scale = packed_batch(fmt, RAGGED, 4, 2, 16, 4, torch.float32, seed=5)
    decode = lambda slots: fmt.decode(slots, head_dim=16, dtype=torch.float32)  # noqa: E731
    args = (q, cache, qsl, lens, tables, scale)
    assert_near(paged_attention_batched(*args, decode=decode), paged_attention_ref(*args, decode=decode), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("context", [20, TILE + 3, 2 * TILE])
@pytest.mark.parametrize("heads", [(4, 2), (3, 1)], ids=["group2", "group3"])  # group 3: odd rows, padded pairs
def test_batched_attention_row_is_bitwise_same_alone_and_in_batches(dtype: torch.dtype, context: int,
                                                                    heads: tuple[int, int]) -> None:  # fmt: skip
    alone, *batched = rows_alone_and_in_batches(paged_attention_batched, model_cache(dtype, 4), *heads, 16, 4,
                                                context, 3, dtype, row_bytes=0)  # fmt: skip
    for out in batched:
        assert torch.equal(alone, out)


def test_batched_attention_matches_reference_with_an_odd_query_group() -> None:
    args = attention_batch(RAGGED, num_heads=3, num_kv_heads=1, head_dim=16, dtype=torch.float64, seed=4)
    assert_near(paged_attention_batched(*args), paged_attention_ref(*args), torch.float64)


def test_batched_attention_row_is_bitwise_same_alone_and_in_batches_packed() -> None:
    fmt = kv_format("turboquant_4bit_nc")

    def attend(q: torch.Tensor, cache: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        decode = lambda slots: fmt.decode(slots, head_dim=16, dtype=q.dtype)  # noqa: E731
        return paged_attention_batched(q, cache, *args, decode=decode)

    alone, *batched = rows_alone_and_in_batches(attend, packed_cache(fmt, 4), 4, 2, 16, 4, 40, 3, torch.float32,
                                                row_bytes=0)  # fmt: skip
    for out in batched:
        assert torch.equal(alone, out)


# ---- GDN: conv and recurrence ---------------------------------------------------------------------
# (query_len, state_src, state_dst, state_write_start): a prefill from zeros, decodes, verifies that keep every
# position (one restarting inside its own group), a padding request, a chunk that keeps its last state
GDN_ROWS = [(6, -1, 0, 5), (1, 4, 4, 0), (4, 9, 8, 0), (1, 2, 12, 0), (0, -1, -1, 0), (3, 17, 16, 0), (9, 21, 20, 8)]


def gdn_case(rows: list[tuple[int, int, int, int]], dtype: torch.dtype, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    num_tokens, num_slots = sum(r[0] for r in rows), 24
    qsl = [0]
    for n, *_ in rows:
        qsl.append(qsl[-1] + n)
    meta = tuple(torch.tensor(x) for x in (qsl, [r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows]))
    pad = 2  # token rows no request owns
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    return dict(
        x=torch.randn(num_tokens + pad, 12, generator=gen, dtype=torch.float64).to(dtype),
        weight=torch.randn(12, 4, generator=gen, dtype=torch.float64).to(dtype),
        conv_state=torch.randn(num_slots, 12, 3, generator=gen, dtype=torch.float64).to(dtype),
        q=torch.randn(num_tokens + pad, 2, 8, generator=gen, dtype=torch.float64).to(dtype),
        k=torch.randn(num_tokens + pad, 2, 8, generator=gen, dtype=torch.float64).to(dtype),
        v=torch.randn(num_tokens + pad, 4, 6, generator=gen, dtype=torch.float64).to(dtype),
        g=-torch.rand(num_tokens + pad, 4, generator=gen, dtype=torch.float64).to(cdt),
        beta=torch.rand(num_tokens + pad, 4, generator=gen, dtype=torch.float64).to(cdt),
        ssm_state=torch.randn(num_slots, 4, 8, 6, generator=gen, dtype=torch.float64).to(cdt),
        meta=meta,
    )


def run_batched(case: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    conv_state, ssm_state = case["conv_state"].clone(), case["ssm_state"].clone()
    slots = StateSlots.from_tensors(*case["meta"])
    rows = StepRows.of(slots, 4)
    conv = causal_conv1d_batched(case["x"], case["weight"], conv_state, slots, rows)
    core = gdn_recurrent_batched(case["q"], case["k"], case["v"], case["g"], case["beta"], ssm_state, rows)
    return conv, conv_state, core, ssm_state


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_batched_gdn_matches_reference(dtype: torch.dtype) -> None:
    case = gdn_case(GDN_ROWS, dtype)
    conv, conv_state, core, ssm_state = run_batched(case)
    ref_conv_state, ref_ssm_state = case["conv_state"].clone(), case["ssm_state"].clone()
    ref_conv = causal_conv1d_ref(case["x"], case["weight"], ref_conv_state, *case["meta"])
    ref_core = gdn_recurrent_ref(case["q"], case["k"], case["v"], case["g"], case["beta"], ref_ssm_state, *case["meta"])
    assert_near(conv, ref_conv, dtype)
    assert torch.equal(conv_state, ref_conv_state)  # windows are copies of inputs
    assert_near(core, ref_core, dtype)
    assert_near(ssm_state, ref_ssm_state, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_batched_gdn_request_is_bitwise_same_alone_and_in_batch(dtype: torch.dtype) -> None:
    case = gdn_case(GDN_ROWS, dtype)
    conv, conv_state, core, ssm_state = run_batched(case)
    qsl = case["meta"][0].tolist()
    for r, (n, src, dst, write_start) in enumerate(GDN_ROWS):
        if n == 0:
            continue
        rows = slice(qsl[r], qsl[r] + n)
        alone = {key: case[key] for key in ("weight", "conv_state", "ssm_state")}
        alone.update({key: case[key][rows] for key in ("x", "q", "k", "v", "g", "beta")})
        alone["meta"] = tuple(torch.tensor(x) for x in ([0, n], [src], [dst], [write_start]))
        a_conv, a_conv_state, a_core, a_ssm_state = run_batched(alone)
        assert torch.equal(a_conv, conv[rows]) and torch.equal(a_core, core[rows])
        kept = [s for s in range(dst, dst + n - write_start)] if dst >= 0 else []
        assert torch.equal(a_conv_state[kept], conv_state[kept]) and torch.equal(a_ssm_state[kept], ssm_state[kept])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_batched_gdn_decode_in_own_slots_updates_them_in_place_bitwise(dtype: torch.dtype) -> None:
    # a plain decode batch whose requests keep their state in their own consecutive source slots: the recurrence runs
    # on those slots where they are (StepRows.in_place), bitwise the gathered copy's result, and near the reference
    case = gdn_case([(1, s, s, 0) for s in range(5, 9)], dtype)
    rows = StepRows.of(StateSlots.from_tensors(*case["meta"]), 4)
    assert rows.in_place == slice(5, 9)
    results = []
    for step_rows in (rows, dataclasses.replace(rows, in_place=None)):
        ssm_state = case["ssm_state"].clone()
        core = gdn_recurrent_batched(case["q"], case["k"], case["v"], case["g"], case["beta"], ssm_state, step_rows)
        results.append((core, ssm_state))
    (core, ssm_state), (copied_core, copied_state) = results
    assert torch.equal(core, copied_core) and torch.equal(ssm_state, copied_state)
    ref_state = case["ssm_state"].clone()
    ref_core = gdn_recurrent_ref(case["q"], case["k"], case["v"], case["g"], case["beta"], ref_state, *case["meta"])
    assert_near(core, ref_core, dtype)
    assert_near(ssm_state, ref_state, dtype)


def test_batched_gdn_in_place_only_for_own_consecutive_slots() -> None:
    def in_place(rows: list[tuple[int, int, int, int]]) -> slice | None:
        return StepRows.of(StateSlots.from_tensors(*gdn_case(rows, torch.float32)["meta"]), 4).in_place

    assert in_place([(1, 3, 3, 0), (1, 4, 4, 0)]) == slice(3, 5)
    assert in_place([(1, 4, 4, 0), (1, 3, 3, 0)]) is None  # not ascending
    assert in_place([(1, 3, 3, 0), (1, 5, 5, 0)]) is None  # a gap
    assert in_place([(1, 3, 4, 0), (1, 4, 5, 0)]) is None  # kept elsewhere (a verify group's next slot)
    assert in_place([(2, 3, 3, 0), (1, 5, 5, 0)]) is None  # more than one token
    assert in_place([(1, -1, 3, 0)]) is None  # from zeros


def test_batched_gdn_index_tensors_on_the_device_asked() -> None:
    # the torch reference layers also run on CUDA (TRUESPEC_BACKEND=torch, tests/test_gpu_engine.py): a step's index
    # tensors are built on the host and must land on the state's device ("meta" stands in for CUDA here)
    rows = StepRows.of(StateSlots.from_tensors(*gdn_case(GDN_ROWS, torch.float32)["meta"]), 4, torch.device("meta"))
    kept = [t for pair in rows.kept if pair is not None for t in pair if isinstance(t, torch.Tensor)]
    tensors = [rows.time_major, rows.taps, *rows.kept_windows, *kept]
    assert kept and all(t.device.type == "meta" for t in tensors)
    assert rows.in_place == StepRows.of(StateSlots.from_tensors(*gdn_case(GDN_ROWS, torch.float32)["meta"]), 4).in_place


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("input_act", [None, "silu"])
def test_cpu_projection_row_is_bitwise_same_alone_and_in_batches(dtype: torch.dtype, input_act: str | None) -> None:
    """A projection row (a decode row alone, or among the 1 + k rows of a verify, or a batch) on the CPU: the same
    bits at every row count (invariant 4). The CPU BLAS rounds 1, 2-3 and 4+ rows differently on some CPUs (an AMD
    EPYC, session 17); ``linear`` pads fewer than 4 rows, so this test fails there without it."""
    from truespec.layers.linear import linear

    gen = torch.Generator().manual_seed(5)
    for in_features, out_features in [(256, 776), (64, 48), (1024, 300)]:
        width = in_features * (2 if input_act else 1)
        weight = torch.randn(out_features, in_features, generator=gen, dtype=dtype)
        bias = torch.randn(out_features, generator=gen, dtype=dtype)
        x = torch.randn(70, width, generator=gen, dtype=dtype)
        full = linear(x, weight, bias, input_act=input_act)
        for num_rows in [1, 2, 3, 4, 5, 9, 17, 64]:
            for start in (0, 70 - num_rows):
                rows = linear(x[start:start + num_rows], weight, bias, input_act=input_act)
                assert torch.equal(rows, full[start:start + num_rows]), (in_features, num_rows, start)
