"""The CUDA attention dispatch (kernels/step_attention.py): a query row at a prompt position goes to the prefill
kernel, every other row to the split-KV kernel, both into one output (docs/ARCHITECTURE.md, "Attention rows").

One step mixes every kind of row: a prefill chunk starting mid-block over cached context, a 1-token last prompt
chunk, a plain decode, a 1+3 verify, a request re-prefilling after preemption whose chunk spans prompt and output
positions, a padded (empty) request and padding rows. The step matches the torch reference; its decode / verify /
recomputed-output rows are bitwise the split-KV kernel's (today's path, the whole step and those rows alone:
invariant 4), its prompt rows bitwise the prefill kernel's on just those rows; the sparse-V skip applies to the
split rows only. Without CUDA the kernels run in Triton's interpreter at tiny shapes; ``@pytest.mark.gpu`` reruns
compiled at the Qwen3.5-0.8B attention shape (bf16, 8 q / 2 kv heads of 256), and inside a CUDA graph.
"""

import os
from unittest import mock

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before truespec.kernels is imported: see tests/helpers/kernels.py

triton = pytest.importorskip("triton")

from helpers.attention_rows import attention_batch, packed_batch, packed_reference  # noqa: E402
from helpers.kernels import (  # noqa: E402
    DEVICE,
    GPU_TOL_SCALE,
    assert_near,
    assert_padding_zero,
    gpu,
    i64,
    needs_cuda,
    paged_batch,
    poisoned_empty,
    randn,
)
from truespec.forward_context import set_forward_context  # noqa: E402
from truespec.kernels.paged_attention import (  # noqa: E402
    BLOCK_N,
    MAX_SPLITS,
    MAX_WORKSPACE_BYTES,
    MIN_SPLIT_KEYS,
    NUM_WARPS,
    model_cache_tiles,
    paged_attention,
    split_attention,
)
from truespec.kernels.paged_attention_packed import paged_attention_packed  # noqa: E402
from truespec.kernels.prefill_attention import prefill_attention  # noqa: E402
from truespec.kernels.step_attention import step_attention  # noqa: E402
from truespec.kv_cache.formats import FORMATS  # noqa: E402
from truespec.ops.attention import SparseV, paged_attention_ref, paged_attention_skips_ref  # noqa: E402
from truespec.worker.input_builder import ContextRow, build_step  # noqa: E402

# (num_cached, query_len, prompt_len): a chunk starting mid-block (block size 4 / 8) over cached context, a 1-token
# last prompt chunk, a decode at 98 keys (2 splits), a 1+3 verify, a re-prefill after preemption whose chunk holds
# prompt positions 66..69 and output positions 70..77 (2 splits), a padded empty request.
REQS = [(6, 19, 40), (12, 1, 13), (97, 1, 30), (80, 4, 50), (66, 12, 70), (0, 0, 0)]
# the same kinds at the 0.8B shape (block size 4 / 16): hundreds to thousands of keys
GPU_REQS = [(70, 300, 400), (511, 1, 512), (1500, 1, 300), (800, 4, 700), (600, 150, 700), (0, 0, 0)]


def num_prompt_rows(reqs: list[tuple[int, int, int]]) -> list[int]:
    """clamp(prompt_len - first position, 0, query_len) per request (ScheduledRequest.num_prompt_rows)."""
    return [min(max(prompt_len - cached, 0), query_len) for cached, query_len, prompt_len in reqs]


def step_args(reqs: list[tuple[int, int, int]], name: str | None, dtype: torch.dtype, num_heads: int,
              num_kv_heads: int, head_dim: int, block_size: int, seed: int, peak: float = 0.0) -> tuple:  # fmt: skip
    """(the kernels' arguments up to scale, the packed format or None) for ``reqs`` with NUM_PAD_TOKENS padding."""
    shapes = [(cached, query_len) for cached, query_len, _ in reqs]
    if name is None:
        return attention_batch(shapes, num_heads, num_kv_heads, head_dim, dtype, seed, peak), None
    fmt = FORMATS[name]
    return packed_batch(fmt, shapes, num_heads, num_kv_heads, head_dim, block_size, dtype, seed, peak), fmt


