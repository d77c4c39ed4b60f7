"""A GDN layer's core (conv + SiLU, gates, gated delta rule, gated RMSNorm) for a step in one compiled call: the CPU
path of layers/gdn.py where build.py could build gdn_core.c (otherwise ops/gdn_batched.py's torch ops)."""

import torch

from truespec.cpu_kernels import build
from truespec.ops.gdn import L2NORM_EPS


def can_run(x: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor, *params: torch.Tensor) -> bool:
    """Whether ``gdn_core`` takes this layer's step: a float32 / float64 model on the CPU, states of its dtype laid
    out as the layer allocates them, no autograd to record (``params``: the layer's weights the kernel reads), and
    the library built."""
    layout = conv_state.dtype == ssm_state.dtype == x.dtype and conv_state[0].is_contiguous()
    return x.device.type == "cpu" and x.dtype in build.SCALARS and layout and ssm_state[0].is_contiguous() \
        and not build.tracks_grad(x, *params) and build.load() is not None


def gdn_core(mixed_qkv: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_weight: torch.Tensor,
             A_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor, norm_eps: float,  # noqa: N803
             conv_state: torch.Tensor, ssm_state: torch.Tensor, query_start_loc: torch.Tensor,
             state_src: torch.Tensor, state_dst: torch.Tensor, state_write_start: torch.Tensor,
             heads: tuple[int, int, int, int]) -> torch.Tensor:  # fmt: skip
    """``norm(gdn_recurrent(conv(mixed_qkv)), z)`` as [T, HV * DV] (rows no request owns: zeros), updating the states
    by the slot protocol (layers/gdn.py). ``mixed_qkv`` [T, C], ``z`` [T, HV * DV], ``a``, ``b`` [T, HV]: views of one
    in_proj output (unit last stride, one row stride); ``heads`` = (HK, HV, DK, DV). Check ``can_run`` first."""
    num_k, num_v, dk, dv = heads
    num_tokens, channels = mixed_qkv.shape
    kernel = conv_weight.shape[-1]
    if channels != 2 * num_k * dk + num_v * dv or conv_state.shape[1:] != (channels, kernel - 1):
        raise ValueError(f"mixed_qkv {tuple(mixed_qkv.shape)} / conv_state {tuple(conv_state.shape)} do not fit "
                         f"heads {heads} and a conv of width {kernel}")  # fmt: skip
    if a.stride(0) != b.stride(0) or any(t.stride(-1) != 1 for t in (mixed_qkv, z, a, b)):
        raise ValueError("mixed_qkv, z, a and b need a unit last stride, a and b one row stride")
    suffix, scalar = build.SCALARS[mixed_qkv.dtype]
    out = torch.zeros(num_tokens, num_v * dv, dtype=mixed_qkv.dtype)
    meta = [build.as_int64(t) for t in (query_start_loc, state_src, state_dst, state_write_start)]
    params = [t.detach().contiguous() for t in (conv_weight.reshape(channels, kernel), A_log, dt_bias, norm_weight)]
    p, i = build.POINTER, build.INT
    argtypes = [p, i, p, i, p, p, i, p, p, p, p, p, i, p, i, p, p, p, p, i, i, i, i, i, i, scalar, scalar, scalar, p]
    status = build.function(f"gdn_core_{suffix}", argtypes)(
        mixed_qkv.data_ptr(), mixed_qkv.stride(0), z.data_ptr(), z.stride(0), a.data_ptr(), b.data_ptr(), a.stride(0),
        *(t.data_ptr() for t in params), conv_state.data_ptr(), conv_state.stride(0), ssm_state.data_ptr(),
        ssm_state.stride(0), *(m.data_ptr() for m in meta), meta[1].shape[0], num_k, num_v, dk, dv, kernel,
        dk**-0.5, norm_eps, L2NORM_EPS, out.data_ptr(),
    )  # fmt: skip
    if status:
        raise MemoryError("gdn_core: the CPU kernel could not allocate its scratch buffers")
    return out
