"""GDN's causal conv and gated delta rule for a whole step at once, in torch: the CPU path (ops/conv.py and
ops/gdn.py are the references, request by request, token by token).

``StepRows`` turns a step's slot metadata (the protocol of state_slots.py) into index tensors once per forward; every
GDN layer of the step reuses them:
- the conv reads, for each token, its K taps from the packed inputs and the requests' conv windows (one gather for
  all taps; each output is w_0 x_0 + w_1 x_1 + ... in that order, elementwise, so a row's bits never depend on the
  batch);
- the recurrence runs time-major: step t updates, in place, the states of the requests with more than t query tokens
  (a prefix of the requests sorted by query length), all of them in one set of elementwise ops and sums over d_k,
  the reference's formula (tests/test_cpu_batched_ops.py checks that a request's bits are the same alone and inside
  batches). A plain decode batch whose requests keep their states in consecutive slots (the usual case) updates those
  slots where they are, with no gather and no copy back (``StepRows.in_place``). k^T S and q^T S as batched matrix
  products were slower (~0.2 ms per tiny bmm call on this CPU); ``addcmul_`` for S + k u^T was 2.6x faster than
  mul + add_ but rounds once (a fused multiply-add), which changes the bits, so it is not used.
"""

from dataclasses import dataclass

import torch

from truespec.ops.activation import get_activation
from truespec.ops.gdn import l2norm
from truespec.ops.precision import as_dtype, compute_dtype
from truespec.ops.state_slots import SlotGather, StateSlots


@dataclass(frozen=True)
class StepRows:
    """A step's GDN index tensors (host-built). ``order``: requests by descending query length."""

    num_tokens: int  # token rows the requests own
    src: SlotGather  # the requests' state sources, in ``order``
    windows: SlotGather  # the requests' conv-window sources, in request order
    time_major: torch.Tensor  # [num_tokens]: token rows of step 0 (requests in order), then step 1, ...
    is_token_order: bool  # time_major is 0, 1, .., num_tokens - 1 (one request, or every query 1 token long)
    num_active: list[int]  # per step t: requests with more than t query tokens (a prefix of ``order``)
    # per step t: (positions in order, slots) of kept states (positions 0 .. n - 1 as a slice: a view, no gather)
    kept: list[tuple[torch.Tensor | slice, torch.Tensor] | None]
    taps: torch.Tensor  # [num_tokens, K] rows of cat([x, windows]) a token's conv reads, oldest first
    kept_windows: tuple[torch.Tensor, torch.Tensor]  # ([num_kept, K - 1] rows of cat([x, windows]), slots)
    # one token per request, each kept in its own source slot, the slots consecutive in ``order`` (a plain decode
    # batch): the recurrence updates ssm_state[in_place] where it is, with no gather and no copy back
    in_place: slice | None = None

    @classmethod
    def of(cls, slots: StateSlots, kernel_size: int, device: torch.device | None = None) -> "StepRows":
        """The index tensors on ``device`` (the CPU by default; the torch reference layers on CUDA pass theirs)."""
        order = sorted(range(slots.num_reqs), key=lambda r: -slots.query_len(r))  # stable: ties keep their order
        num_tokens, width = slots.query_start_loc[-1], kernel_size - 1
        max_len = slots.query_len(order[0]) if order else 0
        num_active = [sum(1 for r in order if slots.query_len(r) > t) for t in range(max_len)]
        time_major = [slots.query_start_loc[order[i]] + t for t in range(max_len) for i in range(num_active[t])]

        def row(r: int, p: int) -> int:  # request r's input at query offset p (p < 0: its conv window)
            return slots.query_start_loc[r] + p if p >= 0 else num_tokens + r * width + width + p

        taps, kept, window_rows, window_slots = [], [], [], []
        for r in range(slots.num_reqs):
            taps += [[row(r, t - width + j) for j in range(kernel_size)] for t in range(slots.query_len(r))]
        for t in range(max_len):
            pairs = [(i, s) for i in range(num_active[t]) if (s := slots.kept_slot(order[i], t)) is not None]
            positions = [i for i, _ in pairs]
            at = slice(0, len(pairs)) if positions == list(range(len(pairs))) else _long(positions, device)
            kept.append((at, _long([s for _, s in pairs], device)) if pairs else None)
            for i, s in pairs:
                window_rows.append([row(order[i], t - width + 1 + j) for j in range(width)])
                window_slots.append(s)
        src = [slots.state_src[r] for r in order]
        return cls(num_tokens, SlotGather.of(src), SlotGather.of(slots.state_src),
                   _long(time_major, device), time_major == list(range(num_tokens)), num_active,
                   kept, _long(taps, device).view(-1, kernel_size),
                   (_long(window_rows, device).view(-1, width), _long(window_slots, device)),
                   _in_place(src, kept, window_slots))  # fmt: skip


