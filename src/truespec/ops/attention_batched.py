"""Causal attention over a paged KV cache for a whole step at once, in torch: the CPU path (``ops/attention.py``'s
``paged_attention_ref`` is the reference, one request at a time).

Requests run in groups (ops/attention_rows.py, which also holds every index the step's layers share). A group's
keys are gathered tile-major ([tiles, R, H_kv, D, TILE] keys^T, [tiles, R, H_kv, TILE, D] values, positions 0 ..
S - 1 of each request) and every query row runs an online softmax over tiles of ``TILE`` keys at fixed absolute
positions (0, TILE, 2 TILE, ...). A row's result therefore depends only on its own query and keys
(docs/ARCHITECTURE.md invariant 4): within a tile its masked keys give p = 0 exactly, tiles past its last key change
nothing (alpha = 1, p = 0), and the per-tile products and sums were checked to give a row the same bits whatever the
number of rows and requests beside it (tests/test_cpu_batched_ops.py).
"""

import torch

from truespec.ops.attention import SlotDecoder
from truespec.ops.attention_rows import TILE, GroupRows, StepAttentionRows
from truespec.ops.precision import as_dtype, compute_dtype

ROWS_PER_PRODUCT = 2  # query rows per matrix product in the tile loop (``_online_softmax``)


