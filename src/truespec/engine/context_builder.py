"""Builds a step's ForwardContext from per-request rows (shared by the target runner and the drafters)."""

from dataclasses import dataclass

import torch

from truespec.forward_context import ForwardContext


@dataclass
class ContextRow:
    block_ids: list[int]  # the request's KV blocks (attention layers)
    start: int  # position of the first query token (= tokens already cached)
    query_len: int
    state_src: int  # flat state slot before this step, -1 = zeros
    state_dst: int  # flat slot that receives the state after query token ``write_start``
    write_start: int  # query offset of the first token whose state is kept
    num_logits: int  # logits for the last ``num_logits`` query tokens


def int_tensor(values: list, device: torch.device) -> torch.Tensor:
    """Host ints -> an int64 tensor on ``device`` (token ids, positions, per-step metadata)."""
    return torch.tensor(values, dtype=torch.int64, device=device)


def build_forward_context(rows: list[ContextRow], block_size: int, device: torch.device) -> ForwardContext:
    query_start_loc, seq_lens, slot_mapping, logits_indices = [0], [], [], []
    for row in rows:
        end = row.start + row.query_len
        slot_mapping += (row.block_ids[p // block_size] * block_size + p % block_size for p in range(row.start, end))
        query_start_loc.append(query_start_loc[-1] + row.query_len)
        seq_lens.append(end)
        logits_indices += range(query_start_loc[-1] - row.num_logits, query_start_loc[-1])
    width = max(len(row.block_ids) for row in rows)

    def t(values: list) -> torch.Tensor:
        return int_tensor(values, device)

    return ForwardContext(
        query_start_loc=t(query_start_loc), seq_lens=t(seq_lens), slot_mapping=t(slot_mapping),
        block_tables=t([row.block_ids + [-1] * (width - len(row.block_ids)) for row in rows]),
        state_src=t([row.state_src for row in rows]), state_dst=t([row.state_dst for row in rows]),
        state_write_start=t([row.write_start for row in rows]), logits_indices=t(logits_indices),
        query_start_loc_cpu=query_start_loc, seq_lens_cpu=seq_lens)
