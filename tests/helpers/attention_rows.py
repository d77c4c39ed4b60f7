"""What the attention kernel tests over packed caches and with the sparse-V skip share: a packed cache over a
ragged batch, its reference, and one sequence's rows computed alone and inside bigger batches (invariant 4).

Importing this module imports ``helpers.kernels`` (Triton's interpreter without CUDA) but no kernel: the tests
hand it the kernel to call.
"""

import functools
from collections.abc import Callable

import torch
import triton

from helpers.kernels import DEVICE, NUM_PAD_TOKENS, assert_near, i64, paged_batch, randn
from truespec.kv_cache.formats import KVFormat
from truespec.ops.attention import SparseV, paged_attention_skips_ref

Attend = Callable[..., torch.Tensor]  # (q, cache, query_start_loc, seq_lens, block_tables, scale, **kwargs) -> out


def attention_batch(reqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype, seed: int, peak: float = 0.0) -> tuple:  # fmt: skip
    """paged_attention's arguments for ``reqs`` (num_cached, query_len) over a model-dtype cache of block size 4
    (never-read slots NaN, padding rows); ``peak``: see ``peak_attention``."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(triton.cdiv(c + n, 4) for c, n in reqs) + 4
    batch = paged_batch(reqs, block_size=4, num_blocks=num_blocks, gen=gen)
    kv = randn(2, num_blocks * 4, num_kv_heads, head_dim, dtype=torch.float64, gen=gen)
    q = randn(batch["slot_mapping"].shape[0], num_heads, head_dim, dtype=torch.float64, gen=gen)
    peak_attention(q, kv[0], batch["block_tables"].tolist(), batch["seq_lens"].tolist(), 4, peak, gen)
    kv[:, ~batch["is_live"]] = float("nan")  # never read
    cache = kv.view(2, num_blocks, 4, num_kv_heads, head_dim).to(dtype)
    return q.to(dtype), cache, batch["query_start_loc"], batch["seq_lens"], batch["block_tables"], head_dim**-0.5


def peak_attention(q: torch.Tensor, keys: torch.Tensor, tables: list[list[int]], seq_lens: list[int],
                   block_size: int, peak: float, gen: torch.Generator) -> None:  # fmt: skip
    """Make attention peaked and falling with the key's position, so that the sparse-V rule skips tiles: q and
    keys [num_slots, H_kv, D] gain ``peak * u`` and ``peak * ramp * u`` along one random unit direction u per kv
    head, where ramp falls from ~1 at a request's first key to 0 at its last (an early key outweighs the later
    ones, which then come after the running max). In place; ``peak`` 0 changes nothing."""
    if peak == 0:
        return
    num_kv_heads, head_dim = keys.shape[1:]
    u = torch.nn.functional.normalize(randn(num_kv_heads, head_dim, dtype=keys.dtype, gen=gen), dim=-1)
    q += peak * u.repeat_interleave(q.shape[1] // num_kv_heads, dim=0).to(q.dtype)
    for table, seq_len in zip(tables, seq_lens, strict=True):
        positions = torch.arange(seq_len)
        slots = torch.tensor(table)[positions // block_size] * block_size + positions % block_size
        ramp = 1.0 - positions.to(keys.dtype) / max(seq_len, 1)  # [seq_len]
        keys[slots.to(keys.device)] += peak * ramp.to(keys.device)[:, None, None] * u


def packed_batch(fmt: KVFormat, reqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int, dtype: torch.dtype, seed: int, peak: float = 0.0) -> tuple:  # fmt: skip
    """paged_attention_packed's positional arguments (up to scale) for ``reqs`` (num_cached, query_len) over a
    randomly laid out cache of K/V encoded by ``fmt``; slots no request owns hold 0xFF bytes (NaN as fp8 and as
    fp16 scale), so a kernel that reads them shows. ``peak``: see ``peak_attention``."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(triton.cdiv(c + n, block_size) for c, n in reqs) + 3
    batch = paged_batch(reqs, block_size=block_size, num_blocks=num_blocks, gen=gen)
    num_slots = num_blocks * block_size
    k = randn(num_slots, num_kv_heads, head_dim, dtype=torch.float32, gen=gen)
    v = randn(num_slots, num_kv_heads, head_dim, dtype=torch.float32, gen=gen)
    q = randn(batch["slot_mapping"].shape[0], num_heads, head_dim, dtype=torch.float64, gen=gen)
    peak_attention(q, k, batch["block_tables"].tolist(), batch["seq_lens"].tolist(), block_size, peak, gen)
    slots = fmt.encode(k, v)  # [num_slots, H, bytes]
    slots[~batch["is_live"]] = 0xFF  # never read
    cache = slots.view(num_blocks, block_size, num_kv_heads, -1).contiguous()
    return q.to(dtype), cache, batch["query_start_loc"], batch["seq_lens"], batch["block_tables"], head_dim**-0.5


