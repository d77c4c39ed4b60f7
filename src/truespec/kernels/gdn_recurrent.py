"""Gated delta rule, token by token, for every request of a step (decode, verify and prefill chunks).

One program per (value tile, value head, request): it loads the request's initial state tile
``ssm_state[state_src[r], h, :, tile]`` (zeros if -1) into registers *before* writing anything, runs
the request's tokens in order and, after each token t >= state_write_start[r], stores the state tile
to slot ``state_dst[r] + t - state_write_start[r]`` (docs/ARCHITECTURE.md invariant 2; state_dst -1 = inert).
A program only ever touches its own (head, tile) of any slot, so a source slot inside the request's
own destination group is safe. (Two requests must not share slots: the engine's slot accounting.)

One more program per (value tile, value head), request index R, writes zeros to the output rows owned by
no request (query_start_loc[R] .. T-1: a CUDA graph's padding; rows are packed by query_start_loc, so
only the tail can be unowned), so the output needs no separate fill launch.

The gates g, beta [T, HV] come either as tensors (``gdn_gating``'s) or raw (``GateInputs``): then each
program computes its head's gates per token with ``gdn_gating``'s own arithmetic (the shared ``gdn_gates``,
same bits), which saves the gating launch.

Per token, in fp32 (fp64 for fp64), with q, k optionally L2-normalised here and q scaled:
  S = exp(g) S;  u = beta (v - S^T k);  S = S + k u^T;  o = S^T q.
This token loop is exact but sequential over a request's tokens; long prefill chunks can go through fla's
chunked (WY / UT-transform) kernel instead (gdn_chunked.py).
"""

import torch
import triton
import triton.language as tl

from truespec.kernels.gdn_gating import SOFTPLUS_THRESHOLD, gdn_gates
from truespec.kernels.triton_utils import reduce_sum, tl_compute_dtype
from truespec.ops.gdn import L2NORM_EPS, GateInputs
from truespec.ops.precision import compute_dtype


@triton.jit
def _load_token(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, a_ptr, b_ptr, t, is_token, hk, h, kk, vv, k_mask, v_mask,
                stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head, stride_g_tok,
                stride_beta_tok, stride_a_tok, stride_b_tok, FUSED_GATES: tl.constexpr):
    """Token t's q, k [DK_PAD], v [BV] and gate inputs (a, b with FUSED_GATES, else g, beta), as stored (zeros
    unless ``is_token``)."""
    q = tl.load(q_ptr + t * stride_q_tok + hk * stride_q_head + kk, mask=k_mask & is_token, other=0.0)
    k = tl.load(k_ptr + t * stride_k_tok + hk * stride_k_head + kk, mask=k_mask & is_token, other=0.0)
    v = tl.load(v_ptr + t * stride_v_tok + h * stride_v_head + vv, mask=v_mask & is_token, other=0.0)
    if FUSED_GATES:
        ga = tl.load(a_ptr + t * stride_a_tok + h, mask=is_token, other=0.0)
        gb = tl.load(b_ptr + t * stride_b_tok + h, mask=is_token, other=0.0)
    else:
        ga = tl.load(g_ptr + t * stride_g_tok + h, mask=is_token, other=0.0)
        gb = tl.load(beta_ptr + t * stride_beta_tok + h, mask=is_token, other=0.0)
    return q, k, v, ga, gb


