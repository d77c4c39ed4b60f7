"""Causal attention over a paged KV cache for a whole step at once, in torch: the CPU path (``ops/attention.py``'s
``paged_attention_ref`` is the reference, one request at a time).

Requests are batched: every request whose query is at most ``MAX_BATCHED_QUERY_LEN`` tokens (decodes, verifies,
short chunks) in one group, each longer prefill chunk alone. A group's keys are gathered into [R, S, H_kv, D]
(S: the longest context, padded to whole tiles) and every query row runs an online softmax over tiles of ``TILE``
keys at fixed absolute positions (0, TILE, 2 TILE, ...). A row's result therefore depends only on its own query
and keys (docs/ARCHITECTURE.md invariant 4): within a tile its masked keys give p = 0 exactly, tiles past its last
key change nothing (alpha = 1, p = 0), and the per-tile products and sums were checked to give a row the same bits
whatever the number of rows and requests beside it (tests/test_cpu_batched_ops.py).

``StepAttentionRows`` holds what depends only on the step's metadata (groups, query rows, masks, cache slots),
built once per forward and shared by its attention layers (ForwardContext.host_cache), so a layer runs only
the gathers and the tile loop.
"""

from dataclasses import dataclass

import torch

from truespec.ops.attention import SlotDecoder
from truespec.ops.precision import as_dtype, compute_dtype

TILE = 128  # keys per online-softmax tile
MAX_BATCHED_QUERY_LEN = 16  # longer chunks run alone: padding every request to their length would dominate


@dataclass(frozen=True)
class GroupRows:
    """One group of requests: its query rows, masks and cache slots (host-built, shared by a step's layers)."""

    num_reqs: int
    num_rows: int  # L: the group's longest query
    rows: torch.Tensor  # [R, L] query row (request i, offset j): its token row (padding: the request's first row)
    is_row: torch.Tensor  # [R, L] not padding
    out_rows: torch.Tensor  # [num real rows] ``rows[is_row]``: where the results go
    is_masked: torch.Tensor  # [R, 1, L * G, S]: row l * G + g (query head h * G + g) may not see key s
    kv_slots: torch.Tensor  # [R * S] flat cache slot of each key position (0 past the request's keys)
    pad_keys: torch.Tensor | None  # indices into kv_slots of positions past the request's keys (values zeroed)
    first_row: int | None  # no padding row, ``rows`` = first_row, first_row + 1, ..: q's rows are a slice of it


@dataclass(frozen=True)
class StepAttentionRows:
    """A step's groups (every request of at most ``MAX_BATCHED_QUERY_LEN`` query tokens in one, each longer
    prefill chunk alone) and whether their real rows are exactly the step's rows 0 .. num_rows - 1 in order."""

    groups: list[GroupRows]
    num_rows: int  # token rows the requests own
    is_in_order: bool  # one group, its real rows 0, 1, .., num_rows - 1 (a decode batch, one request's chunk)

    @classmethod
    def of(cls, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int,
           group_size: int) -> "StepAttentionRows":  # fmt: skip
        qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
        reqs = [r for r in range(len(lens)) if qsl[r + 1] > qsl[r]]
        for r in reqs:
            if lens[r] < qsl[r + 1] - qsl[r]:
                raise ValueError(f"request {r}: seq_len {lens[r]} < query_len {qsl[r + 1] - qsl[r]}")
        short = [r for r in reqs if qsl[r + 1] - qsl[r] <= MAX_BATCHED_QUERY_LEN]
        groups = ([short] if short else []) + [[r] for r in reqs if qsl[r + 1] - qsl[r] > MAX_BATCHED_QUERY_LEN]
        built = [_group_rows(g, qsl, lens, block_tables, block_size, group_size) for g in groups]
        num_rows = sum(qsl[r + 1] - qsl[r] for r in reqs)
        is_in_order = len(built) == 1 and built[0].out_rows.tolist() == list(range(num_rows))
        return cls(built, num_rows, is_in_order)