def paged_attention_batched(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                            seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                            decode: SlotDecoder | None = None, rows: StepAttentionRows | None = None,
                            **_: object) -> torch.Tensor:  # fmt: skip
    """``paged_attention_ref``'s arguments and result (rows no request owns: zeros); keyword arguments of the
    CUDA kernels (``max_workspace_bytes``) are accepted and ignored. ``rows``: the step's ``StepAttentionRows``
    for this cache's block size and kv heads and q's heads, if the caller keeps them (built here otherwise)."""
    if rows is None:  # both cache layouts end [.., block_size, num_kv_heads, D or bytes]
        num_kv_heads = kv_cache.shape[-2]
        rows = StepAttentionRows.of(query_start_loc, seq_lens, block_tables, kv_cache.shape[-3], num_kv_heads,
                                    q.shape[1] // num_kv_heads)  # fmt: skip
    if rows.is_in_order and rows.num_rows == q.shape[0]:  # every row is the group's, in order: no scatter
        return as_dtype(_attend_group(q, kv_cache, rows.groups[0], scale, decode), q.dtype)
    out = torch.zeros_like(q)
    for group in rows.groups:
        out[group.out_rows] = _attend_group(q, kv_cache, group, scale, decode).to(out.dtype)
    return out


def _attend_group(q: torch.Tensor, kv_cache: torch.Tensor, group: GroupRows, scale: float,
                  decode: SlotDecoder | None) -> torch.Tensor:  # fmt: skip
    """The attention of ``group``'s real query rows ([num real rows, H, D], in the compute dtype)."""
    num_heads, head_dim = q.shape[1:]
    num_reqs, num_rows = group.num_reqs, group.num_rows
    cdt = compute_dtype(q.dtype)
    keys, values = _tile_major_kv(kv_cache, group, decode, cdt)  # values 0 past a request's keys
    num_kv_heads = keys.shape[2]
    group_size = num_heads // num_kv_heads
    # [R, L, H, D] -> [R, H_kv, L * G, D]: row l * G + g of kv head h is query head h * G + g at offset l
    first, is_dense = group.first_row, group.first_row is not None and q.is_contiguous()
    qr = q[first:first + num_reqs * num_rows] if is_dense else q.index_select(0, group.rows.flatten())  # view / copy
    qg = as_dtype(qr, cdt).view(num_reqs, num_rows, num_kv_heads, group_size, head_dim)
    qg = qg.permute(0, 2, 1, 3, 4).reshape(num_reqs, num_kv_heads, num_rows * group_size, head_dim)
    res = _online_softmax(qg, keys, values, group.is_masked, scale)  # [R, H_kv, L * G, D]
    res = res.view(num_reqs, num_kv_heads, num_rows, group_size, head_dim).permute(0, 2, 1, 3, 4)
    res = res.reshape(num_reqs, num_rows, num_heads, head_dim)
    return res.flatten(0, 1).contiguous() if group.first_row is not None else res[group.is_row]


def _online_softmax(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, is_masked: torch.Tensor,
                    scale: float) -> torch.Tensor:  # fmt: skip
    """q [R, H_kv, M, D] over tile-major keys^T [tiles, R, H_kv, D, TILE] and values [tiles, R, H_kv, TILE, D],
    ``is_masked`` [R, 1, M, tiles * TILE]: softmax(q k^T * scale) v, tile by tile. Every product has exactly
    ``ROWS_PER_PRODUCT`` query rows (M padded with a zero row when odd, the pairs folded into the batch): a BLAS
    kernel picks its blocking, and so a row's summation order, by the rows of a product (torch 2.13 on an AMD EPYC:
    a row of [M, D] @ [D, TILE] has one set of bits at M = 1 and 2, another at M >= 4), never by how many products
    a batch holds. Pairs rather than single rows: a decode of 2 query heads per kv head is then one product, as
    before, with no copy of the keys."""
    num_rows = q.shape[-2]
    if num_rows % ROWS_PER_PRODUCT:
        q = torch.nn.functional.pad(q, (0, 0, 0, ROWS_PER_PRODUCT - num_rows % ROWS_PER_PRODUCT))
        is_masked = torch.nn.functional.pad(is_masked, (0, 0, 0, q.shape[-2] - num_rows))  # the pad row: unmasked
    paired = (*q.shape[:2], q.shape[2] // ROWS_PER_PRODUCT, ROWS_PER_PRODUCT)  # [R, H_kv, M / 2, 2]
    m = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
    l = torch.zeros_like(m)
    acc = torch.zeros_like(q)
    qp = q.view(*paired, q.shape[-1])
    for i in range(keys.shape[0]):
        s = torch.matmul(qp, keys[i].unsqueeze(2)).view(m.shape + (TILE,)) * scale  # [R, H_kv, M, TILE]
        s = s.masked_fill(is_masked[..., i * TILE : (i + 1) * TILE], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new[..., None])
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + torch.matmul(p.view(*paired, TILE), values[i].unsqueeze(2)).view(acc.shape)
        m = m_new
    return (acc / l[..., None])[..., :num_rows, :]


def _tile_major_kv(kv_cache: torch.Tensor, group: GroupRows, decode: SlotDecoder | None,
                   cdt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``group``'s keys^T [tiles, R, H_kv, D, TILE] and values [tiles, R, H_kv, TILE, D], contiguous in ``cdt``: every
    matmul of the tile loop sees the same layout whatever R and S are (a transposed or strided operand changed
    float64 bits with R). Positions at or past a request's keys read slot 0, which may hold anything, NaN included:
    their values are zeroed (p = 0 times a NaN would be NaN); their keys are not, since every row masks them (a score
    is one key's dot product, and masked_fill replaces it by -inf whatever it was)."""
    num_reqs, num_kv_heads = group.num_reqs, kv_cache.shape[-2]
    if decode is not None:  # a compressed cache: decode whole slots, then lay them out
        keys, values = decode(kv_cache.view(-1, *kv_cache.shape[-2:]).index_select(0, group.kv_slots))
        if group.pad_keys is not None:
            values = values.index_fill(0, group.pad_keys, 0)
        shape = (num_reqs, -1, TILE, num_kv_heads, keys.shape[-1])  # from [R * S, H_kv, D]
        keys = as_dtype(keys, cdt).reshape(shape).permute(1, 0, 3, 4, 2).contiguous()
        return keys, as_dtype(values, cdt).reshape(shape).permute(1, 0, 3, 2, 4).contiguous()
    head_dim = kv_cache.shape[-1]
    shape = (-1, num_reqs, num_kv_heads, TILE, head_dim)
    keys = kv_cache[0].view(-1, head_dim).index_select(0, group.tile_rows).view(shape)  # one row per (slot, head)
    values = kv_cache[1].view(-1, head_dim).index_select(0, group.tile_rows)  # already tile-major
    if group.pad_tile_rows is not None:
        values.index_fill_(0, group.pad_tile_rows, 0)  # its own copy
    return as_dtype(keys, cdt).transpose(-1, -2).contiguous(), as_dtype(values.view(shape), cdt).contiguous()