@triton.jit(do_not_specialize=["num_reqs", "num_tokens"])
def _gdn_recurrent_kernel(
    out_ptr,  # [T, HV, DV]
    q_ptr,  # [T, HK, DK]
    k_ptr,  # [T, HK, DK]
    v_ptr,  # [T, HV, DV]
    g_ptr,  # [T, HV] log decay (read unless FUSED_GATES)
    beta_ptr,  # [T, HV]
    a_ptr,  # [T, HV] raw gate inputs in the model dtype (read only with FUSED_GATES)
    b_ptr,  # [T, HV]
    A_log_ptr,  # [HV]
    dt_bias_ptr,  # [HV]
    ssm_state_ptr,  # [num_slots, HV, DK, DV]
    query_start_loc_ptr,  # [R + 1]
    state_src_ptr,  # [R]
    state_dst_ptr,  # [R]
    state_write_start_ptr,  # [R]
    num_reqs,
    num_tokens,
    scale: tl.float64,
    eps: tl.float64,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_o_tok,
    stride_o_head,
    stride_g_tok,
    stride_beta_tok,
    stride_a_tok,
    stride_b_tok,
    stride_s_slot,
    stride_s_head,
    stride_s_k,
    HV_PER_HK: tl.constexpr,  # k-head i serves value heads i*HV_PER_HK .. +HV_PER_HK-1
    DK: tl.constexpr,
    DK_PAD: tl.constexpr,
    DV: tl.constexpr,
    BV: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    FUSED_GATES: tl.constexpr,
    THRESHOLD: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
):
    v_tile = tl.program_id(0)
    h = tl.program_id(1)
    r = tl.program_id(2)
    hk = h // HV_PER_HK
    # Program r == num_reqs owns no request: its token loop is empty and it zero-fills the unowned tail.
    is_request = r < num_reqs
    start = tl.load(query_start_loc_ptr + r)
    end = tl.where(is_request, tl.load(query_start_loc_ptr + r + 1, mask=is_request, other=0), start)
    src = tl.load(state_src_ptr + r, mask=is_request, other=-1).to(tl.int64)  # slot * stride: 64-bit
    dst = tl.load(state_dst_ptr + r, mask=is_request, other=-1).to(tl.int64)
    write_start = tl.load(state_write_start_ptr + r, mask=is_request, other=0)

    kk = tl.arange(0, DK_PAD)
    vv = v_tile * BV + tl.arange(0, BV)
    k_mask = kk < DK
    v_mask = vv < DV
    s_mask = k_mask[:, None] & v_mask[None, :]
    s_off = h * stride_s_head + kk[:, None] * stride_s_k + vv[None, :]  # [DK_PAD, BV]
    state = tl.load(ssm_state_ptr + src * stride_s_slot + s_off, mask=s_mask & (src >= 0), other=0.0)
    state = state.to(ACC_DTYPE)
    scale_acc = tl.full([], scale, ACC_DTYPE)
    eps_acc = tl.full([], eps, ACC_DTYPE)
    if FUSED_GATES:
        A_log = tl.load(A_log_ptr + h).to(ACC_DTYPE)
        dt_bias = tl.load(dt_bias_ptr + h).to(ACC_DTYPE)
    # token t + 1's inputs are loaded while token t computes: their latency is off the recurrence's critical path
    q_next, k_next, v_next, ga_next, gb_next = _load_token(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, a_ptr, b_ptr, start, start < end, hk, h, kk, vv, k_mask, v_mask,
        stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head, stride_g_tok,
        stride_beta_tok, stride_a_tok, stride_b_tok, FUSED_GATES)
    for t in range(start, end):
        q, k, v, ga, gb = q_next, k_next, v_next, ga_next, gb_next
        q_next, k_next, v_next, ga_next, gb_next = _load_token(
            q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, a_ptr, b_ptr, t + 1, t + 1 < end, hk, h, kk, vv, k_mask, v_mask,
            stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head, stride_g_tok,
            stride_beta_tok, stride_a_tok, stride_b_tok, FUSED_GATES)
        q = q.to(ACC_DTYPE)
        k = k.to(ACC_DTYPE)
        if USE_QK_L2NORM:  # x * rsqrt(sum x^2 + eps), as ops/gdn.py's l2norm
            q = q * (1.0 / tl.sqrt(reduce_sum(q * q, 0) + eps_acc))
            k = k * (1.0 / tl.sqrt(reduce_sum(k * k, 0) + eps_acc))
        q = q * scale_acc
        v = v.to(ACC_DTYPE)
        if FUSED_GATES:
            g, beta = gdn_gates(ga.to(ACC_DTYPE), gb.to(ACC_DTYPE), A_log, dt_bias, THRESHOLD,
                                a_ptr.dtype.element_ty)
        else:
            g = ga.to(ACC_DTYPE)
            beta = gb.to(ACC_DTYPE)
        state = state * tl.exp(g)
        delta = (v - reduce_sum(state * k[:, None], 0)) * beta  # [BV]
        state = state + k[:, None] * delta[None, :]
        o = reduce_sum(state * q[:, None], 0)  # [BV]
        tl.store(out_ptr + t * stride_o_tok + h * stride_o_head + vv, o.to(out_ptr.dtype.element_ty), mask=v_mask)
        offset = t - start
        is_kept = (dst >= 0) & (offset >= write_start)
        dst_ptr = ssm_state_ptr + (dst + offset - write_start) * stride_s_slot + s_off
        tl.store(dst_ptr, state.to(ssm_state_ptr.dtype.element_ty), mask=s_mask & is_kept)
    zeros = tl.full([BV], 0, out_ptr.dtype.element_ty)
    for t in range(end, tl.where(is_request, end, num_tokens)):  # empty for a request's program
        tl.store(out_ptr + t * stride_o_tok + h * stride_o_head + vv, zeros, mask=v_mask)