def split_kv(args: tuple, fmt: object, **kwargs: float) -> torch.Tensor:
    """Today's path: the split-KV kernel for every row."""
    if fmt is None:
        return paged_attention(*args, **kwargs)
    return paged_attention_packed(*args, fmt, args[0].shape[-1], **kwargs)


def check_rows_keep_their_kernels_bits(reqs: list[tuple[int, int, int]], args: tuple, fmt: object,
                                       **sparse_v: float) -> torch.Tensor:  # fmt: skip
    """The dispatch's output for the step; asserts each request's split rows equal the split-KV kernel's for the
    whole step and for those rows alone, and its prompt rows the prefill kernel's for just those rows."""
    q, cache, qsl, seq_lens, tables, scale = args
    prompt_rows = num_prompt_rows(reqs)
    with poisoned_empty():  # a row neither kernel writes stays NaN
        out = step_attention(*args, i64(prompt_rows), fmt=fmt, **sparse_v)
    whole = split_kv(args, fmt, **sparse_v)
    for r, (start, (cached, query_len, _)) in enumerate(zip(qsl.tolist(), reqs, strict=False)):
        k, end = prompt_rows[r], start + query_len
        if k < query_len:  # decode, verify, recomputed output rows: split-KV bits, in the step and alone
            assert torch.equal(out[start + k:end], whole[start + k:end]), r
            alone = split_kv((q[start + k:end], cache, i64([0, query_len - k]), seq_lens[r:r + 1], tables[r:r + 1],
                              scale), fmt, **sparse_v)  # fmt: skip
            assert torch.equal(out[start + k:end], alone), r
        if k:  # prompt rows: the prefill kernel's bits, on just those rows (a chunk ending at the last of them)
            alone = prefill_attention(q[start:start + k], cache, i64([0, k]), i64([cached + k]), tables[r:r + 1],
                                      scale, fmt=fmt)  # fmt: skip
            assert torch.equal(out[start:start + k], alone), r
    assert_padding_zero(out)
    return out


@pytest.mark.parametrize(("name", "dtype"), [(None, torch.float32), ("turboquant_4bit_nc", torch.float32),
                                             ("fp8", torch.bfloat16)])  # fmt: skip
def test_mixed_step_routes_prompt_rows_to_prefill_and_keeps_split_kv_bits(name: str | None,
                                                                          dtype: torch.dtype) -> None:
    args, fmt = step_args(REQS, name, dtype, 4, 2, 16, 8, seed=11)
    out = check_rows_keep_their_kernels_bits(REQS, args, fmt)
    expected = paged_attention_ref(*args) if fmt is None else packed_reference(args, fmt, 16)[0]
    assert_near(out, expected, dtype)


def test_sparse_v_skips_in_split_rows_only() -> None:
    """The skip (split kernel only) keeps the split rows' sparse-V bits; the prompt rows read every value tile."""
    args, _ = step_args(REQS, None, torch.float32, 4, 2, 16, 4, seed=12, peak=6.0)
    sparse = SparseV.of(0.02)
    out = check_rows_keep_their_kernels_bits(REQS, args, None, sparse_v_threshold=sparse.threshold)
    expected, num_skipped = paged_attention_skips_ref(*args, sparse_v=sparse)
    dense = paged_attention_ref(*args)
    split_rows = torch.ones(out.shape[0], dtype=torch.bool, device=DEVICE)
    qsl = args[2].tolist()
    for r, k in enumerate(num_prompt_rows(REQS)):
        split_rows[qsl[r]:qsl[r] + k] = False
    unskipped = paged_attention_ref(*args, sparse_v=SparseV.of(0.0))  # the same order, threshold 0: no skip
    assert num_skipped > 0 and not torch.equal(expected[split_rows], unskipped[split_rows])  # split rows skip tiles
    assert_near(out[split_rows], expected[split_rows], torch.float32)
    assert_near(out[~split_rows], dense[~split_rows], torch.float32)


