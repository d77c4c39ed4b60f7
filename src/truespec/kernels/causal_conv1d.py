"""Depthwise causal conv1d (no bias) + SiLU over each request's tokens, continuing its conv window.

The window is the last K-1 conv *inputs* (model dtype). Request r continues the window in slot
``state_src[r]`` (-1: zeros) and, after each query token t >= state_write_start[r], stores the K-1
inputs ending at t into slot ``state_dst[r] + t - state_write_start[r]`` (docs/ARCHITECTURE.md
invariant 2; state_dst -1 = inert). One program per (token, channel block), so prefill chunks run fully parallel.
Because a source slot may lie in the request's own destination group (a verify keeping a window per
position), the starting windows are first copied into a separate buffer [R, C, K-1] by one small gather
kernel: the conv kernel runs after it on the stream, so every read of a source slot precedes every write.
(A gather of only the rows with state_src >= 0: the conv kernel never reads the others, so the buffer needs
no fill, and it is one launch where torch takes two, a clamp and an index_select.)
"""

import torch
import triton
import triton.language as tl

from truespec.kernels.triton_utils import find_request, tl_compute_dtype


@triton.jit
def _conv_input(x_ptr, init_ptr, start, p, has_init, c, c_mask, stride_x_tok, K: tl.constexpr):
    """Conv input at query offset ``p`` of a request (p < 0: column K-1+p of its starting window)."""
    from_x = tl.load(x_ptr + (start + p) * stride_x_tok + c, mask=c_mask & (p >= 0), other=0.0)
    from_window = tl.load(init_ptr + c * (K - 1) + (K - 1 + p), mask=c_mask & (p < 0) & has_init, other=0.0)
    return tl.where(p >= 0, from_x, from_window.to(from_x.dtype))