def gdn_recurrent(
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
    block_v: int | None = None,
    num_warps: int = 1,
    *,
    gate_inputs: GateInputs | None = None,
) -> torch.Tensor:
    """Run the gated delta rule over each request's tokens, updating ``ssm_state`` in place.

    q, k [T, HK, DK] and v [T, HV, DV] in any float dtype (strided views of the conv output are fine;
    k-heads are shared by HV // HK value heads, no repeat needed); g, beta [T, HV] in the compute dtype,
    or None with ``gate_inputs`` (the raw a, b, A_log, dt_bias: gates computed in-kernel, bitwise as
    ``gdn_gating``); ssm_state [num_slots, HV, DK, DV] in the compute dtype. q is scaled by ``scale``
    (default DK^-0.5) after the optional L2 norm. Returns o [T, HV, DV] in v's dtype (rows past
    query_start_loc[R], a graph's padding: zeros; requests are packed from row 0). ``block_v`` / ``num_warps``
    only tune speed (benchmarks/tune_decode_kernels.py: one warp per [DK, 32] state tile is the fastest on an
    H200 from BS 1 to 128); they are fixed, never chosen per batch, so a request's arithmetic does not depend
    on the batch it is in (invariant 4).
    """
    num_tokens, num_k_heads, head_k_dim = q.shape
    _, num_v_heads, head_v_dim = v.shape
    if ssm_state.shape[1:] != (num_v_heads, head_k_dim, head_v_dim) or num_v_heads % num_k_heads != 0:
        raise ValueError(f"q {tuple(q.shape)} / v {tuple(v.shape)} do not fit ssm_state {tuple(ssm_state.shape)}")
    g, beta, a, b, A_log, dt_bias = _gate_tensors(g, beta, gate_inputs, ssm_state.dtype)  # noqa: N806
    if g.shape != (num_tokens, num_v_heads) or beta.shape != g.shape:
        raise ValueError(f"gates {tuple(g.shape)} / {tuple(beta.shape)} must be [T, HV] = {(num_tokens, num_v_heads)}")
    if any(x.stride(-1) != 1 for x in (q, k, v, g, beta, ssm_state)) or k.shape != q.shape:
        raise ValueError("q, k, v, g, beta, ssm_state need a unit last stride; k must match q")
    out = torch.empty(num_tokens, num_v_heads, head_v_dim, dtype=v.dtype, device=v.device)  # the kernel fills all
    num_reqs = state_src.shape[0]
    block_v = block_v or min(32, triton.next_power_of_2(head_v_dim))
    if num_reqs == 0:
        return out.zero_()
    grid = (triton.cdiv(head_v_dim, block_v), num_v_heads, num_reqs + 1)  # + 1: the unowned rows' zeros
    _gdn_recurrent_kernel[grid](
        out, q, k, v, g, beta, a, b, A_log, dt_bias, ssm_state, query_start_loc, state_src, state_dst,
        state_write_start, num_reqs, num_tokens, head_k_dim**-0.5 if scale is None else scale, L2NORM_EPS,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        g.stride(0), beta.stride(0), a.stride(0), b.stride(0), ssm_state.stride(0), ssm_state.stride(1),
        ssm_state.stride(2), HV_PER_HK=num_v_heads // num_k_heads, DK=head_k_dim,
        DK_PAD=triton.next_power_of_2(head_k_dim), DV=head_v_dim, BV=block_v, USE_QK_L2NORM=use_qk_l2norm,
        FUSED_GATES=gate_inputs is not None, THRESHOLD=SOFTPLUS_THRESHOLD,
        ACC_DTYPE=tl_compute_dtype(ssm_state.dtype), num_warps=num_warps,
    )  # fmt: skip
    return out


def _gate_tensors(
    g: torch.Tensor | None, beta: torch.Tensor | None, gate_inputs: GateInputs | None, state_dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """The kernel's (g, beta, a, b, A_log, dt_bias) arguments; the pointers it does not read repeat g, beta."""
    if gate_inputs is None:
        if g is None or beta is None:
            raise ValueError("pass g and beta, or gate_inputs")
        return g, beta, g, beta, g, beta
    if g is not None or beta is not None:
        raise ValueError("with gate_inputs, g and beta are computed in the kernel: pass None for both")
    if compute_dtype(gate_inputs.a.dtype) != state_dtype:  # gdn_gating computes in a's compute dtype
        raise ValueError(f"gate inputs in {gate_inputs.a.dtype} need a {compute_dtype(gate_inputs.a.dtype)} state")
    a, b = gate_inputs.a, gate_inputs.b
    return a, b, a, b, gate_inputs.A_log, gate_inputs.dt_bias