def packed_reference(args: tuple, fmt: KVFormat, head_dim: int, sparse_v: SparseV | None = None
                     ) -> tuple[torch.Tensor, int]:  # fmt: skip
    """The torch reference over the decoded slots, and the number of tiles the sparse-V rule skipped."""
    decode = functools.partial(fmt.decode, head_dim=head_dim, dtype=args[0].dtype)
    return paged_attention_skips_ref(*args, decode=decode, sparse_v=sparse_v)


def rows_alone_and_in_batches(attend: Attend, make_cache: Callable[[torch.Tensor], torch.Tensor], num_heads: int,
                              num_kv_heads: int, head_dim: int, block_size: int, context: int, k: int,
                              dtype: torch.dtype, row_bytes: int, peak: float = 0.0) -> list[torch.Tensor]:  # fmt: skip
    """Rows at positions context-1-k .. context-1 of one sequence ([k + 1, num_heads, head_dim] each), computed
    as k+1 separate decodes, as one 1+k verify beside other requests, inside a prefill chunk with padding rows,
    and inside a mixed batch (the sequence's earlier position as a decode too) run in chunks of 3 rows
    (``max_workspace_bytes = 3 * row_bytes``) with a wider block table. ``make_cache(kv)``: the cache of the
    float64 K / V [2, num_blocks * block_size, num_kv_heads, head_dim]; ``attend``: the kernel, called with the
    batch's arguments and ``max_workspace_bytes`` (mixed batch only); ``peak``: see ``peak_attention``."""
    gen = torch.Generator().manual_seed(7)
    other_len = context + 5 * block_size  # longer than the sequence: a wider table, more grid splits
    num_blocks = triton.cdiv(context, block_size) + triton.cdiv(other_len, block_size) + 2
    blocks = torch.randperm(num_blocks, generator=gen).tolist()
    table, other = blocks[: triton.cdiv(context, block_size)], blocks[-triton.cdiv(other_len, block_size) :]
    kv = randn(2, num_blocks * block_size, num_kv_heads, head_dim, dtype=torch.float64, gen=gen)
    rows = randn(k + 1, num_heads, head_dim, dtype=torch.float64, gen=gen)
    peak_attention(rows, kv[0], [table, other], [context, other_len], block_size, peak, gen)
    cache, rows = make_cache(kv), rows.to(dtype)
    first = context - 1 - k

    def run(reqs: list[tuple[list[int], int, int]], q_rows: torch.Tensor, num_before: int, num_after: int,
            **kwargs: int) -> torch.Tensor:  # fmt: skip
        """reqs: (block table, seq_len, query_len); ``q_rows`` sit after ``num_before`` other query tokens,
        ``num_after`` tokens (other requests' and padding) follow them."""
        qsl = [0]
        for _, _, query_len in reqs:
            qsl.append(qsl[-1] + query_len)
        width = max(len(t) for t, _, _ in reqs)
        tables = i64([t + [-1] * (width - len(t)) for t, _, _ in reqs])
        q = torch.cat([randn(num_before, num_heads, head_dim, dtype=dtype, gen=gen), q_rows,
                       randn(num_after, num_heads, head_dim, dtype=dtype, gen=gen)])  # fmt: skip
        out = attend(q, cache, i64(qsl), i64([s for _, s, _ in reqs]), tables, head_dim**-0.5, **kwargs)
        if num_after >= NUM_PAD_TOKENS:
            assert torch.equal(out[-NUM_PAD_TOKENS:], torch.zeros_like(out[-NUM_PAD_TOKENS:]))
        return out[num_before : num_before + q_rows.shape[0]]

    alone = torch.cat([run([(table, first + i + 1, 1)], rows[i : i + 1], 0, 0) for i in range(k + 1)])
    verify = run([(other, other_len, 2), (table, context, k + 1), (other, 5, 1)], rows, 2, 1 + NUM_PAD_TOKENS)
    prefill = run([(other, 3, 1), (table, context, k + 3)], rows, 3, NUM_PAD_TOKENS)
    reqs = [(other, other_len - 1, 3), (table, first + 1, 1), (other, other_len, 1), (table, context, k + 1)]
    mixed = run(reqs, rows, 5, NUM_PAD_TOKENS, max_workspace_bytes=3 * row_bytes)
    return [alone, verify, prefill, mixed]


