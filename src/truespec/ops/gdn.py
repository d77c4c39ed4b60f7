"""Gated DeltaNet's gates and gated delta rule, in torch, token by token for every request of a step.

Gates per token and value head, in the compute dtype (fp32, fp64 for fp64 models):
  g    = -exp(A_log) * softplus(a + dt_bias)     log decay
  beta = sigmoid(b)                              rounded to the model dtype, then to the compute dtype
The rule per token, per value head, with q, k optionally L2-normalised and q scaled:
  S = exp(g) S;  u = beta (v - S^T k);  S = S + k u^T;  o = S^T q.
Each request's state comes from and is kept in slots by the protocol of state_slots.py.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from truespec.ops.precision import as_dtype, compute_dtype
from truespec.ops.state_slots import StateSlots, gather_states

L2NORM_EPS = 1e-6  # FLA's and transformers' l2norm eps


@dataclass(frozen=True)
class GateInputs:
    """The raw inputs of GDN's gates, all in the model dtype (validated here, for every kernel that takes them)."""

    a: torch.Tensor  # [T, HV], the in_proj_a output: unit last stride, any row stride
    b: torch.Tensor  # [T, HV], the in_proj_b output: same
    A_log: torch.Tensor  # [HV], contiguous
    dt_bias: torch.Tensor  # [HV], contiguous

    def __post_init__(self) -> None:
        a, b, A_log, dt_bias = self.a, self.b, self.A_log, self.dt_bias  # noqa: N806
        if a.dim() != 2 or a.dtype != b.dtype or a.device != b.device:
            raise ValueError(f"a {tuple(a.shape)} {a.dtype} and b {b.dtype} must be [T, HV] of one dtype and device")
        num_heads = a.shape[-1]
        if b.shape != a.shape or A_log.shape != (num_heads,) or dt_bias.shape != (num_heads,):
            raise ValueError(
                f"a {tuple(a.shape)}, b {tuple(b.shape)}, A_log {tuple(A_log.shape)}, dt_bias "
                f"{tuple(dt_bias.shape)}: need a, b [T, HV] and A_log, dt_bias [HV]"
            )
        if a.stride(-1) != 1 or b.stride(-1) != 1 or not (A_log.is_contiguous() and dt_bias.is_contiguous()):
            raise ValueError("a and b need a unit last stride; A_log and dt_bias must be contiguous")


def gdn_gating_ref(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor  # noqa: N803
) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b [T, HV] (the in_proj_a / in_proj_b outputs), A_log, dt_bias [HV], all in the model dtype.
    Returns (g, beta), each a contiguous [T, HV] in the compute dtype."""
    cdt = compute_dtype(a.dtype)
    beta = as_dtype(b.sigmoid(), cdt)
    g = -as_dtype(A_log, cdt).exp() * F.softplus(as_dtype(a, cdt) + as_dtype(dt_bias, cdt))
    return g.contiguous(), beta.contiguous()


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps) over the last dim (the FLA / transformers form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_step(
    state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule, per value head.

    state [HV, dk, dv]; q, k [HV, dk]; v [HV, dv]; g, beta [HV]. Returns (new state, output [HV, dv]).
    """
    state = state * g.exp()[:, None, None]
    kv_mem = (state * k[:, :, None]).sum(dim=-2)
    delta = (v - kv_mem) * beta[:, None]
    state = state + k[:, :, None] * delta[:, None, :]
    return state, (state * q[:, :, None]).sum(dim=-2)


def _token_minor(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One request's x [L, H, D] in ``dtype``, stored as [H, D, L] (the layout of the layer's per-request conv
    output). torch's CPU sums reduce in an order that depends on the layout, so every caller fixes this one:
    the same values give the same bits whatever view they arrive as."""
    return x.to(dtype).permute(1, 2, 0).contiguous().permute(2, 0, 1)


def gdn_recurrent_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor | None,
    ssm_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_src: torch.Tensor,
    state_dst: torch.Tensor,
    state_write_start: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    *,
    gate_inputs: GateInputs | None = None,
) -> torch.Tensor:
    """Run the gated delta rule over each request's tokens, updating ``ssm_state`` in place.

    q, k [T, HK, DK] (k-head i serves value heads i * HV/HK ..), v [T, HV, DV]; g, beta [T, HV] in the compute
    dtype, or None with ``gate_inputs`` (then ``gdn_gating_ref``'s); ssm_state [num_slots, HV, DK, DV] in the
    compute dtype. q is scaled by ``scale`` (default DK^-0.5) after the optional L2 norm. Returns o [T, HV, DV]
    in v's dtype (rows no request owns: zeros).
    """
    if gate_inputs is not None:
        g, beta = gdn_gating_ref(gate_inputs.a, gate_inputs.b, gate_inputs.A_log, gate_inputs.dt_bias)
    slots = StateSlots.from_tensors(query_start_loc, state_src, state_dst, state_write_start)
    cdt, repeat = ssm_state.dtype, v.shape[1] // q.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = torch.zeros(*v.shape, dtype=v.dtype, device=v.device)
    states = gather_states(ssm_state, slots.state_src)  # every source read before any slot is written
    for r in range(slots.num_reqs):
        rows = slots.rows(r)
        qr, kr, vr = (_token_minor(x[rows], cdt) for x in (q, k, v))
        if use_qk_l2norm:
            qr, kr = l2norm(qr), l2norm(kr)
        qr, kr = (qr * scale).repeat_interleave(repeat, dim=1), kr.repeat_interleave(repeat, dim=1)
        state, gr, br = states[r], g[rows], beta[rows]
        for t in range(rows.stop - rows.start):
            state, o = gated_delta_step(state, qr[t], kr[t], vr[t], gr[t], br[t])
            out[rows.start + t] = o.to(v.dtype)
            if (slot := slots.kept_slot(r, t)) is not None:
                ssm_state[slot] = state
    return out
