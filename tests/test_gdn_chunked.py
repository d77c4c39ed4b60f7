"""kernels/gdn_chunked.py: long prefill chunks through fla's chunk kernel, everything else through gdn_recurrent.

On CPU (CI) there is no fla kernel: the request split is tested as a pure function, ``gdn_chunked`` must be
exactly ``gdn_recurrent``, and the gather / sub-batch / scatter plumbing runs with a stand-in chunk kernel (fla's
varlen signature, computed by ``gdn_recurrent_ref``) so it must match the reference bit for bit. fla's own Triton
kernels do not run in the interpreter (its autotuner needs a GPU driver). ``@pytest.mark.gpu`` tests run fla at
Qwen3.5 sizes against ``gdn_recurrent_ref`` (needs CUDA and fla-core installed; skipped otherwise).
"""

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before truespec.kernels is imported: see tests/helpers/kernels.py

pytest.importorskip("triton")

from truespec.forward_context import set_forward_context  # noqa: E402
from truespec.kernels import gdn_chunked as chunked_mod  # noqa: E402
from truespec.kernels import gdn_chunked_plan as plan_mod  # noqa: E402
from truespec.kernels import gdn_recurrent, gdn_recurrent_ref  # noqa: E402
from truespec.kernels.gdn_chunked import gdn_chunked, is_available  # noqa: E402
from truespec.kernels.gdn_chunked_plan import split_requests  # noqa: E402
from truespec.ops.precision import compute_dtype  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
GROUP = 4  # state slots per request (1 + k_max)
NUM_PAD_TOKENS = 3
# Relative (Frobenius) error bound per request of fla's chunked math (fp32 inputs: TF32 products; bf16 inputs: bf16
# products) vs the token loop, outputs and final states. Measured worst on H200 at Qwen3.5 sizes, 64..700-token
# chunks, 3 seeds: fp32 outputs 1.5e-3, states 8e-4; bf16 outputs 4.5e-3, states 3.2e-3 (about one bf16 rounding).
GPU_REL_TOL = {torch.float32: 5e-3, torch.bfloat16: 1e-2, torch.float16: 1e-2}  # fp16: 3 more bits than bf16
Row = tuple[int, int, int, int]  # (query_len, state_src, state_dst, state_write_start)


def mixed_rows(rng: random.Random, long: tuple[int, int], short_max: int) -> list[Row]:
    """A shuffled ragged batch: fresh / continuing / self-sourced long prefills, an inert long row, decodes,
    1+d verifies, a short prefill chunk and an empty query; request i owns slots [i*GROUP, (i+1)*GROUP)."""
    kinds = ["fresh", "continue", "own_src", "inert", "decode", "verify", "verify", "short", "empty", "fresh"]
    rng.shuffle(kinds)
    rows = []
    for i, kind in enumerate(kinds):
        base, n, short = i * GROUP, rng.randint(*long), rng.randint(2, short_max)
        rows.append({
            "fresh": (n, -1, base, n - 1),
            "continue": (n, base + 2, base, n - 1),
            "own_src": (n, base, base, n - 1),  # reads its source before overwriting it
            "inert": (n, base + 1, -1, n - 1),
            "decode": (1, base + 1, base, 0),
            "verify": (1 + rng.randint(1, GROUP - 1), base + 3, base, 0),
            "short": (short, base + 1, base, short - 1),  # a prefill chunk too short for the chunk kernel
            "empty": (0, base + 1, base, -1),
        }[kind])  # fmt: skip
    return rows


