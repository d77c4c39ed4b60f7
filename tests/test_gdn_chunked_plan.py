"""kernels/gdn_chunked_plan.py: which requests of a step take fla's chunk kernel (``split_requests``: by length, or
by a GdnPrefillRule's flags), and the step's ``ChunkedPlan``, its device tensors built in one copy. Plain Python and
torch on the CPU."""

import os

import pytest
import torch

if not torch.cuda.is_available():  # the kernels package is imported with the plan: see tests/helpers/kernels.py
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from truespec.kernels import gdn_chunked_plan as plan_mod  # noqa: E402
from truespec.kernels.gdn_chunked_plan import split_requests  # noqa: E402
from truespec.ops.state_slots import StateSlots  # noqa: E402


def test_only_long_queries_keeping_just_their_final_state_go_to_the_chunk_kernel() -> None:
    # (query_len, state_dst, state_write_start) -> chunk kernel?
    cases = [
        ((1, 0, 0), False),  # decode
        ((4, 4, 0), False),  # 1+3 verify keeps a state per position
        ((64, 8, 63), True),  # prefill chunk exactly at the threshold
        ((63, 12, 62), False),  # one token short
        ((700, -1, 699), True),  # inert row: no state kept at all
        ((100, 16, 0), False),  # long, but keeps every position's state
        ((100, 20, 98), False),  # keeps its last two states
        ((100, 24, 100), True),  # keeps nothing (write start past the end)
        ((0, 28, -1), None),  # empty query: runs nowhere
    ]
    qsl = [0]
    for (n, _, _), _ in cases:
        qsl.append(qsl[-1] + n)
    split = split_requests(qsl, [c[0][1] for c in cases], [c[0][2] for c in cases], min_chunk_len=64)
    assert split.chunked == [i for i, (_, want) in enumerate(cases) if want is True]
    assert split.recurrent == [i for i, (_, want) in enumerate(cases) if want is False]


def test_the_plan_holds_the_step_metadata_in_one_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ChunkedPlan.of``: every index the chunk kernel's requests need, in one host-to-device copy (the plan's
    tensors are views of it), for steps of one fresh prompt (its rows a slice, zero states, its last state kept),
    prompts that continue and keep nothing, and a mix with token-loop requests between them."""
    copies = []
    real = plan_mod.columns_to_device
    monkeypatch.setattr(plan_mod, "columns_to_device", lambda columns, device: copies.append(columns) or real(columns,
                                                                                                          device))
    def plan(qsl: list[int], src: list[int], dst: list[int], write_start: list[int]) -> plan_mod.ChunkedPlan:
        slots = StateSlots(qsl, src, dst, write_start)
        split = split_requests(qsl, dst, write_start, min_chunk_len=64)
        return plan_mod.ChunkedPlan.of(slots, split, torch.device("cpu"))

    fresh = plan([0, 200], [-1], [3], [199])
    assert fresh.chunked_rows == slice(0, 200) and fresh.recurrent_rows is None and fresh.recurrent_meta is None
    assert fresh.cu_seqlens.tolist() == [0, 200] and fresh.chunk_indices.tolist() == [[0, j] for j in range(4)]
    assert fresh.initial.index is None and fresh.kept.tolist() == [0] and fresh.kept_slots.tolist() == [3]
    both = plan([0, 64, 130], [5, 7], [-1, -1], [0, 0])
    assert both.initial.index.tolist() == [5, 7] and both.initial.is_zero is None and both.kept is None
    assert both.chunk_indices.tolist() == [[0, 0], [1, 0], [1, 1]]
    mixed = plan([0, 100, 101, 301, 303], [-1, 4, 6, 8], [2, 4, 9, 8], [99, 0, 199, 0])
    assert mixed.split.chunked == [0, 2] and mixed.chunked_rows.tolist() == [*range(100), *range(101, 301)]
    assert mixed.recurrent_rows.tolist() == [100, 301, 302]
    assert [t.tolist() for t in mixed.recurrent_meta] == [[0, 1, 3], [4, 8], [4, 8], [0, 0]]
    assert mixed.initial.index.tolist() == [0, 6] and mixed.initial.is_zero.tolist() == [True, False]
    assert mixed.kept.tolist() == [0, 1] and mixed.kept_slots.tolist() == [2, 9]
    assert len(copies) == 3  # one per plan: the tensors are views of it
    for p in (fresh, both, mixed):  # views of one copy, each 16-byte aligned (Triton specialises on it)
        tensors = [t for t in (p.cu_seqlens, p.chunk_indices, p.chunked_flags, p.initial.index, p.initial.is_zero,
                               p.kept, p.kept_slots, p.chunked_rows, p.recurrent_rows, *(p.recurrent_meta or []))
                   if isinstance(t, torch.Tensor)]  # fmt: skip
        assert all(t.data_ptr() % 16 == 0 for t in tensors)
        assert len({t.untyped_storage().data_ptr() for t in tensors if t is not p.initial.is_zero}) == 1


def test_flagged_requests_go_to_the_chunk_kernel_whatever_their_length() -> None:
    """A GdnPrefillRule's flags (core/gdn_prefill_rule.py) replace the length rule: a flagged 1-token chunk goes to
    the chunk kernel, an unflagged 2000-token one to the loop; a flagged query keeping more than its final state
    still takes the loop; without a usable kernel (inf) nothing does."""
    lens, dst, write_start = [1, 2000, 64, 4, 0, 130], [0, 4, -1, 12, 16, 20], [0, 1999, 63, 0, -1, 129]
    flags = [True, False, True, True, True, True]
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    split = split_requests(qsl, dst, write_start, min_chunk_len=64, is_chunked=flags)
    assert split.chunked == [0, 2, 5] and split.recurrent == [1, 3]
    unusable = split_requests(qsl, dst, write_start, min_chunk_len=float("inf"), is_chunked=flags)
    assert unusable.chunked == [] and unusable.recurrent == [0, 1, 2, 3, 5]
