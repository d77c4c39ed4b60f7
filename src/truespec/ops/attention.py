"""Causal attention over a paged KV cache, in torch: one loop over requests.

kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim] (index 0 = K, 1 = V); flat slot
``block * block_size + offset``. A step first writes its K/V at ``slot_mapping`` (-1 = padding: no write), then
query token i of request r, at absolute position ``p = seq_len - query_len + i``, attends keys ``0..p`` of that
request, gathered through ``block_tables[r]``. Drafted tokens' KV is written before it is read, exactly as in a
plain decode (docs/ARCHITECTURE.md invariant 4).

``tiled_attention`` is the reference of the kernels' own order (kernels/paged_attention.py): each row's keys cut
into splits and tiles by ``split_layout``, online softmax tile by tile, the splits merged, and the sparse-V tile
skip, in float64. ``paged_attention_ref(..., sparse_v=...)`` runs it instead of the plain softmax.
"""

from collections.abc import Callable
from typing import NamedTuple

import torch

from truespec.ops.precision import compute_dtype

# a packed cache's read: uint8 slots [S, H, bytes] -> keys, values [S, H, D] (kv_cache/formats.py KVFormat.decode)
SlotDecoder = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


# the kernels' split layout (kernels/paged_attention.py, kernels/split_merge.py): keys per tile, most splits per row
# (the cap: 16 was tuned on an H200, 64 is still to be measured at 8K-32K keys), fewest keys per split. Here so that
# the reference can follow the kernels' tiles without importing triton.
BLOCK_N, MAX_SPLITS, MIN_SPLIT_KEYS = 32, 64, 64


class SparseV(NamedTuple):
    """The kernels' sparse-V tile skip and the split layout it runs over (kernels/paged_attention.py)."""

    threshold: float  # a tile whose largest p / l is below this adds no values (0: never skips)
    block_n: int
    max_splits: int
    min_split_keys: int
    min_keys: int = 0  # only rows with at least this many keys skip (sparse_v="auto")

    @classmethod
    def of(cls, threshold: float, min_keys: int = 0) -> "SparseV":
        """The skip rule over the kernels' default split layout."""
        return cls(threshold, BLOCK_N, MAX_SPLITS, MIN_SPLIT_KEYS, min_keys)


