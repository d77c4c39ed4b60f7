"""The causal conv's L2-norm epilogue (``causal_conv1d(l2norm_rows=..., l2norm_head_dim=...)``, in
kernels/causal_conv1d.py): the q / k heads of the requests fla's chunk kernel takes come normalised as fla's own
l2norm would, everything else bit for bit as without it, and a row's normalised bits do not depend on the step
around it (the token budget). Without CUDA the kernel runs in Triton's interpreter (tests/helpers/kernels.py), so
shapes are tiny; the ``@pytest.mark.gpu`` test reruns the checks compiled at the Qwen3.5-0.8B size.
"""

import importlib

import pytest
import torch

from helpers.kernels import (
    DEVICE,
    GPU_DTYPES,
    GPU_TOL_SCALE,
    NUM_PAD_TOKENS,
    NUM_SLOTS,
    gpu,
    i64,
    needs_cuda,
    poisoned_empty,
    randn,
    state_batch,
)
from truespec.kernels import causal_conv1d

# the module, not the function the package re-exports under the same name
causal_conv1d_module = importlib.import_module("truespec.kernels.causal_conv1d")


def check_l2norm_rows(dtype: torch.dtype, rows: list, flags: list[int], widths: tuple, head: int,
                      tol_scale: float = 1.0, **tiles: int) -> None:
    """``l2norm_rows``: the flagged requests' q and k heads come as fla's l2norm of the plain split output
    (x / sqrt(sum x^2 + 1e-6) in fp32: close, as another sum order); everything else, v and the windows included, bit
    for bit as without it."""
    gen = torch.Generator().manual_seed(7)
    channels = sum(widths)
    batch = state_batch(rows)
    num_tokens = batch["query_start_loc"][-1].item() + NUM_PAD_TOKENS
    x = randn(num_tokens, channels, dtype=dtype, gen=gen)
    weight = randn(channels, 1, 4, dtype=dtype, gen=gen)
    conv_state = randn(NUM_SLOTS, channels, 3, dtype=dtype, gen=gen)
    args = (batch["query_start_loc"], batch["state_src"], batch["state_dst"], batch["state_write_start"])
    plain_state, state = conv_state.clone(), conv_state.clone()
    kwargs = {**tiles, "split": widths, "out_dtype": torch.float32}
    plain = causal_conv1d(x, weight, plain_state, *args, **kwargs)
    with poisoned_empty():
        normed = causal_conv1d(x, weight, state, *args, **kwargs, l2norm_rows=i64(flags), l2norm_head_dim=head)
    assert torch.equal(state, plain_state) and torch.equal(normed[2], plain[2])
    qsl = batch["query_start_loc"].tolist()
    flagged = torch.zeros(num_tokens, dtype=torch.bool, device=DEVICE)
    for r, flag in enumerate(flags):
        flagged[qsl[r]:qsl[r + 1]] = bool(flag)
    for got, raw in zip(normed[:2], plain[:2], strict=True):
        heads = raw.view(num_tokens, -1, head)
        expected = (heads / torch.sqrt((heads * heads).sum(-1, keepdim=True) + 1e-6)).view(num_tokens, -1)
        assert torch.equal(got[~flagged], raw[~flagged])
        torch.testing.assert_close(got[flagged], expected[flagged], rtol=1e-6 * tol_scale, atol=1e-7 * tol_scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_c", [8, 16])  # a tile of one head / of two
def test_causal_conv1d_normalises_the_flagged_requests_q_and_k_heads(dtype: torch.dtype, block_c: int) -> None:
    """Heads of 8 channels; tiles of 8 rows straddle flagged and unflagged requests (check_l2norm_rows)."""
    rows = [(1, 5, 1, 0), (20, -1, 13, 19), (4, 3, 4, 0), (19, 18, 17, 18), (2, -1, 20, 1)]
    check_l2norm_rows(dtype, rows, [0, 1, 0, 1, 1], (16, 16, 8), 8, block_t=8, block_c=block_c)
    x, weight, state = (torch.zeros(4, 40), torch.zeros(40, 4), torch.zeros(2, 40, 3))
    with pytest.raises(ValueError, match="power-of-two head dim"):
        causal_conv1d(x, weight, state, i64([0, 4]), i64([-1]), i64([-1]), i64([0]), split=(16, 16, 8),
                      l2norm_rows=i64([1]), l2norm_head_dim=6)


def check_l2norm_rows_do_not_depend_on_the_step(dtype: torch.dtype, widths: tuple, head: int, query_len: int,
                                                 other_len: int) -> None:
    """A fresh prompt chunk's normalised q / k rows are the same bits alone in a short step (<= SMALL_STEP_TOKENS
    rows) as behind another request's ``other_len`` rows in a long one (other tiles, other row offsets): a prompt's
    tokens may not depend on the token budget that cut it (tests/test_gpu_gdn_prefill_rule.py)."""
    gen = torch.Generator().manual_seed(11)
    channels = sum(widths)
    mine, other = randn(query_len, channels, dtype=dtype, gen=gen), randn(other_len, channels, dtype=dtype, gen=gen)
    weight = randn(channels, 1, 4, dtype=dtype, gen=gen)
    outs = []
    for x, rows in ((mine, [(query_len, -1, 0, query_len - 1)]),
                    (torch.cat([other, mine]), [(other_len, -1, 4, other_len - 1), (query_len, -1, 0, query_len - 1)])):
        batch = state_batch(rows)
        args = (batch["query_start_loc"], batch["state_src"], batch["state_dst"], batch["state_write_start"])
        state = torch.zeros(NUM_SLOTS, channels, 3, dtype=dtype, device=DEVICE)
        q, k, _ = causal_conv1d(x, weight, state, *args, split=widths, out_dtype=torch.float32,
                                l2norm_rows=i64([1] * len(rows)), l2norm_head_dim=head)  # fmt: skip
        outs.append((q[-query_len:], k[-query_len:]))
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_causal_conv1d_l2norm_rows_do_not_depend_on_the_step(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:  # fmt: skip
    """The bits (the interpreter sums in one order whatever the tile, so the launches are compared too: a compiled
    sum's order follows the tile's layout)."""
    real, launches = causal_conv1d_module._causal_conv1d_kernel, []

    class Recording:
        def __getitem__(self, grid: tuple) -> object:
            def launch(*args: object, **kwargs: object) -> object:
                launches.append({k: kwargs[k] for k in ("BLOCK_T", "BLOCK_C", "PLAIN_TILES", "num_warps")})
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(causal_conv1d_module, "_causal_conv1d_kernel", Recording())
    check_l2norm_rows_do_not_depend_on_the_step(dtype, (16, 16, 8), 8, query_len=30, other_len=251)
    assert len(launches) == 2 and launches[0] == launches[1], launches



# ------------------------------------------------------------------------- GPU: Qwen3.5-0.8B sizes, compiled
@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_l2norm_rows_at_qwen3_5_size(dtype: torch.dtype) -> None:
    long_rows = [(1, 2, 0, 0), (700, -1, 8, 699), (3, 13, -1, 0), (300, 21, 20, 299)]  # the plain tiles' steps
    check_l2norm_rows(dtype, long_rows, [0, 1, 0, 1], (2048, 2048, 2048), 128, tol_scale=GPU_TOL_SCALE)
    check_l2norm_rows_do_not_depend_on_the_step(dtype, (2048, 2048, 2048), 128, query_len=200, other_len=1001)
