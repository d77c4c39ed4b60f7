"""What the CPU path's batched attention (ops/attention_batched.py) derives from a step's metadata alone: which
requests are computed together, each query row's token row and visible keys, and which cache rows hold each key.
Built once per forward on the host and shared by the step's attention layers (ForwardContext.host_cache).

Requests are grouped: every request whose query is at most ``MAX_BATCHED_QUERY_LEN`` tokens (decodes, verifies,
short chunks) in one group, each longer prefill chunk alone. A group's keys are positions 0 .. S - 1 of each of its
requests (S: the longest context, padded to whole tiles of ``TILE`` keys).
"""

from dataclasses import dataclass

import numpy as np
import torch

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
    # [tiles * R * H_kv * TILE] rows of the cache viewed as [num_slots * H_kv, D] (slot * H_kv + kv head), in the
    # tile-major order the tile loop reads (tile, request, kv head, key): one gather gives that layout
    tile_rows: torch.Tensor
    pad_tile_rows: torch.Tensor | None  # indices into tile_rows of padding positions (values zeroed)
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
           num_kv_heads: int, group_size: int) -> "StepAttentionRows":  # fmt: skip
        """The rows of a cache of ``block_size`` and ``num_kv_heads``, for ``group_size`` query heads per kv head."""
        qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
        reqs = [r for r in range(len(lens)) if qsl[r + 1] > qsl[r]]
        for r in reqs:
            if lens[r] < qsl[r + 1] - qsl[r]:
                raise ValueError(f"request {r}: seq_len {lens[r]} < query_len {qsl[r + 1] - qsl[r]}")
        short = [r for r in reqs if qsl[r + 1] - qsl[r] <= MAX_BATCHED_QUERY_LEN]
        groups = ([short] if short else []) + [[r] for r in reqs if qsl[r + 1] - qsl[r] > MAX_BATCHED_QUERY_LEN]
        built = [_group_rows(g, qsl, lens, block_tables, block_size, num_kv_heads, group_size) for g in groups]
        num_rows = sum(qsl[r + 1] - qsl[r] for r in reqs)
        is_in_order = len(built) == 1 and built[0].out_rows.tolist() == list(range(num_rows))
        return cls(built, num_rows, is_in_order)


def _group_rows(group: list[int], qsl: list[int], lens: list[int], block_tables: torch.Tensor, block_size: int,
                num_kv_heads: int, group_size: int) -> GroupRows:  # fmt: skip
    """Built in numpy (a few small arrays: numpy's calls cost a fraction of torch's dispatch), handed over as tensors
    on the block tables' device."""
    starts, query_lens = np.array([qsl[r] for r in group]), np.array([qsl[r + 1] - qsl[r] for r in group])
    seq_lens = np.array([lens[r] for r in group])
    num_rows, num_keys = int(query_lens.max()), -(-int(seq_lens.max()) // TILE) * TILE
    offsets = np.arange(num_rows)[None, :]
    is_row = offsets < query_lens[:, None]  # [R, L]
    rows = starts[:, None] + np.where(is_row, offsets, 0)  # padding: the request's first row
    # row (i, j) sees keys 0 .. limit - 1 (padding rows: key 0 only, so no row is all -inf)
    limit = np.where(is_row, (seq_lens - query_lens)[:, None] + offsets + 1, 1)
    is_masked = np.arange(num_keys)[None, None, None, :] >= limit[:, :, None, None]  # [R, L, 1, S]
    is_masked = np.broadcast_to(is_masked, (len(group), num_rows, group_size, num_keys)).reshape(len(group), 1, -1,
                                                                                                  num_keys)  # fmt: skip
    tables = block_tables[group].cpu().numpy() if block_tables.device.type != "cpu" else block_tables.numpy()[group]
    kv_slots, is_pad = _kv_slots(tables, seq_lens, num_keys, block_size)
    flat = rows.ravel()
    first_row = int(flat[0]) if is_row.all() and (flat == np.arange(flat[0], flat[0] + flat.size)).all() else None
    tile_rows, pad_tile_rows = _tile_rows(kv_slots, is_pad, len(group), num_kv_heads)
    pad_keys = np.flatnonzero(is_pad) if is_pad.any() else None
    on = block_tables.device
    return GroupRows(len(group), num_rows, _tensor(rows, on), _tensor(is_row, on), _tensor(rows[is_row], on),
                     _tensor(is_masked, on), _tensor(kv_slots, on), _tensor(pad_keys, on), _tensor(tile_rows, on),
                     _tensor(pad_tile_rows, on), first_row)  # fmt: skip


def _tensor(x: np.ndarray | None, device: torch.device) -> torch.Tensor | None:
    """A host array as a tensor (int64 or bool) on ``device``; None stays None."""
    if x is None:
        return None
    x = np.ascontiguousarray(x, dtype=bool if x.dtype == bool else np.int64)
    t = torch.from_numpy(x if x.flags.writeable else x.copy())  # a broadcast view is read-only
    return t if device.type == "cpu" else t.to(device)


def _tile_rows(kv_slots: np.ndarray, is_pad: np.ndarray, num_reqs: int,
               num_kv_heads: int) -> tuple[np.ndarray, np.ndarray | None]:  # fmt: skip
    """``GroupRows.tile_rows`` and ``pad_tile_rows`` from the [R * S] slots and which of them are padding."""
    def tile_major(x: np.ndarray) -> np.ndarray:  # [R * S] -> [tiles, R, H_kv, TILE]
        x = x.reshape(num_reqs, -1, TILE).transpose(1, 0, 2)[:, :, None, :]
        return np.broadcast_to(x, (x.shape[0], num_reqs, num_kv_heads, TILE))

    tile_rows = (tile_major(kv_slots) * num_kv_heads + np.arange(num_kv_heads)[None, None, :, None]).ravel()
    return tile_rows, (np.flatnonzero(tile_major(is_pad)) if is_pad.any() else None)


def _kv_slots(block_tables: np.ndarray, seq_lens: np.ndarray, num_keys: int,
              block_size: int) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """The flat cache slot of each request's key positions 0 .. num_keys - 1 ([R * S], 0 at or past its
    ``seq_lens`` and in a padding request's block -1), and which of them are such padding positions ([R * S])."""
    positions = np.arange(num_keys)
    blocks = np.minimum(positions // block_size, block_tables.shape[1] - 1)
    slots = block_tables[:, blocks] * block_size + positions % block_size
    is_key = (positions[None, :] < seq_lens[:, None]) & (slots >= 0)  # [R, S]
    return np.where(is_key, slots, 0).ravel(), ~is_key.ravel()
