"""Causal attention over a paged KV cache, in torch: one loop over requests.

kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim] (index 0 = K, 1 = V); flat slot
``block * block_size + offset``. A step first writes its K/V at ``slot_mapping`` (-1 = padding: no write), then
query token i of request r, at absolute position ``p = seq_len - query_len + i``, attends keys ``0..p`` of that
request, gathered through ``block_tables[r]``. Drafted tokens' KV is written before it is read, exactly as in a
plain decode (docs/ARCHITECTURE.md invariant 4).
"""

from collections.abc import Callable

import torch

from truespec.ops.precision import compute_dtype

# a packed cache's read: uint8 slots [S, H, bytes] -> keys, values [S, H, D] (kv_cache/formats.py KVFormat.decode)
SlotDecoder = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


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
) -> torch.Tensor:
    """Causal attention of q [T, num_heads, head_dim] over the paged ``kv_cache``; request r owns query rows
    ``query_start_loc[r] .. query_start_loc[r + 1] - 1`` and ``seq_lens[r]`` keys. Rows no request owns
    (padding) come back as zeros. Reads the metadata back to the host (``.tolist()``). ``decode``: the cache is
    packed (a compressed ``kv_cache_dtype``) and this decodes its slots."""
    out = torch.zeros_like(q)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for r, seq_len in enumerate(lens):
        start, end = qsl[r], qsl[r + 1]
        if end == start:
            continue
        if seq_len < end - start:
            raise ValueError(f"request {r}: seq_len {seq_len} < query_len {end - start}")
        keys, values = gather_kv(kv_cache, block_tables[r], seq_len, decode)
        out[start:end] = causal_attention(q[start:end], keys, values, seq_len - (end - start), scale)
    return out