def _group_rows(group: list[int], qsl: list[int], lens: list[int], block_tables: torch.Tensor, block_size: int,
                group_size: int) -> GroupRows:  # fmt: skip
    query_lens = [qsl[r + 1] - qsl[r] for r in group]
    num_rows, num_keys = max(query_lens), -(-max(lens[r] for r in group) // TILE) * TILE
    rows = torch.tensor([[qsl[r] + (j if j < n else 0) for j in range(num_rows)]
                         for r, n in zip(group, query_lens, strict=True)])  # fmt: skip
    is_row = torch.tensor([[j < n for j in range(num_rows)] for n in query_lens])  # [R, L]
    # row (i, j) sees keys 0 .. limit - 1 (padding rows: key 0 only, so no row is all -inf)
    limit = torch.tensor([[lens[r] - n + j + 1 if j < n else 1 for j in range(num_rows)]
                          for r, n in zip(group, query_lens, strict=True)])  # fmt: skip
    is_key = torch.arange(num_keys)[None, None, :] < limit[:, :, None]  # [R, L, S]
    is_key = is_key[:, None, :, None, :].expand(-1, 1, -1, group_size, -1).reshape(len(group), 1, -1, num_keys)
    kv_slots, pad_keys = _kv_slots(block_tables[group], torch.tensor([lens[r] for r in group]), num_keys,
                                   block_size)  # fmt: skip
    flat = rows.flatten().tolist()
    first_row = flat[0] if flat == list(range(flat[0], flat[0] + len(flat))) and bool(is_row.all()) else None
    return GroupRows(len(group), num_rows, rows, is_row, rows[is_row], ~is_key, kv_slots, pad_keys, first_row)


def _kv_slots(block_tables: torch.Tensor, seq_lens: torch.Tensor, num_keys: int,
              block_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """The flat cache slot of each request's key positions 0 .. num_keys - 1 ([R * S], 0 at or past its
    ``seq_lens`` and in a padding request's block -1), and where those padding positions are in it (None when there
    are none)."""
    positions = torch.arange(num_keys)
    blocks = (positions // block_size).clamp(max=block_tables.shape[1] - 1)
    slots = block_tables[:, blocks] * block_size + positions % block_size
    is_key = (positions[None, :] < seq_lens[:, None]) & (slots >= 0)  # [R, S]
    slots = torch.where(is_key, slots, 0).flatten()
    return slots, None if bool(is_key.all()) else (~is_key).flatten().nonzero().flatten()


def paged_attention_batched(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                            seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                            decode: SlotDecoder | None = None, rows: StepAttentionRows | None = None,
                            **_: object) -> torch.Tensor:  # fmt: skip
    """``paged_attention_ref``'s arguments and result (rows no request owns: zeros); keyword arguments of the
    CUDA kernels (``max_workspace_bytes``) are accepted and ignored. ``rows``: the step's ``StepAttentionRows``
    for this cache's block size and q's group size, if the caller keeps them (built here otherwise)."""
    if rows is None:  # both cache layouts end [.., block_size, num_kv_heads, D or bytes]
        rows = StepAttentionRows.of(query_start_loc, seq_lens, block_tables, kv_cache.shape[-3],
                                    q.shape[1] // kv_cache.shape[-2])  # fmt: skip
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
    keys, values = _gather_kv(kv_cache, group, decode)  # [R, S, H_kv, D] each; values 0 past a request's keys
    cdt = compute_dtype(q.dtype)
    num_kv_heads = keys.shape[2]
    group_size = num_heads // num_kv_heads
    # [R, L, H, D] -> [R, H_kv, L * G, D]: row l * G + g of kv head h is query head h * G + g at offset l
    first, is_dense = group.first_row, group.first_row is not None and q.is_contiguous()
    qr = q[first:first + num_reqs * num_rows] if is_dense else q.index_select(0, group.rows.flatten())  # view / copy
    qg = as_dtype(qr, cdt).view(num_reqs, num_rows, num_kv_heads, group_size, head_dim)
    qg = qg.permute(0, 2, 1, 3, 4).reshape(num_reqs, num_kv_heads, num_rows * group_size, head_dim)
    # tile-major and contiguous ([tiles, R, H_kv, D, TILE] and [tiles, R, H_kv, TILE, D]): every matmul below sees
    # the same layout whatever R and S are (a transposed or strided operand changed float64 bits with R)
    keys = as_dtype(keys, cdt).view(num_reqs, -1, TILE, num_kv_heads, head_dim).permute(1, 0, 3, 4, 2).contiguous()
    values = as_dtype(values, cdt).view(num_reqs, -1, TILE, num_kv_heads, head_dim).permute(1, 0, 3, 2, 4).contiguous()
    res = _online_softmax(qg, keys, values, group.is_masked, scale)  # [R, H_kv, L * G, D]
    res = res.view(num_reqs, num_kv_heads, num_rows, group_size, head_dim).permute(0, 2, 1, 3, 4)
    res = res.reshape(num_reqs, num_rows, num_heads, head_dim)
    return res.flatten(0, 1).contiguous() if group.first_row is not None else res[group.is_row]


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


def _gather_kv(kv_cache: torch.Tensor, group: GroupRows,
               decode: SlotDecoder | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Keys and values of positions 0 .. S - 1 of each request of ``group`` ([R, S, H_kv, D] each), gathered as whole
    slots (index_select). Positions at or past a request's keys read slot 0, which may hold anything, NaN included:
    their values are zeroed (p = 0 times a NaN would be NaN); their keys are not, since every row masks them (a score
    is one key's dot product, and masked_fill replaces it by -inf whatever it was)."""
    slots, num_kv_heads = group.kv_slots, kv_cache.shape[-2]
    if decode is not None:
        keys, values = decode(kv_cache.view(-1, *kv_cache.shape[-2:]).index_select(0, slots))  # [R * S, H_kv, D]
        if group.pad_keys is not None:
            values = values.index_fill(0, group.pad_keys, 0)
    else:
        slot_size = num_kv_heads * kv_cache.shape[-1]
        keys = kv_cache[0].view(-1, slot_size).index_select(0, slots)  # [R * S, H_kv * D]
        values = kv_cache[1].view(-1, slot_size).index_select(0, slots)
        if group.pad_keys is not None:
            values.index_fill_(0, group.pad_keys, 0)  # its own copy
    shape = (group.num_reqs, slots.numel() // group.num_reqs, num_kv_heads, -1)
    return keys.reshape(shape), values.reshape(shape)