@triton.jit
def _gather_windows_kernel(
    init_ptr,  # [R, C, K-1], contiguous
    conv_state_ptr,  # [num_slots, C, K-1]
    state_src_ptr,  # [R]
    stride_cs_slot,
    stride_cs_c,
    C: tl.constexpr,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # flat index c * (K-1) + j into the window
    src = tl.load(state_src_ptr + r).to(tl.int64)  # slot * stride: 64-bit
    mask = (i < C * (K - 1)) & (src >= 0)
    window = tl.load(conv_state_ptr + src * stride_cs_slot + (i // (K - 1)) * stride_cs_c + i % (K - 1), mask=mask)
    tl.store(init_ptr + r.to(tl.int64) * (C * (K - 1)) + i, window, mask=mask)


def gather_windows(conv_state: torch.Tensor, state_src: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """[R, C, K-1]: row r is ``conv_state[state_src[r]]``; rows with state_src < 0 are left unwritten.
    ``conv_state`` [num_slots, C, K-1] needs a unit last stride (slots and channels may be strided)."""
    if conv_state.dim() != 3 or conv_state.stride(-1) != 1:
        raise ValueError(f"conv_state {tuple(conv_state.shape)} must be [num_slots, C, K-1] with a unit last stride")
    num_reqs, (_, channels, width) = state_src.shape[0], conv_state.shape  # width = K - 1
    init = torch.empty(num_reqs, channels, width, dtype=conv_state.dtype, device=conv_state.device)
    grid = (num_reqs, triton.cdiv(channels * width, block))
    _gather_windows_kernel[grid](
        init, conv_state, state_src, conv_state.stride(0), conv_state.stride(1), C=channels, K=width + 1, BLOCK=block
    )
    return init


@triton.jit(do_not_specialize=["num_reqs"])
def _causal_conv1d_kernel(
    out_ptr,  # [T, C]
    x_ptr,  # [T, C]
    weight_ptr,  # [C, K], contiguous
    init_ptr,  # [R, C, K-1], contiguous: each request's starting window, gathered before any write (src >= 0)
    conv_state_ptr,  # [num_slots, C, K-1]
    query_start_loc_ptr,  # [R + 1]
    state_src_ptr,  # [R]
    state_dst_ptr,  # [R]
    state_write_start_ptr,  # [R]
    num_reqs,
    stride_x_tok,
    stride_o_tok,
    stride_cs_slot,
    stride_cs_c,
    C: tl.constexpr,
    BLOCK_C: tl.constexpr,
    K: tl.constexpr,
    APPLY_SILU: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
):
    token = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = c < C
    r = find_request(query_start_loc_ptr, num_reqs, token)
    start = tl.load(query_start_loc_ptr + r)
    is_valid = token < tl.load(query_start_loc_ptr + num_reqs)  # rows past the last request are padding
    offset = token - start
    has_init = tl.load(state_src_ptr + r) >= 0
    init_ptr += r * C * (K - 1)

    acc = tl.full([BLOCK_C], 0, ACC_DTYPE)
    for j in tl.static_range(K):
        w = tl.load(weight_ptr + c * K + j, mask=c_mask, other=0.0).to(ACC_DTYPE)
        x = _conv_input(x_ptr, init_ptr, start, offset - (K - 1) + j, has_init, c, c_mask, stride_x_tok, K)
        acc += w * x.to(ACC_DTYPE)
    y = acc.to(out_ptr.dtype.element_ty).to(ACC_DTYPE)  # the conv output rounds to the model dtype first
    if APPLY_SILU:
        y = y / (1.0 + tl.exp(-y))
    y = tl.where(is_valid, y, 0.0)
    tl.store(out_ptr + token * stride_o_tok + c, y.to(out_ptr.dtype.element_ty), mask=c_mask)

    dst = tl.load(state_dst_ptr + r).to(tl.int64)
    write_start = tl.load(state_write_start_ptr + r)
    is_kept = is_valid & (dst >= 0) & (offset >= write_start)
    window_ptr = conv_state_ptr + (dst + offset - write_start) * stride_cs_slot + c * stride_cs_c
    for j in tl.static_range(K - 1):  # the K-1 inputs ending at this token
        x = _conv_input(x_ptr, init_ptr, start, offset - (K - 2) + j, has_init, c, c_mask, stride_x_tok, K)
        tl.store(window_ptr + j, x.to(conv_state_ptr.dtype.element_ty), mask=c_mask & is_kept)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_src: torch.Tensor,
    state_dst: torch.Tensor,
    state_write_start: torch.Tensor,
    activation: str | None = "silu",
    block_c: int = 256,
    num_warps: int = 4,
) -> torch.Tensor:
    """Conv + activation of x [T, C] with weight [C, K] (or nn.Conv1d's [C, 1, K]); updates ``conv_state``
    [num_slots, C, K-1] in place. Returns [T, C] in x's dtype (rows past query_start_loc[R], a graph's
    padding: zeros)."""
    num_tokens, channels = x.shape
    weight = weight.reshape(channels, -1).contiguous()
    kernel = weight.shape[1]
    if conv_state.shape[1:] != (channels, kernel - 1) or conv_state.stride(-1) != 1 or x.stride(-1) != 1:
        raise ValueError(f"x {tuple(x.shape)} / weight K={kernel} do not fit conv_state {tuple(conv_state.shape)}")
    if activation not in ("silu", "swish", None):
        raise ValueError(f"causal_conv1d supports activation 'silu' or None, got {activation!r}")
    out = torch.empty_like(x)
    num_reqs = state_src.shape[0]
    if num_reqs == 0:
        return out.zero_()
    init = gather_windows(conv_state, state_src)  # [R, C, K-1]: every read before the kernel's writes
    grid = (num_tokens, triton.cdiv(channels, block_c))
    _causal_conv1d_kernel[grid](
        out, x, weight, init, conv_state, query_start_loc, state_src, state_dst, state_write_start, num_reqs,
        x.stride(0), out.stride(0), conv_state.stride(0), conv_state.stride(1),
        C=channels, BLOCK_C=block_c, K=kernel, APPLY_SILU=activation is not None,
        ACC_DTYPE=tl_compute_dtype(x.dtype), num_warps=num_warps,
    )  # fmt: skip
    return out