def packed_cache(fmt: KVFormat, block_size: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """``rows_alone_and_in_batches``' make_cache for a cache of ``fmt`` (K / V rounded to fp32, then encoded)."""

    def make(kv: torch.Tensor) -> torch.Tensor:
        slots = fmt.encode(kv[0].to(torch.float32), kv[1].to(torch.float32))  # [num_slots, H, bytes]
        return slots.view(-1, block_size, *slots.shape[1:]).contiguous()

    return make


def model_cache(dtype: torch.dtype, block_size: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """``rows_alone_and_in_batches``' make_cache for a model-dtype cache."""
    return lambda kv: kv.view(2, -1, block_size, *kv.shape[2:]).to(dtype)


def workspace_row_bytes(num_heads: int, head_dim: int, max_splits: int, dtype: torch.dtype) -> int:
    """Bytes of one row of the split workspace (m, l, acc per head and split slot, accumulator dtype)."""
    return num_heads * max_splits * (head_dim + 2) * (8 if dtype == torch.float64 else 4)


def check_graph_replay_follows_new_contents(attend: Attend, cache: torch.Tensor,
                                            reference: Callable[[tuple], torch.Tensor], tol_scale: float,
                                            gen: torch.Generator) -> None:  # fmt: skip
    """``attend(q, cache, ...)`` captured once in a CUDA graph (after a warm-up call outside it), replayed with other
    seq_lens / tables / queries (other split counts, padded requests): each replay equals the eager call bitwise and
    ``reference(args)`` within ``tol_scale``. ``cache``: 400 blocks of 16 slots, 2 kv heads of 256; 8 query heads."""
    batches = [[(900, 1), (40, 4), (511, 1), (0, 1)], [(1500, 1), (3, 4), (0, 1), (64, 1)], [(31, 4), (2000, 1)]]
    static = None
    for i, reqs in enumerate(batches):
        reqs = reqs + [(0, 0)] * (4 - len(reqs))  # padded (empty) requests
        batch = paged_batch(reqs, block_size=16, num_blocks=400, gen=gen)
        tables = batch["block_tables"]
        tables = torch.cat([tables, torch.full((4, 130 - tables.shape[1]), -1, device=DEVICE)], dim=1)
        q = randn(9, 8, 256, dtype=torch.bfloat16, gen=gen)
        args = (q, cache, batch["query_start_loc"], batch["seq_lens"], tables, 256**-0.5)
        if static is None:
            static, out = args, torch.empty_like(q)
            attend(*static, out=out)  # compile (and cache any tables) outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                attend(*static, out=out)
        else:
            for buf, value in zip(static[:5], args[:5], strict=True):
                buf.copy_(value)
        graph.replay()
        assert torch.equal(out, attend(*args)), f"batch {i}"
        assert_near(out, reference(args), torch.bfloat16, tol_scale)