def test_each_kernel_writes_only_its_rows() -> None:
    """The split kernel and its merge leave the prompt rows untouched, the prefill kernel every other row."""
    args, _ = step_args(REQS, None, torch.float32, 4, 2, 16, 4, seed=13)
    q, cache, qsl, seq_lens, tables, scale = args
    prompt_rows = i64(num_prompt_rows(REQS))
    is_prompt = torch.zeros(q.shape[0], dtype=torch.bool, device=DEVICE)
    for r, k in enumerate(num_prompt_rows(REQS)):
        is_prompt[qsl[r]:qsl[r] + k] = True
    zeros = torch.zeros
    with mock.patch.object(torch, "empty", zeros):  # a merge of the skipped rows' (zero) partials would write zeros
        split = split_attention(q, model_cache_tiles(q, cache), qsl, seq_lens, tables, scale,
                                torch.full_like(q, float("nan")), BLOCK_N, MAX_SPLITS, MIN_SPLIT_KEYS, NUM_WARPS,
                                MAX_WORKSPACE_BYTES, None, num_prompt_rows=prompt_rows)  # fmt: skip
    assert split[is_prompt].isnan().all() and torch.equal(split[~is_prompt], paged_attention(*args)[~is_prompt])
    prefill = prefill_attention(*args, out=torch.full_like(q, float("nan")), num_rows=prompt_rows)
    assert prefill[~is_prompt].isnan().all() and not prefill[is_prompt].isnan().any()


def test_no_prompt_rows_is_the_split_kernel_alone() -> None:
    """num_prompt_rows None (a decode / verify step, as its CUDA graph runs it): no prefill launch, today's bits."""
    reqs = [(c, n, 0) for c, n, _ in REQS]
    args, _ = step_args(reqs, None, torch.float32, 4, 2, 16, 4, seed=13)
    assert torch.equal(step_attention(*args, None), paged_attention(*args))
    assert torch.equal(step_attention(*args, i64(num_prompt_rows(reqs))), paged_attention(*args))


def test_a_prompt_only_step_skips_the_split_kernel_with_the_same_bits() -> None:
    """is_prompt_only (an eager step of prompt chunks only): the prefill kernel alone writes every row, bitwise what
    the two-kernel dispatch gives, and the split kernel is never launched."""
    reqs = [(c, n, c + n) for c, n, _ in REQS]  # every query row a prompt row
    args, _ = step_args(reqs, None, torch.float32, 4, 2, 16, 4, seed=21)
    prompt_rows = i64(num_prompt_rows(reqs))
    both = step_attention(*args, prompt_rows)
    with mock.patch("truespec.kernels.step_attention.split_attention", side_effect=AssertionError("launched")):
        alone = step_attention(*args, prompt_rows, is_prompt_only=True)
    real = int(args[2][-1])  # the engine sets is_prompt_only only without padding rows, which it leaves unwritten
    assert real > 0 and torch.equal(alone[:real], both[:real])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_attention_layer_hands_the_steps_prompt_rows_to_the_dispatch(dtype: torch.dtype,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer's kernel path (forced on CPU) passes ForwardContext.num_prompt_rows of a padded step (float64: None,
    every row split-KV) and matches the torch path; the KV it stores is the torch path's."""
    import truespec.kernels
    import truespec.layers.attention as attention

    gen = torch.Generator().manual_seed(17)
    rows = [ContextRow([0, 1, 2], 5, 6, -1, -1, 5, 1, 6),  # a prompt chunk over 5 cached positions
            ContextRow([3, 4], 6, 1, -1, -1, 0, 1, 0),  # a decode
            ContextRow([5, 6, 7, 8], 9, 5, -1, -1, 0, 1, 2)]  # a re-prefill: prompt positions 9, 10, outputs 11..13
    step = build_step(rows, [0] * 12, [0] * 12, 4, DEVICE, pad_to=16, width=4)
    layer = attention.PagedAttention(4, 2, 16, 16**-0.5)
    cache = randn(2, 9, 4, 2, 16, dtype=dtype, gen=gen)
    q, k, v = (randn(16, heads, 16, dtype=dtype, gen=gen) for heads in (4, 2, 2))
    seen = []

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        seen.append(args[6])
        return step_attention(*args, **kwargs)

    outs, caches = [], []
    for kernels_on in (False, True):
        layer.kv_cache = cache.clone()
        monkeypatch.setattr(attention, "use_kernels", lambda t, on=kernels_on: on)
        monkeypatch.setattr(truespec.kernels, "step_attention", spy)
        with set_forward_context(step.ctx):
            outs.append(layer(q, k, v))
        caches.append(layer.kv_cache)
    expected_rows = None if dtype == torch.float64 else [6, 0, 2] + [0] * 13
    assert len(seen) == 1 and (seen[0] is None if expected_rows is None else seen[0].tolist() == expected_rows)
    assert torch.equal(caches[0], caches[1])
    assert_near(outs[1], outs[0], dtype)
    assert torch.equal(outs[1][12:], torch.zeros_like(outs[1][12:]))


