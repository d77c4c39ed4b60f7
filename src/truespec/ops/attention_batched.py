"""Causal attention over a paged KV cache for a whole step at once, in torch: the CPU path (``ops/attention.py``'s
``paged_attention_ref`` is the reference, one request at a time).

Requests are batched: every request whose query is at most ``MAX_BATCHED_QUERY_LEN`` tokens (decodes, verifies,
short chunks) in one group, each longer prefill chunk alone. A group's keys are gathered into [R, S, H_kv, D]
(S: the longest context, padded to whole tiles) and every query row runs an online softmax over tiles of ``TILE``
keys at fixed absolute positions (0, TILE, 2 TILE, ...). A row's result therefore depends only on its own query
and keys (docs/ARCHITECTURE.md invariant 4): within a tile its masked keys give p = 0 exactly, tiles past its last
key change nothing (alpha = 1, p = 0), and the per-tile products and sums were checked to give a row the same bits
whatever the number of rows and requests beside it (tests/test_cpu_batched_ops.py).
"""

import torch

from truespec.ops.attention import SlotDecoder
from truespec.ops.precision import compute_dtype

TILE = 128  # keys per online-softmax tile
MAX_BATCHED_QUERY_LEN = 16  # longer chunks run alone: padding every request to their length would dominate


def paged_attention_batched(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                            seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                            decode: SlotDecoder | None = None, **_: object) -> torch.Tensor:  # fmt: skip
    """``paged_attention_ref``'s arguments and result (rows no request owns: zeros); keyword arguments of the
    CUDA kernels (``max_workspace_bytes``) are accepted and ignored."""
    out = torch.zeros_like(q)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    reqs = [r for r in range(len(lens)) if qsl[r + 1] > qsl[r]]
    for r in reqs:
        if lens[r] < qsl[r + 1] - qsl[r]:
            raise ValueError(f"request {r}: seq_len {lens[r]} < query_len {qsl[r + 1] - qsl[r]}")
    short = [r for r in reqs if qsl[r + 1] - qsl[r] <= MAX_BATCHED_QUERY_LEN]
    groups = ([short] if short else []) + [[r] for r in reqs if qsl[r + 1] - qsl[r] > MAX_BATCHED_QUERY_LEN]
    for group in groups:
        _attend_group(q, out, kv_cache, block_tables, group, qsl, lens, scale, decode)
    return out


def _attend_group(q: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                  group: list[int], qsl: list[int], lens: list[int], scale: float,
                  decode: SlotDecoder | None) -> None:  # fmt: skip
    """Requests ``group`` of the step: their query rows of ``out`` get their attention."""
    num_heads, head_dim = q.shape[1:]
    query_lens = [qsl[r + 1] - qsl[r] for r in group]
    num_rows, num_keys = max(query_lens), -(-max(lens[r] for r in group) // TILE) * TILE
    # query row (request i, offset j): its token row (padding: the request's first row, never written back)
    rows = [[qsl[r] + (j if j < n else 0) for j in range(num_rows)] for r, n in zip(group, query_lens, strict=True)]
    is_row = torch.tensor([[j < n for j in range(num_rows)] for n in query_lens])  # [R, L]
    rows_t = torch.tensor(rows)  # [R, L]
    # row (i, j) sees keys 0 .. limit - 1 (padding rows: key 0 only, so no row is all -inf)
    limit = torch.tensor([[lens[r] - n + j + 1 if j < n else 1 for j in range(num_rows)]
                          for r, n in zip(group, query_lens, strict=True)])  # fmt: skip
    keys, values = _gather_kv(kv_cache, block_tables[group], torch.tensor([lens[r] for r in group]), num_keys,
                              decode)  # [R, S, H_kv, D] each, zeros past each request's keys
    cdt = compute_dtype(q.dtype)
    num_kv_heads = keys.shape[2]
    group_size = num_heads // num_kv_heads
    # [R, L, H, D] -> [R, H_kv, L * G, D]: row l * G + g of kv head h is query head h * G + g at offset l
    qg = q[rows_t].to(cdt).view(len(group), num_rows, num_kv_heads, group_size, head_dim)
    qg = qg.permute(0, 2, 1, 3, 4).reshape(len(group), num_kv_heads, num_rows * group_size, head_dim)
    is_key = torch.arange(num_keys)[None, None, :] < limit[:, :, None]  # [R, L, S]
    is_key = is_key[:, None, :, None, :].expand(-1, 1, -1, group_size, -1).reshape(len(group), 1, -1, num_keys)
    # tile-major and contiguous ([tiles, R, H_kv, D, TILE] and [tiles, R, H_kv, TILE, D]): every matmul below sees
    # the same layout whatever R and S are (a transposed or strided operand changed float64 bits with R)
    keys = keys.to(cdt).view(len(group), -1, TILE, num_kv_heads, head_dim).permute(1, 0, 3, 4, 2).contiguous()
    values = values.to(cdt).view(len(group), -1, TILE, num_kv_heads, head_dim).permute(1, 0, 3, 2, 4).contiguous()
    res = _online_softmax(qg, keys, values, ~is_key, scale)  # [R, H_kv, L * G, D]
    res = res.view(len(group), num_kv_heads, num_rows, group_size, head_dim).permute(0, 2, 1, 3, 4)
    out[rows_t[is_row]] = res.reshape(len(group), num_rows, num_heads, head_dim)[is_row].to(out.dtype)


def _online_softmax(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, is_masked: torch.Tensor,
                    scale: float) -> torch.Tensor:  # fmt: skip
    """q [R, H_kv, M, D] over tile-major keys^T [tiles, R, H_kv, D, TILE] and values [tiles, R, H_kv, TILE, D],
    ``is_masked`` [R, 1, M, tiles * TILE]: softmax(q k^T * scale) v, tile by tile."""
    m = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
    l = torch.zeros_like(m)
    acc = torch.zeros_like(q)
    for i in range(keys.shape[0]):
        s = torch.matmul(q, keys[i]) * scale  # [R, H_kv, M, TILE]
        s = s.masked_fill(is_masked[..., i * TILE : (i + 1) * TILE], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new[..., None])
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + torch.matmul(p, values[i])
        m = m_new
    return acc / l[..., None]


def _gather_kv(kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, num_keys: int,
               decode: SlotDecoder | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Keys and values of positions 0 .. num_keys - 1 of each request ([R, num_keys, H_kv, D] each); positions at or
    past a request's ``seq_lens`` are zeros (their slots may hold anything, NaN included)."""
    block_size = kv_cache.shape[-3] if decode is None else kv_cache.shape[1]
    positions = torch.arange(num_keys)
    is_key = positions[None, :] < seq_lens[:, None]  # [R, S]
    blocks = (positions // block_size).clamp(max=block_tables.shape[1] - 1)
    slots = block_tables[:, blocks] * block_size + positions % block_size
    slots = torch.where(is_key, slots, 0)
    if decode is not None:
        flat = kv_cache.view(-1, *kv_cache.shape[-2:])[slots.flatten()]
        keys, values = (x.view(*slots.shape, *x.shape[1:]) for x in decode(flat))
    else:
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        keys = kv_cache[0].view(-1, num_kv_heads, head_dim)[slots]  # [R, S, H_kv, D]
        values = kv_cache[1].view(-1, num_kv_heads, head_dim)[slots]
    keep = is_key[:, :, None, None]
    return torch.where(keep, keys, 0), torch.where(keep, values, 0)