def _long(values: list, device: torch.device | None) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _in_place(src: list[int], kept: list[tuple[torch.Tensor | slice, torch.Tensor] | None],
              kept_slots: list[int]) -> slice | None:
    """``StepRows.in_place``: the slots src[0] .. src[0] + R - 1 when one step keeps every request's state in its
    source slot and those are consecutive (each request then reads and writes only its own slot)."""
    if len(kept) != 1 or kept[0] is None or not src or src[0] < 0:
        return None
    is_own = kept[0][0] == slice(0, len(src)) and src == list(range(src[0], src[0] + len(src))) and kept_slots == src
    return slice(src[0], src[0] + len(src)) if is_own else None


def causal_conv1d_batched(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, slots: StateSlots,
                          rows: StepRows, activation: str | None = "silu") -> torch.Tensor:  # fmt: skip
    """``causal_conv1d_ref``'s result and conv-window updates for x [T, C], weight [C, K] (or [C, 1, K])."""
    channels, n = x.shape[1], rows.num_tokens
    weight = weight.reshape(channels, -1)
    windows = rows.windows(conv_state)  # [R, C, K-1], read before any slot is written
    inputs = torch.cat([x[:n], windows.transpose(1, 2).reshape(-1, channels)])
    cdt = compute_dtype(x.dtype)  # taps summed in fp32 for 16-bit models (as conv1d does), rounded once
    inputs_c, weight_c = as_dtype(inputs, cdt), as_dtype(weight, cdt)
    taps = inputs_c.index_select(0, rows.taps.flatten()).view(n, weight.shape[1], channels)  # [n, K, C]
    products = (taps * weight_c.t().contiguous()).unbind(1)  # K x [n, C]: w_j x_j of tap j, oldest first
    y = products[0]
    for p in products[1:]:  # w_0 x_0 + w_1 x_1 + ..., left to right
        y = y + p
    y = as_dtype(y, x.dtype)
    y = get_activation(activation)(y) if activation else y
    window_rows, window_slots = rows.kept_windows
    if window_slots.numel():
        kept_windows = inputs.index_select(0, window_rows.flatten()).view(*window_rows.shape, channels)
        conv_state.index_copy_(0, window_slots, kept_windows.transpose(1, 2).contiguous())  # faster than strided
    if n == x.shape[0]:
        return y
    out = torch.zeros_like(x)
    out[:n] = y
    return out


def gdn_recurrent_batched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          ssm_state: torch.Tensor, rows: StepRows, scale: float | None = None,
                          use_qk_l2norm: bool = True) -> torch.Tensor:  # fmt: skip
    """``gdn_recurrent_ref``'s result and state updates (q, k [T, HK, DK], v [T, HV, DV], g, beta [T, HV] in the
    compute dtype), every request of the step in each token step."""
    cdt, repeat, n = ssm_state.dtype, v.shape[1] // q.shape[1], rows.num_tokens
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qc, kc = as_dtype(q[:n], cdt), as_dtype(k[:n], cdt)
    if use_qk_l2norm:
        qc, kc = l2norm(qc), l2norm(kc)
    qc = (qc * scale).repeat_interleave(repeat, dim=1)  # [n, HV, DK]
    kc = kc.repeat_interleave(repeat, dim=1)
    vc, decay, bc = as_dtype(v[:n], cdt), g[:n].exp(), beta[:n]
    tm = rows.time_major
    if not rows.is_token_order:  # time-major: step t's rows are consecutive
        qc, kc, vc, decay, bc = (x.index_select(0, tm) for x in (qc, kc, vc, decay, bc))
    # [R, HV, DK, DV] in ``order``: the slots themselves, or a copy of them (every source read before any write)
    states = ssm_state[rows.in_place] if rows.in_place is not None else rows.src(ssm_state)
    # broadcast views made once, sliced per token step: decay [n, HV, 1, 1], q, k [n, HV, DK, 1], beta [n, HV, 1]
    decay, qc, kc, bc = decay[..., None, None], qc.unsqueeze(-1), kc.unsqueeze(-1), bc.unsqueeze(-1)
    outs, start = [], 0
    for t, num in enumerate(rows.num_active):
        s, now = states[:num], slice(start, start + num)
        start += num
        s.mul_(decay[now])
        k_now = kc[now]
        kv_mem = (s * k_now).sum(dim=-2)  # k^T S: [num, HV, DV]
        delta = (vc[now] - kv_mem) * bc[now]
        s.add_(k_now * delta.unsqueeze(2))
        outs.append((s * qc[now]).sum(dim=-2))  # q^T S
        if rows.kept[t] is not None and rows.in_place is None:
            positions, dst = rows.kept[t]
            ssm_state.index_copy_(0, dst, states[positions] if isinstance(positions, slice)
                                  else states.index_select(0, positions))  # fmt: skip
    if not outs:
        return torch.zeros(*v.shape, dtype=v.dtype, device=v.device)
    res = as_dtype(torch.cat(outs) if len(outs) > 1 else outs[0], v.dtype)  # [n, HV, DV], time-major
    if rows.is_token_order and n == v.shape[0]:
        return res
    out = torch.zeros(*v.shape, dtype=v.dtype, device=v.device)
    return out.index_copy_(0, tm, res)
