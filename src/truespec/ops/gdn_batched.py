"""GDN's causal conv and gated delta rule for a whole step at once, in torch: the CPU path (ops/conv.py and
ops/gdn.py are the references, request by request, token by token).

``StepRows`` turns a step's slot metadata (the protocol of state_slots.py) into index tensors once per forward; every
GDN layer of the step reuses them:
- the conv reads, for each token, its K taps from the packed inputs and the requests' conv windows (one gather per
  tap; each output is w_0 x_0 + w_1 x_1 + ... in that order, elementwise, so a row's bits never depend on the batch);
- the recurrence runs time-major: step t updates, in place, the states of the requests with more than t query tokens
  (a prefix of the requests sorted by query length), all of them in one set of elementwise ops and sums over d_k,
  the reference's formula (tests/test_cpu_batched_ops.py checks that a request's bits are the same alone and inside
  batches). k^T S and q^T S as batched matrix products were slower: ~0.2 ms per tiny bmm call on this CPU.
"""

from dataclasses import dataclass

import torch

from truespec.ops.activation import get_activation
from truespec.ops.gdn import l2norm
from truespec.ops.precision import compute_dtype
from truespec.ops.state_slots import StateSlots, gather_states


@dataclass(frozen=True)
class StepRows:
    """A step's GDN index tensors (host-built). ``order``: requests by descending query length."""

    num_tokens: int  # token rows the requests own
    src: list[int]  # state source slot per request, in ``order``
    time_major: torch.Tensor  # [num_tokens]: token rows of step 0 (requests in order), then step 1, ...
    num_active: list[int]  # per step t: requests with more than t query tokens (a prefix of ``order``)
    kept: list[tuple[torch.Tensor, torch.Tensor] | None]  # per step t: (positions in order, slots) of kept states
    taps: torch.Tensor  # [num_tokens, K] rows of cat([x, windows]) a token's conv reads, oldest first
    kept_windows: tuple[torch.Tensor, torch.Tensor]  # ([num_kept, K - 1] rows of cat([x, windows]), slots)

    @classmethod
    def of(cls, slots: StateSlots, kernel_size: int) -> "StepRows":
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
            kept.append((torch.tensor([i for i, _ in pairs]), torch.tensor([s for _, s in pairs])) if pairs else None)
            for i, s in pairs:
                window_rows.append([row(order[i], t - width + 1 + j) for j in range(width)])
                window_slots.append(s)
        return cls(num_tokens, [slots.state_src[r] for r in order], torch.tensor(time_major, dtype=torch.long),
                   num_active, kept, torch.tensor(taps, dtype=torch.long).view(-1, kernel_size),
                   (torch.tensor(window_rows, dtype=torch.long).view(-1, width),
                    torch.tensor(window_slots, dtype=torch.long)))  # fmt: skip


def causal_conv1d_batched(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, slots: StateSlots,
                          rows: StepRows, activation: str | None = "silu") -> torch.Tensor:  # fmt: skip
    """``causal_conv1d_ref``'s result and conv-window updates for x [T, C], weight [C, K] (or [C, 1, K])."""
    channels = x.shape[1]
    weight = weight.reshape(channels, -1)
    width = weight.shape[1] - 1
    windows = gather_states(conv_state, slots.state_src)  # [R, C, K-1], read before any slot is written
    inputs = torch.cat([x[: rows.num_tokens], windows.transpose(1, 2).reshape(-1, channels)])
    cdt = compute_dtype(x.dtype)  # taps summed in fp32 for 16-bit models (as conv1d does), rounded once
    inputs_c, weight_c = inputs.to(cdt), weight.to(cdt)
    y = inputs_c[rows.taps[:, 0]] * weight_c[:, 0]
    for j in range(1, width + 1):
        y = y + inputs_c[rows.taps[:, j]] * weight_c[:, j]
    y = y.to(x.dtype)
    out = torch.zeros_like(x)
    out[: rows.num_tokens] = get_activation(activation)(y) if activation else y
    window_rows, window_slots = rows.kept_windows
    if window_slots.numel():
        conv_state.index_copy_(0, window_slots, inputs[window_rows].transpose(1, 2))
    return out


def gdn_recurrent_batched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          ssm_state: torch.Tensor, rows: StepRows, scale: float | None = None,
                          use_qk_l2norm: bool = True) -> torch.Tensor:  # fmt: skip
    """``gdn_recurrent_ref``'s result and state updates (q, k [T, HK, DK], v [T, HV, DV], g, beta [T, HV] in the
    compute dtype), every request of the step in each token step."""
    cdt, repeat, n = ssm_state.dtype, v.shape[1] // q.shape[1], rows.num_tokens
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qc, kc = q[:n].to(cdt), k[:n].to(cdt)
    if use_qk_l2norm:
        qc, kc = l2norm(qc), l2norm(kc)
    tm = rows.time_major
    qc = (qc * scale).repeat_interleave(repeat, dim=1)[tm]  # [n, HV, DK], time-major
    kc = kc.repeat_interleave(repeat, dim=1)[tm]
    vc, decay, bc = v[:n].to(cdt)[tm], g[:n][tm].exp(), beta[:n][tm]
    states = gather_states(ssm_state, rows.src)  # [R, HV, DK, DV] in ``order``; every source read first
    outs, start = [], 0
    for t, num in enumerate(rows.num_active):
        s, now = states[:num], slice(start, start + num)
        start += num
        s.mul_(decay[now][..., None, None])
        kv_mem = (s * kc[now][..., None]).sum(dim=-2)  # k^T S: [num, HV, DV]
        delta = (vc[now] - kv_mem) * bc[now][..., None]
        s.add_(kc[now][..., None] * delta[:, :, None, :])
        outs.append((s * qc[now][..., None]).sum(dim=-2))  # q^T S
        if rows.kept[t] is not None:
            positions, dst = rows.kept[t]
            ssm_state.index_copy_(0, dst, states[positions])
    out = torch.zeros(*v.shape, dtype=v.dtype, device=v.device)
    if outs:
        out[tm] = torch.cat(outs).to(v.dtype)
    return out
