"""The CPU path's compiled q / k norm + RoPE (cpu_kernels/rotary.py and rotary_core.c) against ``qk_norm_rope_ref``:
with and without the per-head norms, plain and unit-offset weights, partial and full rotary dims, q and k as strided
views of one projection, float32 and float64; a token's bits the same alone and among others; and
``apply_qk_norm_rotary`` taking it."""

import pytest
import torch

from helpers.kernels import assert_near
from truespec.cpu_kernels import build
from truespec.cpu_kernels import rotary as cpu_rotary
from truespec.layers.norm import RMSNorm
from truespec.layers.rotary import apply_qk_norm_rotary
from truespec.ops.rotary import qk_norm_rope_ref

pytestmark = pytest.mark.skipif(build.load() is None, reason="no C compiler: the CPU path keeps its torch ops")


def operands(dtype: torch.dtype, rot: int, seed: int = 0) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(7, (4 + 2 + 2) * 32, generator=gen, dtype=dtype)
    q, k = qkv[:, : 4 * 32].unflatten(-1, (4, 32)), qkv[:, 4 * 32 : 6 * 32].unflatten(-1, (2, 32))
    angles = torch.rand(7, rot // 2, generator=gen, dtype=dtype) * 6
    cos, sin = torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)
    weights = [torch.randn(32, generator=gen, dtype=dtype) * 0.1 for _ in range(2)]
    return q, k, cos, sin, weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rot", [8, 32])
@pytest.mark.parametrize("norm", ["none", "plain", "unit_offset"])
def test_matches_the_reference_and_a_token_alone(dtype: torch.dtype, rot: int, norm: str) -> None:
    q, k, cos, sin, (qw, kw) = operands(dtype, rot)
    qw, kw = (None, None) if norm == "none" else (qw, kw)
    unit_offset = norm == "unit_offset"
    got = cpu_rotary.qk_norm_rope(q, k, cos, sin, qw, kw, 1e-6, unit_offset)
    for out, expected in zip(got, qk_norm_rope_ref(q, k, cos, sin, qw, kw, 1e-6, unit_offset), strict=True):
        assert_near(out, expected, dtype)
    for t in (0, 3, 6):
        alone = cpu_rotary.qk_norm_rope(q[t : t + 1], k[t : t + 1], cos[t : t + 1], sin[t : t + 1], qw, kw, 1e-6,
                                        unit_offset)  # fmt: skip
        assert torch.equal(alone[0], got[0][t : t + 1]) and torch.equal(alone[1], got[1][t : t + 1])


def test_apply_qk_norm_rotary_takes_it() -> None:
    q, k, cos, sin, _ = operands(torch.float32, 16, seed=1)
    q_norm, k_norm = RMSNorm(32, 1e-6, unit_offset=True), RMSNorm(32, 1e-6, unit_offset=True)
    with torch.no_grad():
        assert cpu_rotary.can_run(q, k, cos, q_norm.weight, k_norm.weight)
        got = apply_qk_norm_rotary(q, k, cos, sin, q_norm, k_norm)
    expected = qk_norm_rope_ref(q, k, cos, sin, q_norm.weight, k_norm.weight, 1e-6, True)
    for out, want in zip(got, expected, strict=True):
        assert_near(out, want.detach(), torch.float32)