def split_layout(num_keys: int, block_n: int, max_splits: int, min_split_keys: int) -> tuple[int, int]:
    """(split_size, num_splits) of a row with ``num_keys`` keys: the kernels' rule (kernels/split_merge.py
    ``row_layout``), which depends on the row's keys and the constants only (invariant 4): one split per
    ``min_split_keys`` keys up to ``max_splits``, then longer splits. Padding rows (0 keys) have one empty split."""
    split_size = -(-max(min_split_keys, -(-num_keys // max_splits)) // block_n) * block_n
    return split_size, max(-(-num_keys // split_size), 1)


def reshape_and_cache_ref(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store k/v [T', num_kv_heads, head_dim] at ``slot_mapping`` [T] (T <= T'; rows with slot -1 write nothing)."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    num_tokens = slot_mapping.shape[0]
    is_valid = slot_mapping >= 0
    slots = slot_mapping[is_valid]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k[:num_tokens][is_valid])
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v[:num_tokens][is_valid])


def store_packed_ref(slot_bytes: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store encoded slots uint8 [T', H, bytes] at ``slot_mapping`` [T] into a packed cache [num_blocks, block_size,
    H, bytes] (rows with slot -1 write nothing)."""
    num_tokens = slot_mapping.shape[0]
    is_valid = slot_mapping >= 0
    kv_cache.view(-1, *kv_cache.shape[-2:]).index_copy_(0, slot_mapping[is_valid], slot_bytes[:num_tokens][is_valid])


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
              decode: SlotDecoder | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of positions 0..seq_len-1 of one request: each [seq_len, num_kv_heads, head_dim]. ``decode``: the
    cache is packed ([num_blocks, block_size, H, bytes]) and this reads its slots."""
    block_size = kv_cache.shape[-3] if decode is None else kv_cache.shape[1]
    positions = torch.arange(seq_len, device=kv_cache.device)
    slots = block_table[positions // block_size] * block_size + positions % block_size
    if decode is not None:
        return decode(kv_cache.view(-1, *kv_cache.shape[-2:])[slots])
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    keys = kv_cache[0].view(-1, num_kv_heads, head_dim)[slots]
    values = kv_cache[1].view(-1, num_kv_heads, head_dim)[slots]
    return keys, values


def causal_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, num_cached: int, scale: float
) -> torch.Tensor:
    """One request: q [query_len, num_heads, D] (positions num_cached..), keys/values [seq_len, num_kv_heads, D].

    Same operation order as transformers' eager attention: scores in the model dtype, softmax in the
    compute dtype, probabilities cast back, then P @ V. Returns [query_len, num_heads, D].
    """
    query_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads  # kv head j serves query heads j*group .. j*group+group-1
    keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
    values = values.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
    scores = torch.matmul(q.transpose(0, 1), keys.transpose(1, 2)) * scale  # [H, L, S]
    query_pos = num_cached + torch.arange(query_len, device=q.device)
    key_pos = torch.arange(seq_len, device=q.device)
    is_future = key_pos[None, :] > query_pos[:, None]  # [L, S]
    scores = scores.masked_fill(is_future, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=compute_dtype(q.dtype)).to(q.dtype)
    return torch.matmul(probs, values).transpose(0, 1)  # [L, H, D]


def paged_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    decode: SlotDecoder | None = None,
    sparse_v: SparseV | None = None,
) -> torch.Tensor:
    """Causal attention of q [T, num_heads, head_dim] over the paged ``kv_cache``; request r owns query rows
    ``query_start_loc[r] .. query_start_loc[r + 1] - 1`` and ``seq_lens[r]`` keys. Rows no request owns
    (padding) come back as zeros. Reads the metadata back to the host (``.tolist()``). ``decode``: the cache is
    packed (a compressed ``kv_cache_dtype``) and this decodes its slots. ``sparse_v``: computed as the kernels
    do with their sparse-V tile skip (``tiled_attention``, float64)."""
    return paged_attention_skips_ref(q, kv_cache, query_start_loc, seq_lens, block_tables, scale, decode,
                                     sparse_v)[0]  # fmt: skip


def paged_attention_skips_ref(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                              seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                              decode: SlotDecoder | None = None, sparse_v: SparseV | None = None,
                              ) -> tuple[torch.Tensor, int]:  # fmt: skip
    """``paged_attention_ref`` and the number of (row, kv head, tile)s whose values the sparse-V rule skipped."""
    out = torch.zeros_like(q)
    num_skipped = 0
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for r, seq_len in enumerate(lens):
        start, end = qsl[r], qsl[r + 1]
        if end == start:
            continue
        if seq_len < end - start:
            raise ValueError(f"request {r}: seq_len {seq_len} < query_len {end - start}")
        keys, values = gather_kv(kv_cache, block_tables[r], seq_len, decode)
        num_cached = seq_len - (end - start)
        if sparse_v is None:
            out[start:end] = causal_attention(q[start:end], keys, values, num_cached, scale)
        else:
            out[start:end], skipped = tiled_attention(q[start:end], keys, values, num_cached, scale, sparse_v)
            num_skipped += skipped
    return out, num_skipped


def tiled_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, num_cached: int, scale: float,
                    sparse_v: SparseV) -> tuple[torch.Tensor, int]:  # fmt: skip
    """One request (``causal_attention``'s arguments) in the kernels' order, in float64: row i's keys
    0..num_cached+i cut by ``split_layout`` into splits of BLOCK_N tiles, online softmax over each split's tiles,
    the splits merged (m = max m_i, l = sum l_i e^(m_i - m), out = sum acc_i e^(m_i - m) / l). After a tile's
    p = exp(s - m_new) and l = l * alpha + sum p, a tile whose largest p / l over the kv head's query heads is
    ``< threshold`` only rescales acc by alpha (its values are skipped). Returns the output [L, H, D] in q's
    dtype and the number of (row, kv head, tile)s skipped. Each row's tiles are computed at once (``_attend_row``:
    the online recurrences in closed form, the same values up to float64 rounding)."""
    query_len, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    q64 = q.to(torch.float64).view(query_len, num_kv_heads, num_heads // num_kv_heads, head_dim)
    k64, v64 = (x.to(torch.float64).transpose(0, 1) for x in (keys, values))  # [H_kv, n, D]
    out = torch.zeros(query_len, num_heads, head_dim, dtype=torch.float64, device=q.device)
    num_skipped = 0
    for i in range(query_len):
        num_keys = num_cached + i + 1
        row_sparse_v = sparse_v if num_keys >= sparse_v.min_keys else sparse_v._replace(threshold=0.0)
        row, skipped = _attend_row(q64[i], k64[:, :num_keys], v64[:, :num_keys], scale, row_sparse_v)
        out[i] = row.flatten(0, 1)
        num_skipped += skipped
    return out.to(q.dtype), num_skipped


def _attend_row(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, sparse_v: SparseV
                ) -> tuple[torch.Tensor, int]:  # fmt: skip
    """One query row, q [H_kv, G, D] over keys / values [H_kv, n, D] (n >= 1): its output [H_kv, G, D] and the
    (kv head, tile)s skipped. Within a split, tile t's running max is the cummax of the tile maxima, its running
    sum l_t = sum over tiles t' <= t of sum_j exp(s_t'j - m_t), and the accumulator at the split's end the sum of
    its kept tiles' exp(s - m) v: what the tile-by-tile recurrences give."""
    num_kv_heads, group, _ = q.shape
    n, block_n = keys.shape[1], sparse_v.block_n
    split_size, num_splits = split_layout(n, block_n, sparse_v.max_splits, sparse_v.min_split_keys)
    tiles_per_split = split_size // block_n
    width = num_splits * split_size  # keys padded to whole splits: scores -inf, never a tile's max
    s = torch.full((num_kv_heads, group, width), float("-inf"), dtype=q.dtype, device=q.device)
    s[..., :n] = (q @ keys.transpose(1, 2)) * scale
    s = s.view(num_kv_heads, group, num_splits, tiles_per_split, block_n)
    m = s.amax(-1).cummax(-1).values  # [H_kv, G, splits, tiles]: the running max after each tile
    m_end = m[..., -1:]  # each split's final max (every split holds a key)
    e = torch.exp(s - m[..., None]).sum(-1)  # a tile's sum of exp(s - its running max)
    l = (e * torch.exp(m - m_end)).cumsum(-1) * torch.exp(m_end - m)  # the running sum after each tile
    ratio = torch.exp(s.amax(-1) - m) / l  # a tile's largest p / l
    is_real = torch.arange(num_splits * tiles_per_split, device=q.device).view(num_splits, tiles_per_split) \
        < -(-n // block_n)
    skip = (ratio.amax(1) < sparse_v.threshold) & is_real  # [H_kv, splits, tiles], over the group's heads
    p = torch.exp(s - m_end[..., None]) * ~skip[:, None, :, :, None]  # kept tiles' weights at the split's end
    v = torch.zeros(num_kv_heads, width, values.shape[-1], dtype=q.dtype, device=q.device)
    v[:, :n] = values
    acc = torch.einsum("hgsk,hskd->hgsd", p.flatten(-2), v.view(num_kv_heads, num_splits, split_size, -1))
    l_end, m_end = l[..., -1], m_end[..., 0]  # [H_kv, G, splits]
    w = torch.exp(m_end - m_end.amax(-1, keepdim=True))
    out = (acc * w[..., None]).sum(-2) / (l_end * w).sum(-1)[..., None]
    return out, int(skip.sum())
