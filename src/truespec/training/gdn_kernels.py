"""Which Gated DeltaNet chunk kernel transformers' Qwen3.5 layers use while training, and proof it is right.

fla-core 0.6.0 refuses its gated backward on Hopper with Triton in [3.4, 3.7.1): `chunk_bwd_kernel_dqkwg`
computes `tl.trans(b_ds)` of a matrix-unit result, which those Triton versions miscompile (fla issue #640).
`use_fla_kernels` rebuilds that one kernel with ds^T accumulated directly (one more small dot per V block,
no transpose of an MMA result), installs it, and then checks forward and every gradient against
transformers' own torch reference on random inputs. If anything is off it falls back to the reference.
"""

import importlib.util
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from transformers.models.qwen3_5 import modeling_qwen3_5

_GDN_FN = modeling_qwen3_5.torch_chunk_gated_delta_rule  # fla's kernel when transformers found fla, else torch's
REFERENCE = getattr(_GDN_FN, "__wrapped__", _GDN_FN)  # transformers' torch implementation

_PATCHES = [  # (old, new): each `old` must occur exactly once in fla/ops/common/chunk_o.py
    ("    if g is not None and IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1:\n",
     "    if False:\n"),
    ("    b_ds = tl.zeros([BT, BT], dtype=tl.float32)\n    b_dw",
     "    b_ds = tl.zeros([BT, BT], dtype=tl.float32)\n    b_dsT = tl.zeros([BT, BT], dtype=tl.float32)\n    b_dw"),
    ("        b_ds = tl.dot(b_do, tl.trans(b_v), b_ds)\n",
     "        b_ds = tl.dot(b_do, tl.trans(b_v), b_ds)\n        b_dsT = tl.dot(b_v, tl.trans(b_do), b_dsT)\n"),
    ("        b_dk = tl.dot(tl.trans(b_ds), b_q, b_dk)\n\n        b_dg = tl.sum(",
     "        m_AT = (o_t[:, None] <= o_t[None, :]) & (m_t[:, None] & m_t)\n"
     "        b_dsT = tl.where(m_AT, b_dsT * exp2(b_g[None, :] - b_g[:, None]), 0) * scale\n"
     "        b_dk = tl.dot(b_dsT.to(b_k.dtype), b_q, b_dk)\n\n        b_dg = tl.sum("),
]


def patched_chunk_o(patches: list[tuple[str, str]] = _PATCHES) -> object:
    """A fresh copy of fla.ops.common.chunk_o with `patches` applied (a module object)."""
    import fla.ops.common.chunk_o as chunk_o

    src = Path(chunk_o.__file__).read_text()
    for old, new in patches:
        if src.count(old) != 1:
            raise RuntimeError(f"fla source changed; cannot patch: {old.strip()[:60]!r}")
        src = src.replace(old, new)
    path = Path(tempfile.mkdtemp(prefix="truespec_fla_")) / "truespec_fla_chunk_o.py"
    path.write_text(src)  # Triton reads kernel source from a real file
    spec = importlib.util.spec_from_file_location(f"truespec_fla_chunk_o_{len(patches)}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def check_against_reference(fn: Callable, device: torch.device, seed: int = 0) -> dict[str, float]:
    """Relative error of output and d{q,k,v,g,beta} vs REFERENCE (fp32) on random inputs.

    `fn` gets q, k, v, beta in bf16 and g in fp32, as in training, so the kernels it compiles (and their
    autotuned configs) are the ones training then uses; expect errors around 1e-2 from bf16 rounding.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    b, t, h, d = 2, 300, 4, 64  # t not a multiple of the chunk size on purpose

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device)

    values = [rand(b, t, h, d).bfloat16(), rand(b, t, h, d).bfloat16(), rand(b, t, h, d).bfloat16(),
              -torch.nn.functional.softplus(rand(b, t, h)) * 0.5, torch.sigmoid(rand(b, t, h)).bfloat16()]
    grad_out = rand(b, t, h, d)
    results = []
    for impl, to_fp32 in ((fn, False), (REFERENCE, True)):
        xs = [(x.float() if to_fp32 else x).clone().requires_grad_(True) for x in values]
        out, _ = impl(*xs[:3], g=xs[3], beta=xs[4], use_qk_l2norm_in_kernel=True)
        out.backward(grad_out.to(out.dtype))
        results.append([out.detach()] + [x.grad for x in xs])
    names = ["out", "dq", "dk", "dv", "dg", "dbeta"]
    return {n: _rel_err(a, r) for n, a, r in zip(names, results[0], results[1], strict=True)}


def use_fla_kernels(device: torch.device, tolerance: float = 4e-2) -> tuple[str, dict[str, float]]:
    """Install the best verified GDN chunk kernel; returns (description, relative errors vs reference)."""
    if device.type != "cuda" or _GDN_FN is REFERENCE:
        return "torch reference (transformers)", {}
    try:
        import fla.ops.gated_delta_rule.chunk as gdr_chunk

        gdr_chunk.chunk_bwd_dqkwg = patched_chunk_o().chunk_bwd_dqkwg
        errors = check_against_reference(_GDN_FN, device)
    except Exception as exc:  # noqa: BLE001 - any failure means: use the reference
        modeling_qwen3_5.torch_chunk_gated_delta_rule = REFERENCE
        return f"torch reference (fla unusable: {exc})", {}
    if max(errors.values()) > tolerance:
        modeling_qwen3_5.torch_chunk_gated_delta_rule = REFERENCE
        return "torch reference (patched fla failed the gradient check)", errors
    modeling_qwen3_5.torch_chunk_gated_delta_rule = _GDN_FN
    return "fla-core chunk_gated_delta_rule (dqkwg backward patched, verified)", errors