@gpu
@needs_cuda
@pytest.mark.parametrize("name", [None, "fp8", "turboquant_k8v4", "turboquant_4bit_nc"])
def test_gpu_mixed_step_routes_prompt_rows_to_prefill(name: str | None) -> None:
    args, fmt = step_args(GPU_REQS, name, torch.bfloat16, 8, 2, 256, 16, seed=14)
    out = check_rows_keep_their_kernels_bits(GPU_REQS, args, fmt)
    expected = paged_attention_ref(*args) if fmt is None else packed_reference(args, fmt, 256)[0]
    assert_near(out, expected, torch.bfloat16, GPU_TOL_SCALE)


@gpu
@needs_cuda
def test_gpu_mixed_step_with_sparse_v_keeps_split_kv_bits() -> None:
    args, _ = step_args(GPU_REQS, None, torch.bfloat16, 8, 2, 256, 16, seed=15, peak=8.0)
    check_rows_keep_their_kernels_bits(GPU_REQS, args, None, sparse_v_threshold=1e-3)


@gpu
@needs_cuda
def test_gpu_graph_replay_follows_new_prompt_rows() -> None:
    """step_attention captured once with static metadata (num_prompt_rows included), replayed for other steps of
    the same shape (other prompt / decode mixes): each replay equals the eager call bitwise."""
    gen = torch.Generator().manual_seed(16)
    cache = randn(2, 400, 16, 2, 256, dtype=torch.bfloat16, gen=gen)
    steps = [[(0, 40, 40), (100, 1, 50), (30, 8, 35), (0, 0, 0)], [(64, 1, 65), (900, 4, 100), (5, 44, 49), (0, 0, 0)],
             [(300, 49, 900), (0, 0, 0), (0, 0, 0), (0, 0, 0)]]  # fmt: skip
    static = None
    for i, reqs in enumerate(steps):
        batch = paged_batch([(c, n) for c, n, _ in reqs], block_size=16, num_blocks=400, gen=gen)
        tables = batch["block_tables"]
        tables = torch.cat([tables, torch.full((4, 70 - tables.shape[1]), -1, device=DEVICE)], dim=1)
        q = randn(51, 8, 256, dtype=torch.bfloat16, gen=gen)
        args = (q, cache, batch["query_start_loc"], batch["seq_lens"], tables, 256**-0.5,
                i64(num_prompt_rows(reqs)))  # fmt: skip
        if static is None:
            static, out = args, torch.empty_like(q)
            step_attention(*static, out=out)  # compile outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step_attention(*static, out=out)
        else:
            for buf, value in zip(static, args, strict=True):
                if isinstance(buf, torch.Tensor) and buf is not cache:
                    buf.copy_(value)
        graph.replay()
        assert torch.equal(out, step_attention(*args)), f"step {i}"
        assert_near(out, paged_attention_ref(*args[:6]), torch.bfloat16, GPU_TOL_SCALE)
