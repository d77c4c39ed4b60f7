"""Depthwise causal conv1d (no bias) + SiLU over each request's tokens, continuing its conv window.

The window is the last K-1 conv *inputs* (model dtype). Request r continues the window in slot
``state_src[r]`` (-1: zeros) and, after each query token t >= state_write_start[r], stores the K-1
inputs ending at t into slot ``state_dst[r] + t - state_write_start[r]`` (docs/ARCHITECTURE.md
invariant 2; state_dst -1 = inert).
One program computes a tile of BLOCK_T consecutive packed rows x BLOCK_C channels, which may span several requests:
it finds each row's request by a vectorised binary search over query_start_loc, loads the K shifted input tiles
(rows before a request's start from its starting window) and sums them per element in the same order as a
program per row would, so tiling changes no bit. Kept rows store their window from the inputs already loaded,
other rows load nothing more; padding rows (past query_start_loc[R]) load nothing and output zeros. The grid
depends on T and C only, so the kernel replays inside CUDA graphs. The tile changes no conv output bit: steps of
up to SMALL_STEP_TOKENS rows keep one row a program (the decode launch), longer ones tiles of 4 rows x 256 channels,
where a tile whose rows are all of one request, past its first K-1 tokens and keeping no window, skips the window
logic (``plain_tiles``); measured in benchmarks/causal_conv1d_speed.py (BENCHMARKS.md, sessions 21 and 25).
``l2norm_rows`` (below) is the exception: a norm is a Triton sum, whose order follows the tile's layout, so with it
every step takes the long steps' tiling.
Because a source slot may lie in the request's own destination group (a verify keeping a window per
position), the starting windows are first copied into a separate buffer [R, C, K-1] by one small gather
kernel: the conv kernel runs after it on the stream, so every read of a source slot precedes every write.
(A gather of only the rows with state_src >= 0: the conv kernel never reads the others, so the buffer needs
no fill, and it is one launch where torch takes two, a clamp and an index_select.)

``split`` (widths summing to C) writes the output as that many separate contiguous [T, width] tensors instead of one
[T, C] (optionally in a wider ``out_dtype`` holding exactly the x-dtype values): fla's chunk kernel takes q, k, v
contiguous (kernels/gdn_chunked.py), which otherwise costs a strided copy of each. With it, ``l2norm_rows``
L2-normalises the q / k heads of the requests it flags in the epilogue, as fla's own l2norm would (two launches a
layer fewer).
"""

import torch
import triton
import triton.language as tl

from truespec.kernels.triton_utils import find_requests, reduce_max, reduce_min, reduce_sum, tl_compute_dtype

SMALL_STEP_TOKENS = 256  # up to this many rows (decode / verify steps, graph sizes) one row a program; tiles above


@triton.jit
def _conv_inputs(x_ptr, init_rows, start, p, has_init, c, mask, stride_x_tok, K: tl.constexpr):
    """Conv inputs [BLOCK_T, BLOCK_C] at query offset ``p`` [BLOCK_T] of each row's request (p < 0: column K-1+p
    of its starting window, whose [C, K-1] block begins at ``init_rows``)."""
    is_x = (p >= 0)[:, None]
    x_rows = (start + p).to(tl.int64) * stride_x_tok
    from_x = tl.load(x_ptr + x_rows[:, None] + c[None, :], mask=mask & is_x, other=0.0)
    window_ptr = init_rows[:, None] + (c * (K - 1))[None, :] + (K - 1 + p)[:, None]
    from_window = tl.load(window_ptr, mask=mask & ((p < 0) & has_init)[:, None], other=0.0)
    return tl.where(is_x, from_x, from_window.to(from_x.dtype))


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


