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
    dtype and the number of (row, kv head, tile)s skipped."""
    query_len, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    group = num_heads // num_kv_heads
    q64, k64, v64 = (x.to(torch.float64) for x in (q, keys, values))
    out = torch.zeros(query_len, num_heads, head_dim, dtype=torch.float64, device=q.device)
    num_skipped = 0
    for i in range(query_len):
        num_keys = num_cached + i + 1
        split_size, _ = split_layout(num_keys, sparse_v.block_n, sparse_v.max_splits, sparse_v.min_split_keys)
        row_sparse_v = sparse_v if num_keys >= sparse_v.min_keys else sparse_v._replace(threshold=0.0)
        for h in range(num_kv_heads):
            heads = slice(h * group, (h + 1) * group)
            bounds = [(start, min(start + split_size, num_keys)) for start in range(0, num_keys, split_size)]
            splits = [_attend_split(q64[i, heads], k64[a:b, h], v64[a:b, h], scale, row_sparse_v) for a, b in bounds]
            m_i, l_i, acc_i = (torch.stack(x) for x in list(zip(*splits, strict=True))[:3])  # [splits, G, ...]
            w = torch.exp(m_i - m_i.amax(0))
            out[i, heads] = (acc_i * w[..., None]).sum(0) / (l_i * w).sum(0)[:, None]
            num_skipped += sum(split[3] for split in splits)
    return out.to(q.dtype), num_skipped


def _attend_split(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, sparse_v: SparseV
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:  # fmt: skip
    """q [G, D] over one split's keys / values [n, D] (n >= 1), tile by tile: (m [G], l [G], acc [G, D], skipped)."""
    m = torch.full(q.shape[:1], float("-inf"), dtype=q.dtype, device=q.device)
    l = torch.zeros_like(m)
    acc = torch.zeros_like(q)
    num_skipped = 0
    for tile in range(0, keys.shape[0], sparse_v.block_n):
        k, v = keys[tile : tile + sparse_v.block_n], values[tile : tile + sparse_v.block_n]
        s = (q @ k.T) * scale  # [G, n_tile]
        m_new = torch.maximum(m, s.amax(1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new[:, None])
        l = l * alpha + p.sum(1)
        if ((p.amax(1) / l).amax() < sparse_v.threshold).item():
            acc = acc * alpha[:, None]
            num_skipped += 1
        else:
            acc = acc * alpha[:, None] + p @ v
        m = m_new
    return m, l, acc, num_skipped
