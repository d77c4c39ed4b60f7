"""The row-invariant matmul's path for long prefill chunks: a persistent kernel that streams its tiles by TMA.

``row_invariant_matmul`` (kernels/row_invariant_matmul.py) must give each row the same bits whatever else shares
the call: its K reduction is cut into the segments of ``plan(N, K)``, each chained into an fp32 accumulator from
zero, chunk after chunk, and the segments added in order. Past ``PARALLEL_MAX_M`` rows (prefill chunks, never a
captured step) it ran one plain 128 x 128 tile per program with masked pointer loads: ~1.9x cuBLAS's time on an
H100. Here the same sums run in a persistent grid (one program per SM walking the output tiles in groups of
``GROUP_M`` row blocks, so neighbouring programs share weight tiles in L2), with the operands brought in by TMA
(no masks: out-of-range rows read as zeros and are not stored). The products and their order are the small
tiles' (the bits are checked against them in tests/test_row_invariant_matmul.py on every card the GPU tests run on).
A gated MLP's down projection takes ``act(gate) * up`` from the act_mul kernel first (the same bits as the fused
input of the other path): computed inside this loop, the activation kept the tensor cores waiting (H200, 8,192 rows:
the down projection 371 us fused, 246 us as act_mul + this kernel; BENCHMARKS.md session 20).
"""

import functools

import torch
import triton
import triton.language as tl

from truespec.kernels.triton_utils import is_interpreter, reduce_sum

# (rows, weight rows, K chunk, stages, warps): H200 sweep (benchmarks/prefill_matmul_speed.py)
TILE = (128, 128, 64, 4, 8)
GROUP_M = 8  # row blocks a group of programs walks before the next weight block (L2 reuse of the weight tile)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs, so each walks several tiles as on a GPU
    return torch.cuda.get_device_properties(device).multi_processor_count


def can_run(x: torch.Tensor, weight: torch.Tensor, segment: int, block_k: int) -> bool:
    """16-bit operands on CUDA (or in the interpreter); TMA needs 16-byte aligned rows and bases; the K chunks must
    tile each segment (no K mask here)."""
    on_device = x.is_cuda or is_interpreter()
    if not (on_device and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype):
        return False
    k = weight.shape[1]
    aligned = all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 for t in (x, weight))
    return aligned and k % block_k == 0 and segment % block_k == 0


@triton.jit
def _tile_ids(tile, num_pid_m, num_pid_n, GROUP: tl.constexpr):
    """(row block, column block) of output tile ``tile``: GROUP row blocks per column block, then the next."""
    in_group = GROUP * num_pid_n
    first_m = (tile // in_group) * GROUP
    group_m = tl.minimum(num_pid_m - first_m, GROUP)
    return first_m + (tile % in_group) % group_m, (tile % in_group) // group_m


@triton.jit
def _prefill_matmul_kernel(x_desc, w_desc, y_desc, b_ptr, M, N, K, SEGMENT, SPLIT: tl.constexpr,
                           HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, GROUP: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
                           STAGES: tl.constexpr, INTERPRETED: tl.constexpr):
    num_pid_m = (M + BLOCK_M - 1) // BLOCK_M  # not tl.cdiv: a jit function the interpreter may not have wrapped
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS):
        pid_m, pid_n = _tile_ids(tile, num_pid_m, num_pid_n, GROUP)
        row, col = pid_m * BLOCK_M, pid_n * BLOCK_N
        total = tl.full([BLOCK_M, BLOCK_N], 0, tl.float32)
        for s in tl.static_range(SPLIT):
            acc = tl.full([BLOCK_M, BLOCK_N], 0, tl.float32)
            for k in tl.range(s * SEGMENT, tl.minimum(K, (s + 1) * SEGMENT), BLOCK_K, num_stages=STAGES):
                x = x_desc.load([row, k])
                w = w_desc.load([col, k])
                if INTERPRETED:  # the small tiles' fixed-order sum of each SEGMENT_K chunk (numpy's order varies)
                    acc = acc + reduce_sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], 2)
                else:
                    acc = tl.dot(x, w.T, acc)
            total = acc if s == 0 else total + acc  # not 0 + acc: that would turn a -0.0 sum into +0.0
        if HAS_BIAS:
            offs_n = col + tl.arange(0, BLOCK_N)
            total = total + tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        y_desc.store([row, col], total.to(y_desc.dtype))


def prefill_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, split: int, segment: int,
                   tile: tuple[int, int, int, int, int] = TILE) -> torch.Tensor:
    """``row_invariant_matmul``'s result for ``x`` [M, K], ``weight`` [N, K] with the K segments ``split`` x
    ``segment`` of its ``plan``; the caller checked ``can_run`` (the tile's K chunk is ``tile[2]``)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    block_m, block_n, block_k, stages, warps = tile
    m, (n, k) = x.shape[0], weight.shape
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    num_tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    programs = min(num_tiles, _num_sms(x.device))
    _prefill_matmul_kernel[(programs,)](
        TensorDescriptor.from_tensor(x, [block_m, block_k]), TensorDescriptor.from_tensor(weight, [block_n, block_k]),
        TensorDescriptor.from_tensor(y, [block_m, block_n]), bias if bias is not None else weight, m, n, k, segment,
        SPLIT=split, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP=GROUP_M,
        NUM_PROGRAMS=programs, STAGES=stages, INTERPRETED=is_interpreter(), num_warps=warps,
    )  # fmt: skip
    return y