@triton.jit(do_not_specialize=["num_tokens", "num_reqs"])
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
    num_tokens,
    num_reqs,
    stride_x_tok,
    stride_o_tok,
    stride_cs_slot,
    stride_cs_c,
    split_1,  # SPLIT: channels [0, split_1), [split_1, split_2), [split_2, C) go to three [T, width] blocks of out
    split_2,
    l2norm_rows_ptr,  # [R], L2NORM: nonzero for the requests whose q / k are normalised
    C: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    K: tl.constexpr,
    APPLY_SILU: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    SPLIT: tl.constexpr,
    PLAIN_TILES: tl.constexpr,
    L2NORM: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    L2NORM_EPS: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T] packed rows, of any requests
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = c < C
    r = find_requests(query_start_loc_ptr, num_reqs, tokens)
    start = tl.load(query_start_loc_ptr + r)
    is_valid = tokens < tl.load(query_start_loc_ptr + num_reqs)  # rows past the last request are padding
    offset = tokens - start
    has_init = tl.load(state_src_ptr + r) >= 0
    init_rows = init_ptr + r * (C * (K - 1))
    mask = is_valid[:, None] & c_mask[None, :]  # padding rows load nothing

    dst = tl.load(state_dst_ptr + r).to(tl.int64)
    write_start = tl.load(state_write_start_ptr + r)
    is_kept = is_valid & (dst >= 0) & (offset >= write_start)
    window_ptr = conv_state_ptr + ((dst + offset - write_start) * stride_cs_slot)[:, None] + (c * stride_cs_c)[None, :]
    keep_mask = is_kept[:, None] & c_mask[None, :]

    acc = tl.full([BLOCK_T, BLOCK_C], 0, ACC_DTYPE)
    is_plain = False
    if PLAIN_TILES:  # every row valid, of one request, past its first K-1 tokens, keeping no window
        is_special = (~is_valid | is_kept | (offset < K - 1)).to(tl.int32)
        is_plain = (reduce_max(is_special, 0) == 0) & (reduce_max(r, 0) == reduce_min(r, 0))
    if is_plain:  # the same products in the same order, from plain shifted row loads
        for j in tl.static_range(K):
            w = tl.load(weight_ptr + c * K + j, mask=c_mask, other=0.0).to(ACC_DTYPE)
            x_rows = (tokens - (K - 1) + j).to(tl.int64) * stride_x_tok
            x = tl.load(x_ptr + x_rows[:, None] + c[None, :], mask=c_mask[None, :], other=0.0)
            acc += w[None, :] * x.to(ACC_DTYPE)
    else:
        for j in tl.static_range(K):
            w = tl.load(weight_ptr + c * K + j, mask=c_mask, other=0.0).to(ACC_DTYPE)
            x = _conv_inputs(x_ptr, init_rows, start, offset - (K - 1) + j, has_init, c, mask, stride_x_tok, K)
            acc += w[None, :] * x.to(ACC_DTYPE)
            if j > 0:  # inputs 1..K-1 are the window ending at the row: kept rows store them, from these registers
                tl.store(window_ptr + (j - 1), x.to(conv_state_ptr.dtype.element_ty), mask=keep_mask)
    y = acc.to(x_ptr.dtype.element_ty).to(ACC_DTYPE)  # the conv output rounds to the model dtype first
    if APPLY_SILU:
        y = y / (1.0 + tl.exp(-y))
    y = tl.where(is_valid[:, None], y, 0.0).to(x_ptr.dtype.element_ty)  # the x-dtype value, whatever out's dtype
    if L2NORM:  # the flagged requests' q / k heads (channels below split_2), L2-normalised as fla's l2norm, in fp32
        y = y.to(tl.float32)
        heads = tl.reshape(y, [BLOCK_T, BLOCK_C // HEAD_DIM, HEAD_DIM])  # tiles start on head boundaries
        rstd = 1 / tl.sqrt(reduce_sum(heads * heads, 2) + L2NORM_EPS)
        normed = tl.reshape(heads * rstd[:, :, None], [BLOCK_T, BLOCK_C])
        is_normed = (tl.load(l2norm_rows_ptr + r) != 0) & is_valid
        y = tl.where(is_normed[:, None] & (c < split_2)[None, :], normed, y)
    out_mask = (tokens < num_tokens)[:, None] & c_mask[None, :]
    if SPLIT:  # channel c of block b at [num_tokens * start_b] + token * width_b + (c - start_b)
        in_2, in_3 = c >= split_1, c >= split_2
        block_start = tl.where(in_3, split_2, tl.where(in_2, split_1, 0))
        width = tl.where(in_3, C - split_2, tl.where(in_2, split_2 - split_1, split_1)).to(tl.int64)
        base = block_start.to(tl.int64) * num_tokens + (c - block_start)
        offsets = base[None, :] + tokens.to(tl.int64)[:, None] * width[None, :]
    else:
        offsets = (tokens.to(tl.int64) * stride_o_tok)[:, None] + c[None, :]
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=out_mask)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    state_src: torch.Tensor,
    state_dst: torch.Tensor,
    state_write_start: torch.Tensor,
    activation: str | None = "silu",
    block_t: int | None = None,
    block_c: int | None = None,
    num_warps: int = 4,
    split: tuple[int, int, int] | None = None,
    out_dtype: torch.dtype | None = None,
    plain_tiles: bool | None = None,
    l2norm_rows: torch.Tensor | None = None,
    l2norm_head_dim: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Conv + activation of x [T, C] with weight [C, K] (or nn.Conv1d's [C, 1, K]); updates ``conv_state``
    [num_slots, C, K-1] in place. Returns [T, C] in x's dtype (rows past query_start_loc[R], a graph's
    padding: zeros), or with ``split`` (three widths summing to C) three contiguous [T, width] tensors holding the
    same values, in ``out_dtype`` (default x's; a wider one holds the x-dtype values exactly). ``plain_tiles``: tiles
    inside one request's prompt take a branch without window reads or stores (the same bits; None: for steps of more
    than SMALL_STEP_TOKENS rows). ``l2norm_rows`` ([R], with ``split``): the q and k blocks of the requests it flags
    (nonzero) come L2-normalised per head of ``l2norm_head_dim`` channels (a power of two dividing the q / k widths),
    ``x / sqrt(sum x^2 + 1e-6)`` in fp32 as fla's l2norm, for fla's chunk kernel, the same bits in any step (one tiling
    for every step size); every other value is as without it. ``out``: a contiguous buffer of at least T x C elements
    of the output dtype to write into (a static one, shared by the layers of a piecewise-captured step)."""
    num_tokens, channels = x.shape
    weight = weight.reshape(channels, -1).contiguous()
    kernel = weight.shape[1]
    if conv_state.shape[1:] != (channels, kernel - 1) or conv_state.stride(-1) != 1 or x.stride(-1) != 1:
        raise ValueError(f"x {tuple(x.shape)} / weight K={kernel} do not fit conv_state {tuple(conv_state.shape)}")
    if activation not in ("silu", "swish", None):
        raise ValueError(f"causal_conv1d supports activation 'silu' or None, got {activation!r}")
    if split is not None and (len(split) != 3 or sum(split) != channels or min(split) <= 0):
        raise ValueError(f"split {split} must be three positive widths summing to the {channels} channels")
    if l2norm_rows is not None and (split is None or l2norm_head_dim <= 0 or l2norm_head_dim & (l2norm_head_dim - 1)
                                    or split[0] % l2norm_head_dim or split[1] % l2norm_head_dim):
        raise ValueError(f"l2norm_rows needs split and a power-of-two head dim dividing the q / k widths, got "
                         f"split={split}, l2norm_head_dim={l2norm_head_dim}")
    if out is None:
        out = torch.empty(num_tokens * channels, dtype=out_dtype or x.dtype, device=x.device)
    elif out.dtype != (out_dtype or x.dtype) or not out.is_contiguous() or out.numel() < num_tokens * channels:
        raise ValueError(f"out must be a contiguous {out_dtype or x.dtype} buffer of >= {num_tokens * channels} "
                         "elements")
    out = out.view(-1)[:num_tokens * channels]
    if split is None:
        out = out.view(num_tokens, channels)
    num_reqs = state_src.shape[0]
    if num_reqs == 0:
        out.zero_()
    else:
        _launch(out, x, weight, conv_state, (query_start_loc, state_src, state_dst, state_write_start), activation,
                block_t, block_c, num_warps, split, plain_tiles, l2norm_rows, l2norm_head_dim)
    if split is None:
        return out
    parts = out.split([num_tokens * width for width in split])
    return tuple(part.view(num_tokens, width) for part, width in zip(parts, split, strict=True))


def _launch(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
            meta: tuple[torch.Tensor, ...], activation: str | None, block_t: int | None, block_c: int | None,
            num_warps: int, split: tuple[int, int, int] | None, plain_tiles: bool | None,
            l2norm_rows: torch.Tensor | None = None, head_dim: int = 0) -> None:  # fmt: skip
    num_tokens, channels = x.shape
    query_start_loc, state_src, state_dst, state_write_start = meta
    num_reqs = state_src.shape[0]
    init = gather_windows(conv_state, state_src)  # [R, C, K-1]: every read before the kernel's writes
    # with l2norm_rows one tiling for every step: a Triton sum's order follows its block's layout, so a row's norm
    # would depend on the step's size (and a prompt's tokens on the token budget)
    long_step = num_tokens > SMALL_STEP_TOKENS or l2norm_rows is not None
    if block_t is None:  # decode / verify steps keep the row-per-program launch measured fastest for them
        block_t = 4 if long_step else 1
    if block_c is None:
        block_c = 256
    if l2norm_rows is not None:  # a tile holds whole heads (both powers of two)
        block_c = max(block_c, head_dim)
    if plain_tiles is None:  # long steps: the branch for tiles inside a prompt (H200, 8K rows: 240 -> 164 us)
        plain_tiles = long_step
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(channels, block_c))
    split_1, split_2 = (0, 0) if split is None else (split[0], split[0] + split[1])
    _causal_conv1d_kernel[grid](
        out, x, weight, init, conv_state, query_start_loc, state_src, state_dst, state_write_start, num_tokens,
        num_reqs, x.stride(0), channels, conv_state.stride(0), conv_state.stride(1), split_1, split_2,
        l2norm_rows if l2norm_rows is not None else state_src,
        C=channels, BLOCK_T=block_t, BLOCK_C=block_c, K=weight.shape[1], APPLY_SILU=activation is not None,
        ACC_DTYPE=tl_compute_dtype(x.dtype), SPLIT=split is not None, PLAIN_TILES=plain_tiles,
        L2NORM=l2norm_rows is not None, HEAD_DIM=max(head_dim, 1), L2NORM_EPS=1e-6, num_warps=num_warps,
    )  # fmt: skip