def batch(rows: list[Row], hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(r[0] for r in rows) + NUM_PAD_TOKENS

    cdt = compute_dtype(dtype)  # g, beta and states, as the layer passes them

    def randn(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dt)

    qsl = [0]
    for n, *_ in rows:
        qsl.append(qsl[-1] + n)
    host = dict(query_start_loc=qsl, state_src=[r[1] for r in rows], state_dst=[r[2] for r in rows],
                state_write_start=[r[3] for r in rows])  # fmt: skip
    g = -torch.nn.functional.softplus(randn(num_tokens, hv, dt=cdt) - 1.0)  # log decay, as the layer's
    return dict(
        q=randn(num_tokens, hk, dk), k=randn(num_tokens, hk, dk), v=randn(num_tokens, hv, dv), g=g,
        beta=torch.sigmoid(randn(num_tokens, hv, dt=cdt)),
        state=randn(len(rows) * GROUP, hv, dk, dv, dt=cdt) * 0.3, host=host,
        meta={name: torch.tensor(x, dtype=torch.int64, device=DEVICE) for name, x in host.items()},
    )  # fmt: skip


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()


def check_against_reference(b: dict, min_chunk_len: int, tol: float) -> dict[str, float]:
    """Run gdn_chunked, gdn_recurrent and gdn_recurrent_ref on copies of one batch. Chunked requests' outputs
    and final states must be within ``tol`` (0: bitwise) of the reference; every other output row and slot
    must be exactly gdn_recurrent's. Returns the worst relative errors."""
    tensors, meta, host = [b[n] for n in ("q", "k", "v", "g", "beta")], b["meta"], b["host"]
    states = [b["state"].clone() for _ in range(3)]
    kwargs = {f"{name}_cpu": x for name, x in host.items()}
    out = gdn_chunked(*tensors, states[0], **meta, **kwargs, min_chunk_len=min_chunk_len)
    plain = gdn_recurrent(*tensors, states[1], **meta)
    expected = gdn_recurrent_ref(*tensors, states[2], **meta)
    qsl, split = host["query_start_loc"], split_requests(host["query_start_loc"], host["state_dst"],
                                                         host["state_write_start"], min_chunk_len)  # fmt: skip
    chunk_rows = torch.zeros(out.shape[0], dtype=torch.bool, device=DEVICE)
    errors = {"out": 0.0, "state": 0.0}
    for r in split.chunked:
        chunk_rows[qsl[r] : qsl[r + 1]] = True
        errors["out"] = max(errors["out"], rel_err(out[qsl[r] : qsl[r + 1]], expected[qsl[r] : qsl[r + 1]]))
    chunk_slots = [host["state_dst"][r] for r in split.chunked if host["state_dst"][r] >= 0]
    for slot in chunk_slots:
        errors["state"] = max(errors["state"], rel_err(states[0][slot], states[2][slot]))
    other_slots = [s for s in range(states[0].shape[0]) if s not in chunk_slots]
    assert torch.equal(out[~chunk_rows], plain[~chunk_rows]), "a token-loop request differs from gdn_recurrent"
    assert torch.equal(states[0][other_slots], states[1][other_slots]), "a slot no chunked request owns changed"
    if tol == 0:
        assert torch.equal(out[chunk_rows], expected[chunk_rows])
        assert torch.equal(states[0][chunk_slots], states[2][chunk_slots])
    assert errors["out"] <= tol and errors["state"] <= tol, errors
    return errors


# ----------------------------------------------------------------------------------------------------- CPU
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU answer")
def test_chunked_path_is_unavailable_without_cuda() -> None:
    assert not is_available()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gdn_chunked_is_exactly_gdn_recurrent_where_the_chunk_kernel_cannot_run(dtype: torch.dtype) -> None:
    """Without CUDA or fla, and for float64 states (fla keeps fp32 state), nothing changes: same bits."""
    if dtype == torch.float32 and is_available():
        pytest.skip("fla runs fp32 states here: see the GPU tests")
    rows = mixed_rows(random.Random(0), long=(8, 12), short_max=7)
    b = batch(rows, hk=2, hv=4, dk=8, dv=12, dtype=dtype, seed=1)
    tensors, states = [b[n] for n in ("q", "k", "v", "g", "beta")], [b["state"].clone(), b["state"].clone()]
    out = gdn_chunked(*tensors, states[0], **b["meta"], min_chunk_len=8)
    plain = gdn_recurrent(*tensors, states[1], **b["meta"])
    assert torch.equal(out, plain) and torch.equal(states[0], states[1])


def reference_chunk_kernel(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                           cu_seqlens, cu_seqlens_cpu, chunk_indices):  # fmt: skip
    """fla's varlen chunk_gated_delta_rule contract ([1, T, H, K] inputs, initial_state [N, HV, K, V] -> o,
    final_state; chunk_indices: (sequence, chunk of it) per 64-token chunk, as fla's prepare_chunk_indices), computed
    by gdn_recurrent_ref: scratch slots 0..N-1 hold the initial, N..2N-1 the final states."""
    assert q.shape[0] == 1 and cu_seqlens.tolist() == cu_seqlens_cpu.tolist() and output_final_state
    n = len(cu_seqlens_cpu) - 1
    lengths = (cu_seqlens_cpu[1:] - cu_seqlens_cpu[:-1]).tolist()
    assert chunk_indices.tolist() == [[i, j] for i, length in enumerate(lengths) for j in range((length + 63) // 64)]
    assert initial_state.shape[0] == n and q.dtype == k.dtype == v.dtype  # the model's dtype (gdn_chunked's numerics)
    assert initial_state.dtype == g.dtype == beta.dtype == torch.float32
    states = torch.cat([initial_state, torch.zeros_like(initial_state)])
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    slots = torch.arange(n, device=cu_seqlens.device)
    meta = [cu_seqlens, slots, slots + n, torch.tensor(lens, device=cu_seqlens.device) - 1]
    o = gdn_recurrent_ref(q[0], k[0], v[0], g[0], beta[0], states, *meta, scale, use_qk_l2norm_in_kernel)
    return o[None], states[n:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_requests_read_sources_first_and_keep_only_final_states(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host split, token gathers, sub-batch metadata and final-state scatter, with the chunk kernel replaced
    by the reference: bitwise equal to gdn_recurrent_ref / gdn_recurrent (fp32 states)."""
    monkeypatch.setattr(chunked_mod, "_chunk_kernel", lambda: reference_chunk_kernel)
    for seed in range(3):
        rows = mixed_rows(random.Random(seed), long=(8, 14), short_max=7)
        check_against_reference(batch(rows, hk=2, hv=4, dk=8, dv=12, dtype=dtype, seed=seed), 8, tol=0)


def test_gdn_chunked_sends_exactly_the_flagged_requests_to_the_chunk_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """With per-request flags the chunk kernel gets exactly the flagged requests (short ones included), the rest run
    the loop bitwise as gdn_recurrent, the flagged ones as the stand-in chunk kernel (the reference) computes them."""
    calls = []

    def recording_kernel(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - fla's signature
        calls.append(kwargs["cu_seqlens_cpu"].tolist())
        return reference_chunk_kernel(*args, **kwargs)

    monkeypatch.setattr(chunked_mod, "_chunk_kernel", lambda: recording_kernel)
    rows = [(3, -1, 0, 2), (9, 5, 4, 8), (1, 9, 8, 0), (5, 13, 12, 4), (2, 17, 16, 0)]  # last: a 1+1 verify
    flags = [True, False, True, True, True]
    b = batch(rows, hk=2, hv=4, dk=8, dv=12, dtype=torch.float32, seed=3)
    tensors, host = [b[n] for n in ("q", "k", "v", "g", "beta")], b["host"]
    states = [b["state"].clone() for _ in range(3)]
    kwargs = {f"{name}_cpu": x for name, x in host.items()}
    out = gdn_chunked(*tensors, states[0], **b["meta"], **kwargs, is_chunked_cpu=flags)
    plain = gdn_recurrent(*tensors, states[1], **b["meta"])
    expected = gdn_recurrent_ref(*tensors, states[2], **b["meta"])
    assert calls == [[0, 3, 4, 9]]  # requests 0, 2 and 3 (3, 1 and 5 tokens); the verify keeps every state
    qsl = host["query_start_loc"]
    loop_rows, fla_rows = ([t for r in reqs for t in range(qsl[r], qsl[r + 1])] for reqs in ((1, 4), (0, 2, 3)))
    assert torch.equal(out[loop_rows], plain[loop_rows]) and torch.equal(out[fla_rows], expected[fla_rows])
    assert torch.equal(states[0][[4, 16, 17]], states[1][[4, 16, 17]])  # the loop's requests' slots
    assert torch.equal(states[0][[0, 8, 12]], states[2][[0, 8, 12]])  # the chunk kernel's final states


def test_the_layers_of_a_step_share_one_plan_and_compute_as_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's GDN layers pass one ``plan_cache``: the plan (index tensors, cu_seqlens) is built by the first layer
    only, the next layers hand fla the very same cu_seqlens objects (fla caches its chunk indices by identity), and
    every layer's outputs and states are bitwise those of a call without the cache."""
    seen, built = [], []
    real_of = plan_mod.ChunkedPlan.of

    def recording_kernel(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - fla's signature
        seen.append((kwargs["cu_seqlens"], kwargs["cu_seqlens_cpu"]))
        return reference_chunk_kernel(*args, **kwargs)

    monkeypatch.setattr(chunked_mod, "_chunk_kernel", lambda: recording_kernel)
    monkeypatch.setattr(plan_mod.ChunkedPlan, "of", lambda *a: built.append(a) or real_of(*a))
    rows = mixed_rows(random.Random(5), long=(8, 14), short_max=7)
    cache: dict = {}
    for layer in range(3):
        b = batch(rows, hk=2, hv=4, dk=8, dv=12, dtype=torch.float32, seed=10 + layer)
        tensors, kwargs = [b[n] for n in ("q", "k", "v", "g", "beta")], {f"{n}_cpu": x for n, x in b["host"].items()}
        shared, alone = b["state"].clone(), b["state"].clone()
        out = gdn_chunked(*tensors, shared, **b["meta"], **kwargs, min_chunk_len=8, plan_cache=cache)
        expected = gdn_chunked(*tensors, alone, **b["meta"], **kwargs, min_chunk_len=8)
        assert torch.equal(out, expected) and torch.equal(shared, alone), layer
    assert len(built) == 4  # the shared plan once, and one for each call without the cache
    with_cache = seen[0::2]
    assert all(c is with_cache[0][0] and c_cpu is with_cache[0][1] for c, c_cpu in with_cache)


def test_the_layer_follows_the_rule_flags_instead_of_the_chunk_length(monkeypatch: pytest.MonkeyPatch) -> None:
    """layers/gdn.py sends a step to gdn_chunked when a request is flagged (any length) and, with flags, never for a
    long unflagged chunk; without flags (no rule) by the length rule; fp32 / fp64 models never."""
    from truespec.layers.gdn import _use_chunked_prefill
    from truespec.worker.input_builder import ContextRow, build_forward_context

    monkeypatch.setattr(chunked_mod, "is_available", lambda: True)  # as if fla ran here (on CUDA, not capturing)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    def uses_fla(n: int, flag: bool | None, dtype: torch.dtype = torch.bfloat16) -> bool:
        ctx = build_forward_context([ContextRow([0], 0, n, -1, 0, n - 1, 1, n, flag)], 4096, torch.device("cpu"))
        return _use_chunked_prefill(torch.zeros(1, dtype=dtype), ctx)

    assert [uses_fla(2000, None), uses_fla(1000, None), uses_fla(2000, False), uses_fla(5, True)] == \
        [True, False, False, True]
    assert not uses_fla(5, True, torch.float32) and not uses_fla(2000, None, torch.float64)


def bf16_layer_with_chunk_kernel(monkeypatch: pytest.MonkeyPatch, kernel: object, num_slots: int, seed: int
                                 ) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Generator]:  # fmt: skip
    """A random bf16 GDN layer (2 k-heads, 4 v-heads of 8 / 12), its conv and recurrent states in ``num_slots`` slots
    and the generator that made them; the chunk kernel replaced by ``kernel``, as if fla ran here (CUDA, no capture)."""
    from truespec.layers.gdn import GatedDeltaNet

    monkeypatch.setattr(chunked_mod, "_chunk_kernel", lambda: kernel)
    monkeypatch.setattr(chunked_mod, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    gen = torch.Generator().manual_seed(seed)
    layer = GatedDeltaNet(32, 2, 4, 8, 12, 4, 1e-6, "silu").to(torch.bfloat16)
    for param in layer.parameters():
        param.copy_(torch.randn(param.shape, generator=gen) * param.shape[-1] ** -0.5)
    conv_state = torch.randn(num_slots, layer.conv_dim, 3, generator=gen).to(torch.bfloat16)
    return layer, conv_state, torch.randn(num_slots, 4, 8, 12, generator=gen) * 0.3, gen


@torch.no_grad()
def test_the_layer_normalises_the_chunk_kernels_q_and_k_in_its_conv(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 GDN layer's step with a flagged prompt chunk beside a decode: the conv hands the chunk kernel its rows'
    q and k L2-normalised (unit heads; fla asked not to normalise again), the decode's rows the plain values, and the
    layer's output and states agree with the token loop's for every request (the decode's bit for bit)."""
    from truespec.worker.input_builder import ContextRow, build_forward_context

    calls = []

    def recording_kernel(q, k, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 - fla's signature
        calls.append((q, k, kwargs["use_qk_l2norm_in_kernel"]))
        return reference_chunk_kernel(q, k, *args, **kwargs)

    layer, conv_state, ssm_state, gen = bf16_layer_with_chunk_kernel(monkeypatch, recording_kernel, 8, seed=11)
    rows = [ContextRow(list(range(5)), 0, 70, -1, 2, 69, 1, 70, True), ContextRow([5], 5, 1, 5, 5, 0, 1, 0, False)]
    x = torch.randn(71, 32, generator=gen).to(torch.bfloat16)
    outs, states = [], []
    for fused in (True, False):
        layer.conv_state, layer.ssm_state = conv_state.clone(), ssm_state.clone()
        ctx = build_forward_context(rows if fused else [ContextRow(*[getattr(r, f) for f in (
            "block_ids", "start", "query_len", "state_src", "state_dst", "write_start", "num_logits",
            "num_prompt_rows")], False) for r in rows], 16, torch.device("cpu"))  # fmt: skip
        with set_forward_context(ctx):
            outs.append(layer._forward_kernels(x, ctx))
        states.append((layer.conv_state, layer.ssm_state))
    (q, k, use_l2norm), = calls
    assert not use_l2norm
    for t in (q, k):  # unit heads in bf16: each value within one ulp (2^-7 relative; the interpreter's conversion
        assert t.dtype == torch.bfloat16  # need not round to nearest) of the fp32 one, so the norm too
        torch.testing.assert_close(t.float().norm(dim=-1), torch.ones(t.shape[:-1]), rtol=0, atol=2**-7)
    assert torch.equal(outs[0][70], outs[1][70]) and torch.equal(states[0][1][5], states[1][1][5])
    torch.testing.assert_close(outs[0][:70], outs[1][:70], rtol=0.02, atol=0.02)
    torch.testing.assert_close(states[0][1][2], states[1][1][2], rtol=1e-3, atol=1e-3)
    assert torch.equal(states[0][0], states[1][0])  # conv windows: copies of inputs


# ----------------------------------------------------------------------------------------------------- GPU
needs_fla = pytest.mark.skipif(not is_available(), reason="needs CUDA and fla-core")


@pytest.mark.gpu
@needs_fla
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hk, hv", [(16, 16), (8, 16)])  # Qwen3.5-0.8B; grouped values (GVA)
def test_gpu_chunked_prefill_matches_token_loop(dtype: torch.dtype, hk: int, hv: int) -> None:
    worst = {"out": 0.0, "state": 0.0}
    for seed in range(3):
        rows = mixed_rows(random.Random(seed), long=(64, 700), short_max=63)
        b = batch(rows, hk=hk, hv=hv, dk=128, dv=128, dtype=dtype, seed=seed)
        errors = check_against_reference(b, min_chunk_len=64, tol=GPU_REL_TOL[dtype])
        worst = {n: max(worst[n], errors[n]) for n in worst}
    print(f"\ngdn_chunked vs gdn_recurrent_ref {dtype} hk={hk} hv={hv}: worst relative error {worst}")


@pytest.mark.gpu
@needs_fla
def test_gpu_chunked_prefill_without_fused_l2norm() -> None:
    rows = mixed_rows(random.Random(5), long=(64, 300), short_max=63)
    b = batch(rows, hk=4, hv=4, dk=64, dv=96, dtype=torch.float32, seed=5)
    b["q"], b["k"] = (torch.nn.functional.normalize(b[n], dim=-1) for n in ("q", "k"))  # keep the rule stable
    tensors, state = [b[n] for n in ("q", "k", "v", "g", "beta")], b["state"].clone()
    out = gdn_chunked(*tensors, b["state"], **b["meta"], use_qk_l2norm=False, min_chunk_len=64)
    expected = gdn_recurrent_ref(*tensors, state, **b["meta"], use_qk_l2norm=False)
    assert rel_err(out, expected) < GPU_REL_TOL[torch.float32] and rel_err(b["state"], state) < 1e-2


@pytest.mark.gpu
@needs_fla
@pytest.mark.parametrize("hk, hv, dk, dv", [(16, 16, 128, 128), (8, 16, 128, 128), (4, 4, 64, 96)])
def test_gpu_pinned_fla_configs_give_the_tuned_configs_bits(hk: int, hv: int, dk: int, dv: int) -> None:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from truespec.kernels import fla_configs

    if not fla_configs.pin():
        pytest.skip("no fla configs pinned for this GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    lengths = [700, 64, 1, 300, 129]  # ragged: a chunk-sized and a one-token sequence among them
    t = sum(lengths)
    # as gdn_chunked calls fla in a bf16 model: q / k / v in bf16, q / k normalised before (by the conv)
    q, k = (torch.nn.functional.normalize(torch.randn(1, t, hk, dk, device="cuda", generator=gen), dim=-1)
            .to(torch.bfloat16) for _ in range(2))  # fmt: skip
    v = torch.randn(1, t, hv, dv, device="cuda", generator=gen).to(torch.bfloat16)
    g = -0.1 * torch.rand(1, t, hv, device="cuda", generator=gen)
    beta = torch.rand(1, t, hv, device="cuda", generator=gen)
    h0 = 0.1 * torch.randn(len(lengths), hv, dk, dv, device="cuda", generator=gen)
    cu_cpu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        return chunk_gated_delta_rule(q, k, v, g, beta, scale=dk**-0.5, initial_state=h0, output_final_state=True,
                                      use_qk_l2norm_in_kernel=False, cu_seqlens=cu_cpu.cuda(), cu_seqlens_cpu=cu_cpu)

    pinned = run()
    fla_configs.unpin()
    try:
        tuned = run()
    finally:
        fla_configs.pin()
    assert all(torch.equal(a, b) for a, b in zip(pinned, tuned, strict=True))
