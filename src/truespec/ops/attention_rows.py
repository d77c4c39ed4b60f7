"""What the CPU path's batched attention (ops/attention_batched.py) derives from a step's metadata alone: which
requests are computed together, each query row's token row and visible keys, and which cache rows hold each key.
Built once per forward on the host and shared by the step's attention layers (ForwardContext.host_cache).

Requests are grouped: every request whose query is at most ``MAX_BATCHED_QUERY_LEN`` tokens (decodes, verifies,
short chunks) in one group, each longer prefill chunk alone. A group's keys are positions 0 .. S - 1 of each of its
requests (S: the longest context, padded to whole tiles of ``TILE`` keys).
"""

from dataclasses import dataclass, fields, replace

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
        """The rows of a cache of ``block_size`` and ``num_kv_heads``, for ``group_size`` query heads per kv head;
        built on the host, their tensors on the metadata's device (the torch reference layers on CUDA)."""
        qsl, lens, device = query_start_loc.tolist(), seq_lens.tolist(), block_tables.device
        block_tables = block_tables.cpu()
        reqs = [r for r in range(len(lens)) if qsl[r + 1] > qsl[r]]
        for r in reqs:
            if lens[r] < qsl[r + 1] - qsl[r]:
                raise ValueError(f"request {r}: seq_len {lens[r]} < query_len {qsl[r + 1] - qsl[r]}")
        short = [r for r in reqs if qsl[r + 1] - qsl[r] <= MAX_BATCHED_QUERY_LEN]
        groups = ([short] if short else []) + [[r] for r in reqs if qsl[r + 1] - qsl[r] > MAX_BATCHED_QUERY_LEN]
        built = [_group_rows(g, qsl, lens, block_tables, block_size, num_kv_heads, group_size) for g in groups]
        if device.type != "cpu":
            built = [_to_device(g, device) for g in built]
        num_rows = sum(qsl[r + 1] - qsl[r] for r in reqs)
        is_in_order = len(built) == 1 and built[0].out_rows.tolist() == list(range(num_rows))
        return cls(built, num_rows, is_in_order)


def _to_device(group: GroupRows, device: torch.device) -> GroupRows:
    moved = {f.name: getattr(group, f.name).to(device) for f in fields(group)
             if isinstance(getattr(group, f.name), torch.Tensor)}
    return replace(group, **moved)


def _group_rows(group: list[int], qsl: list[int], lens: list[int], block_tables: torch.Tensor, block_size: int,
                num_kv_heads: int, group_size: int) -> GroupRows:  # fmt: skip
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
    return GroupRows(len(group), num_rows, rows, is_row, rows[is_row], ~is_key, kv_slots, pad_keys,
                     *_tile_rows(kv_slots, pad_keys, len(group), num_kv_heads), first_row)  # fmt: skip


def _tile_rows(kv_slots: torch.Tensor, pad_keys: torch.Tensor | None, num_reqs: int,
               num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """``GroupRows.tile_rows`` and ``pad_tile_rows`` from the [R * S] slots and their padding positions."""
    def tile_major(x: torch.Tensor) -> torch.Tensor:  # [R * S] -> [tiles, R, H_kv, TILE]
        return x.view(num_reqs, -1, TILE).permute(1, 0, 2)[:, :, None, :].expand(-1, -1, num_kv_heads, -1)

    tile_rows = (tile_major(kv_slots) * num_kv_heads + torch.arange(num_kv_heads)[None, None, :, None]).flatten()
    if pad_keys is None:
        return tile_rows, None
    is_pad = torch.zeros(kv_slots.shape, dtype=torch.bool)
    is_pad[pad_keys] = True
    return tile_rows, tile_major(is_pad).flatten().nonzero().flatten()


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
