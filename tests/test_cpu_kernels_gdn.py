"""The CPU path's compiled GDN core (cpu_kernels/gdn.py and gdn_core.c) against the layer's torch ops
(ops/gdn_batched.py): outputs and states on ragged batches (decodes, 1+k verifies keeping every position, prefill chunks
continuing a state, sources inside a request's own destination group, an inert row, empty queries, padding rows),
float32 and float64; a request's rows and kept states bitwise the same alone and inside the batch (invariant 4 on
the CPU); and the torch path when the library cannot be built."""

from unittest import mock

import pytest
import torch

from helpers.kernels import NUM_PAD_TOKENS, NUM_SLOTS, assert_near, make_context, state_batch
from test_gdn_kernels import GDN_ROWS, GDN_ROWS_OWN_SOURCES, written_slots
from truespec.cpu_kernels import build
from truespec.cpu_kernels import gdn as cpu_gdn
from truespec.forward_context import set_forward_context
from truespec.layers.gdn import GatedDeltaNet

pytestmark = pytest.mark.skipif(build.load() is None, reason="no C compiler: the CPU path keeps its torch ops")
# a plain decode batch, each request kept in its own slot (updated where it is); two decodes sharing a source
DECODES_IN_PLACE = [(1, 3, 3, 0), (1, 5, 5, 0), (0, -1, -1, 0), (1, 9, 9, 0)]
DECODES_SHARING = [(1, 3, 3, 0), (1, 3, 7, 0)]
ROW_SETS = pytest.mark.parametrize("rows", [GDN_ROWS, GDN_ROWS_OWN_SOURCES, DECODES_IN_PLACE, DECODES_SHARING],
                                   ids=["mixed", "own_sources", "in_place", "sharing"])


def cpu_layer(dtype: torch.dtype, seed: int = 7) -> tuple[GatedDeltaNet, tuple[torch.Tensor, torch.Tensor]]:
    """A layer with 2 key heads, 4 value heads (dk 12, dv 10), random weights and states, on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    layer = GatedDeltaNet(24, 2, 4, 12, 10, 4, 1e-6, "silu").to(dtype=dtype)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(*param.shape, generator=gen, dtype=dtype) * param.shape[-1] ** -0.5)
    conv = torch.randn(NUM_SLOTS, layer.conv_dim, 3, generator=gen, dtype=dtype)
    ssm = torch.randn(NUM_SLOTS, 4, 12, 10, generator=gen, dtype=dtype) * 0.3
    return layer, (conv, ssm)


@torch.no_grad()
def run(layer: GatedDeltaNet, states: tuple, rows: list, x: torch.Tensor, native_on: bool) -> tuple:
    """(output, conv_state, ssm_state) of one forward over ``rows`` from copies of ``states``."""
    layer.conv_state, layer.ssm_state = (s.clone() for s in states)
    batch = state_batch(rows)
    with set_forward_context(make_context(batch, x.shape[0])), \
            mock.patch.object(cpu_gdn, "can_run", wraps=cpu_gdn.can_run) as can_run:
        if not native_on:
            can_run.side_effect = lambda *a: False
        out = layer(x)
    assert can_run.called
    return out, layer.conv_state, layer.ssm_state


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@ROW_SETS
def test_native_core_gives_the_torch_layer_output_and_states(dtype: torch.dtype, rows: list) -> None:
    layer, states = cpu_layer(dtype)
    x = torch.randn(sum(r[0] for r in rows) + NUM_PAD_TOKENS, 24, generator=torch.Generator().manual_seed(1),
                    dtype=dtype)  # fmt: skip
    out, conv, ssm = run(layer, states, rows, x, native_on=True)
    expected, expected_conv, expected_ssm = run(layer, states, rows, x, native_on=False)
    assert_near(out, expected, dtype)
    assert torch.equal(conv, expected_conv)  # windows are copies of inputs
    assert_near(ssm, expected_ssm, dtype)
    untouched = [s for s in range(NUM_SLOTS) if s not in set(written_slots(rows))]
    assert torch.equal(ssm[untouched], states[1][untouched]) and torch.equal(conv[untouched], states[0][untouched])
    assert not out[-NUM_PAD_TOKENS:].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("batch", [GDN_ROWS, DECODES_IN_PLACE], ids=["mixed", "in_place"])
def test_a_request_gives_the_same_bits_alone_and_in_the_batch(dtype: torch.dtype, batch: list) -> None:
    rows = [r for r in batch if r[0] > 0]
    layer, states = cpu_layer(dtype, seed=3)
    x = torch.randn(sum(r[0] for r in rows), 24, generator=torch.Generator().manual_seed(2), dtype=dtype)
    out, conv, ssm = run(layer, states, rows, x, native_on=True)
    start = 0
    for row in rows:
        alone, conv_alone, ssm_alone = run(layer, states, [row], x[start : start + row[0]], native_on=True)
        assert torch.equal(alone, out[start : start + row[0]])
        kept = written_slots([row])
        assert torch.equal(ssm_alone[kept], ssm[kept]) and torch.equal(conv_alone[kept], conv[kept])
        start += row[0]


def test_without_a_compiler_the_layer_keeps_its_torch_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-for-truespec")
    build.load.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="no C compiler"):
            assert build.load() is None
        layer, states = cpu_layer(torch.float32)
        x = torch.randn(5, 24, generator=torch.Generator().manual_seed(4))
        rows = [(1, 2, 0, 0), (4, 4, 4, 0)]
        assert not cpu_gdn.can_run(x, *states)
        out = run(layer, states, rows, x, native_on=True)[0]
        monkeypatch.delenv("CC")
        build.load.cache_clear()
        assert_near(out, run(layer, states, rows, x, native_on=True)[0], torch.float32)
    finally:
        build.load.cache_clear()


def test_truespec_native_0_turns_the_library_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRUESPEC_NATIVE", "0")
    build.load.cache_clear()
    try:
        assert build.load() is None
    finally:
        build.load.cache_clear()
