"""The CPU path's compiled attention of a step's rows (cpu_kernels/attention.py and attention_core.c) against
``paged_attention_ref``: decodes, 1+k verifies and prefill chunks of any length over cached keys (starting mid-block),
GQA groups of 1 / 2 / 4, padding rows, float32 and float64; a row's bits the same alone, inside the batch and as the
decode at its position (invariant 4 on the CPU; so a prompt position's bits do not depend on its chunking); and the
attention layer giving the torch path's output with it."""

from unittest import mock

import pytest
import torch

from helpers.attention_rows import attention_batch
from helpers.kernels import assert_near, make_context
from truespec.cpu_kernels import attention as cpu_attention
from truespec.cpu_kernels import build
from truespec.forward_context import set_forward_context
from truespec.layers.attention import PagedAttention
from truespec.ops.attention import paged_attention_ref, reshape_and_cache_ref

pytestmark = pytest.mark.skipif(build.load() is None, reason="no C compiler: the CPU path keeps its torch ops")
# (num_cached, query_len): decodes, a 1+3 verify, a 16-token chunk after a cached prefix (mid-block), an empty query,
# a fresh 5-token prompt, a 17-token and a 40-token chunk (the torch path runs chunks of > 16 tokens alone)
REQS = [(9, 1), (0, 1), (6, 4), (13, 16), (5, 0), (0, 5), (3, 17), (21, 40)]


def cpu_batch(reqs: list, heads: tuple[int, int], dtype: torch.dtype, seed: int = 3) -> tuple:
    return tuple(t.cpu() if isinstance(t, torch.Tensor) else t for t in attention_batch(reqs, *heads, 32, dtype, seed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 2)], ids=["mha", "gqa2", "gqa4"])
def test_every_row_matches_the_reference(dtype: torch.dtype, heads: tuple[int, int]) -> None:
    q, cache, qsl, seq_lens, tables, scale = args = cpu_batch(REQS, heads, dtype)
    out = cpu_attention.attention_rows(*args, torch.full_like(q, 7.0))
    expected = paged_attention_ref(*args)
    num_rows = int(qsl[-1])
    assert_near(out[:num_rows], expected[:num_rows], dtype)
    assert num_rows < q.shape[0] and (out[num_rows:] == 7.0).all()  # padding rows: untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_row_gives_the_same_bits_alone_and_in_the_batch(dtype: torch.dtype) -> None:
    reqs = [r for r in REQS if r[1] > 0]
    q, cache, qsl, seq_lens, tables, scale = cpu_batch(reqs, (8, 2), dtype, seed=5)
    out = cpu_attention.attention_rows(q, cache, qsl, seq_lens, tables, scale, torch.zeros_like(q))
    for r in range(len(reqs)):
        rows = slice(int(qsl[r]), int(qsl[r + 1]))
        n = rows.stop - rows.start
        alone = cpu_attention.attention_rows(q[rows], cache, torch.tensor([0, n]), seq_lens[r : r + 1],
                                             tables[r : r + 1], scale, torch.zeros_like(q[rows]))  # fmt: skip
        assert torch.equal(alone, out[rows])
        for j in range(n):  # each verify row as the decode it would be at its position
            row = rows.start + j
            decode = cpu_attention.attention_rows(q[row : row + 1], cache, torch.tensor([0, 1]),
                                                  seq_lens[r : r + 1] - (n - 1 - j), tables[r : r + 1], scale,
                                                  torch.zeros_like(q[row : row + 1]))  # fmt: skip
            assert torch.equal(decode, out[row : row + 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_layer_gives_the_torch_path_output(dtype: torch.dtype) -> None:
    q, cache, qsl, seq_lens, tables, scale = cpu_batch(REQS, (4, 2), dtype, seed=7)
    layer = PagedAttention(4, 2, 32, scale)
    num_tokens = q.shape[0]
    k, v = (torch.randn(num_tokens, 2, 32, generator=torch.Generator().manual_seed(i), dtype=dtype) for i in (1, 2))
    no_store = torch.full((num_tokens,), -1)
    batch = dict(query_start_loc=qsl, seq_lens=seq_lens, block_tables=tables, slot_mapping=no_store)
    outs = []
    for is_on in (True, False):
        layer.kv_cache = cache.clone()
        with set_forward_context(make_context(batch, num_tokens)), \
                mock.patch.object(cpu_attention, "can_run", return_value=is_on and cpu_attention.can_run(q, cache)):
            outs.append(layer(q, k, v))
    assert_near(outs[0], outs[1], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_store_kv_is_reshape_and_cache(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(9)
    cache = torch.randn(2, 6, 4, 2, 32, generator=gen, dtype=dtype)
    kv = torch.randn(5, 3, 2, 32, generator=gen, dtype=dtype)  # k and v as strided views of one tensor, 5 rows
    k, v = kv[:, 0], kv[:, 2]
    slots = torch.tensor([7, -1, 0, 23])  # 4 tokens (the fifth row is padding), one not stored
    expected = cache.clone()
    reshape_and_cache_ref(k, v, expected, slots)
    cpu_attention.store_kv(k, v, cache, slots)
    assert torch.equal(cache, expected)
