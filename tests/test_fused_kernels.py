"""The fused elementwise kernels of a decoder layer against their torch references, and the layers' CUDA
path (the kernels) against their CPU path, through whole models.

Kernels: act_mul (SwiGLU's silu(gate) * up, gated attention's out * sigmoid(gate)), add_rms_norm (the
residual add fused into the next norm), qk_norm_rope (per-head q/k norm + partial neox RoPE of q and k),
gdn_gating (GDN's g and beta). Inputs are random (never zero), ragged in their row counts, and strided
the way the models pass them (views of one merged projection output). Without CUDA the kernels run in
Triton's interpreter (see tests/helpers/kernels.py); ``@pytest.mark.gpu`` tests rerun them at Qwen3.5-0.8B sizes.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():  # the interpreter must be on before truespec.kernels is first imported
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

import truespec.layers.activation as activation  # noqa: E402
import truespec.layers.norm as norm  # noqa: E402
import truespec.layers.rotary as rotary  # noqa: E402
from helpers.models import F, L, NaiveRunner, StepRequest, tiny_llama_config, tiny_qwen3_5_config, tiny_qwen3_config  # noqa: E402
from truespec.kernels import (  # noqa: E402
    act_mul,
    act_mul_ref,
    add_rms_norm,
    add_rms_norm_ref,
    gdn_gating,
    gdn_gating_ref,
    qk_norm_rope,
    qk_norm_rope_ref,
)
from truespec.models.llama import LlamaForCausalLM  # noqa: E402
from truespec.models.qwen3 import Qwen3ForCausalLM  # noqa: E402
from truespec.models.qwen3_5 import Qwen3_5ForCausalLM  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float64, torch.bfloat16]
TOL = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 3e-2}
ROW_COUNTS = [1, 4, 7]  # a decode, a 1+3 verify, a ragged prefill chunk
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def randn(*shape: int, dtype: torch.dtype, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(device=DEVICE, dtype=dtype)


def assert_near(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, tol_scale: float = 1.0) -> None:
    tol = TOL[dtype] * tol_scale
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


# ------------------------------------------------------------------------------------------ elementwise
def check_silu_and_mul(dtype: torch.dtype, num_tokens: int, intermediate: int, tol_scale: float = 1.0) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    gate, up = randn(num_tokens, 2 * intermediate, dtype=dtype, gen=gen, scale=3.0).chunk(2, dim=-1)  # merged
    out = act_mul(gate, up, "silu")
    assert out.is_contiguous() and out.shape == (num_tokens, intermediate)
    assert_near(out, act_mul_ref(gate, up, "silu"), dtype, tol_scale)


def check_sigmoid_gate(dtype: torch.dtype, num_tokens: int, heads: int, head_dim: int, tol_scale: float = 1.0) -> None:
    """Qwen3.5 attention: the gate is the second half of each head of the q projection (a strided view)."""
    gen = torch.Generator().manual_seed(10 + num_tokens)
    q_gate = randn(num_tokens, heads, 2 * head_dim, dtype=dtype, gen=gen, scale=3.0)
    gate, attn_out = q_gate[..., head_dim:], randn(num_tokens, heads, head_dim, dtype=dtype, gen=gen)
    assert_near(act_mul(gate, attn_out, "sigmoid"), act_mul_ref(gate, attn_out, "sigmoid"), dtype, tol_scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", ROW_COUNTS)
def test_act_mul_matches_reference_on_merged_views(dtype: torch.dtype, num_tokens: int) -> None:
    check_silu_and_mul(dtype, num_tokens, intermediate=37)
    check_sigmoid_gate(dtype, num_tokens, heads=3, head_dim=12)


def check_add_rms_norm(
    dtype: torch.dtype, num_tokens: int, dim: int, unit_offset: bool, tol_scale: float = 1.0
) -> None:
    gen = torch.Generator().manual_seed(20 + num_tokens)
    x, residual = randn(num_tokens, dim, dtype=dtype, gen=gen), randn(num_tokens, dim, dtype=dtype, gen=gen, scale=4)
    weight = randn(dim, dtype=dtype, gen=gen, scale=0.2) + (0 if unit_offset else 1)
    out, new_residual = add_rms_norm(x, residual, weight, 1e-6, unit_offset)
    expected, expected_residual = add_rms_norm_ref(x, residual, weight, 1e-6, unit_offset)
    if dtype == torch.bfloat16 and DEVICE.type != "cuda":  # the interpreter truncates fp32 -> bf16 casts
        assert_near(new_residual, expected_residual, dtype)
    else:  # one rounded add: bitwise the torch sum
        assert torch.equal(new_residual, expected_residual)
    assert_near(out, expected, dtype, tol_scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unit_offset", [False, True])
def test_add_rms_norm_returns_the_torch_sum_and_its_norm(dtype: torch.dtype, unit_offset: bool) -> None:
    for num_tokens in ROW_COUNTS:
        check_add_rms_norm(dtype, num_tokens, dim=40, unit_offset=unit_offset)


def check_qk_norm_rope(
    dtype: torch.dtype,
    num_tokens: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    norm_form: str,
    gated: bool,
    tol_scale: float = 1.0,
) -> None:
    """q, k are views of one merged qkv output (q interleaved with its gate per head when ``gated``)."""
    gen = torch.Generator().manual_seed(30 + num_tokens + rotary_dim)
    q_width = (2 if gated else 1) * heads * head_dim
    qkv = randn(num_tokens, q_width + 2 * kv_heads * head_dim, dtype=dtype, gen=gen)
    q, k, _ = qkv.split([q_width, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.unflatten(-1, (heads, 2 * head_dim))[..., :head_dim] if gated else q.unflatten(-1, (heads, head_dim))
    k = k.unflatten(-1, (kv_heads, head_dim))
    positions = torch.randint(0, 5000, (num_tokens,), generator=gen).to(DEVICE)
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    cos, sin = rotary.RotaryEmbedding(head_dim, rotary_dim, inv_freq, 1.0).to(DEVICE)(positions, dtype)
    weights = {"none": (None, None), "plain": (1.0, 1.0), "unit_offset": (0.0, 0.0)}[norm_form]
    if norm_form != "none":
        weights = tuple(randn(head_dim, dtype=dtype, gen=gen, scale=0.2) + w for w in weights)
    args = (q, k, cos, sin, *weights, 1e-6, norm_form == "unit_offset")
    (q_out, k_out), (q_ref, k_ref) = qk_norm_rope(*args), qk_norm_rope_ref(*args)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    assert_near(q_out, q_ref, dtype, tol_scale)
    assert_near(k_out, k_ref, dtype, tol_scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("norm_form", "rotary_dim", "gated"),
    [("unit_offset", 4, True), ("unit_offset", 8, True), ("plain", 12, False), ("none", 12, False)],
    ids=["qwen3_5_quarter_rotary", "qwen3_5_half_rotary", "qwen3", "llama"],
)
def test_qk_norm_rope_matches_reference(dtype: torch.dtype, norm_form: str, rotary_dim: int, gated: bool) -> None:
    for num_tokens in ROW_COUNTS:
        check_qk_norm_rope(dtype, num_tokens, 4, 2, 12, rotary_dim, norm_form, gated)


def check_gdn_gating(dtype: torch.dtype, num_tokens: int, heads: int, tol_scale: float = 1.0) -> None:
    """a and b are column slices of one merged in_proj output; a spans softplus' both branches (|x| > 20)."""
    gen = torch.Generator().manual_seed(40 + num_tokens)
    merged = randn(num_tokens, 3 + 2 * heads, dtype=dtype, gen=gen, scale=12.0)
    b, a = merged[:, 3 : 3 + heads], merged[:, 3 + heads :]
    A_log, dt_bias = randn(heads, dtype=dtype, gen=gen), randn(heads, dtype=dtype, gen=gen)  # noqa: N806
    (g, beta), (g_ref, beta_ref) = gdn_gating(a, b, A_log, dt_bias), gdn_gating_ref(a, b, A_log, dt_bias)
    assert g.dtype == g_ref.dtype and g.is_contiguous() and beta.is_contiguous()
    assert_near(g, g_ref, dtype, tol_scale)
    assert_near(beta, beta_ref, dtype, tol_scale)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_rows_from_the_fixed_table_are_the_bits_of_their_positions_angles(dtype: torch.dtype,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's RoPE on CUDA (``init_fixed_table``): each step gathers its rows of one [P, 2 R] table instead
    of computing them. Each row has the bits the position's own angles give (the table comes from the same ops, in
    chunks), a position past the table reads its last row, and the kernel reads the gathered views (row stride 2 R)
    as it reads contiguous cos / sin: the same q / k bits."""
    monkeypatch.setattr(rotary, "TABLE_CHUNK", 64)  # 300 positions in 5 chunks
    head_dim, rotary_dim, num_positions = 16, 8, 300
    inv_freq = 1.0 / (1e7 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    rope = rotary.RotaryEmbedding(head_dim, rotary_dim, inv_freq, 1.0)
    rope.init_buffers(DEVICE)
    gen = torch.Generator().manual_seed(7)
    positions = torch.randint(0, num_positions, (13,), generator=gen).to(DEVICE)
    angles = rope._angles(positions, dtype)
    rope.init_fixed_table(num_positions, dtype)
    cos, sin = rope(positions, dtype)
    assert cos.stride(0) == sin.stride(0) == 2 * rotary_dim
    assert torch.equal(cos, angles[0]) and torch.equal(sin, angles[1])
    past = rope(torch.tensor([num_positions + 5], device=DEVICE), dtype)
    assert torch.equal(past[0], rope._angles(torch.tensor([num_positions - 1], device=DEVICE), dtype)[0])
    q, k = randn(13, 2, head_dim, dtype=dtype, gen=gen), randn(13, 1, head_dim, dtype=dtype, gen=gen)
    for a, b in zip(qk_norm_rope(q, k, cos, sin, None, None, 0.0, False),
                    qk_norm_rope(q, k, *angles, None, None, 0.0, False), strict=True):
        assert torch.equal(a, b)


def test_a_drafter_head_shares_its_targets_rope_table() -> None:
    """``share_fixed_tables``: one table per set of frequencies (an MTP head's RoPE is its target's), another for
    other frequencies."""
    def rope(theta: float) -> rotary.RotaryEmbedding:
        inv_freq = 1.0 / (theta ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
        return rotary.RotaryEmbedding(16, 8, inv_freq, 1.0)

    target, head, other = torch.nn.Sequential(rope(1e7)), torch.nn.Sequential(rope(1e7)), torch.nn.Sequential(rope(1e4))
    rotary.share_fixed_tables([target, head, other], 64, torch.float32)
    assert target[0].fixed_table is head[0].fixed_table and target[0].fixed_table.shape == (64, 16)
    assert other[0].fixed_table is not target[0].fixed_table
    assert not torch.equal(other[0].fixed_table, target[0].fixed_table)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gdn_gating_matches_reference(dtype: torch.dtype) -> None:
    for num_tokens in ROW_COUNTS:
        check_gdn_gating(dtype, num_tokens, heads=6)


def test_kernels_accept_an_empty_step() -> None:
    empty = torch.empty(0, 8, device=DEVICE)
    assert act_mul(empty, empty, "silu").shape == (0, 8)
    assert add_rms_norm(empty, empty, torch.ones(8, device=DEVICE), 1e-6)[1].shape == (0, 8)
    assert gdn_gating(empty, empty, torch.ones(8, device=DEVICE), torch.ones(8, device=DEVICE))[0].shape == (0, 8)
    q = torch.empty(0, 2, 8, device=DEVICE)
    assert qk_norm_rope(q, q, empty[:, :4], empty[:, :4])[0].shape == (0, 2, 8)


# ---------------------------------------------------------------------- layers: CUDA path == CPU path
MODELS = {
    "qwen3_5": (Qwen3_5ForCausalLM, lambda: tiny_qwen3_5_config([L, F, L, F], partial_rotary_factor=0.5)),
    "qwen3": (Qwen3ForCausalLM, lambda: tiny_qwen3_config(attention_bias=True)),
    "llama": (LlamaForCausalLM, lambda: tiny_llama_config(mlp_bias=True)),
}


@torch.no_grad()
def random_model(name: str) -> torch.nn.Module:
    cls, config = MODELS[name]
    torch.manual_seed(0)
    model = cls(config()).to(device=DEVICE, dtype=torch.float64).eval()
    for param in model.parameters():  # matrices ~ N(0, 1/fan_in); vectors get noise around their init
        param.normal_(0.0, param.shape[-1] ** -0.5) if param.ndim >= 2 else param.add_(0.1 * torch.randn_like(param))
    model.init_buffers(DEVICE)
    return model


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fused_layer_path_reproduces_the_torch_path(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decoder layers' CUDA wiring (merged GEMM views -> act_mul, add_rms_norm, qk_norm_rope, rms_norm)
    gives the CPU path's logits in float64, for a batch of a prefill and a decode continuing a cache."""
    model = random_model(name)
    reqs = [StepRequest(0, 5, [0, 1], state_dst=0), StepRequest(0, 3, [2], state_dst=2)]
    ids = [[5, 9, 2, 7, 1], [3, 8, 4]]
    outputs = []
    for fused in (False, True):
        for module in (activation, norm, rotary):
            monkeypatch.setattr(module, "use_kernels", lambda t, fused=fused: fused)
        runner = NaiveRunner(model, num_blocks=8, block_size=4, num_slots=4)
        prefill = runner.step(reqs, ids)
        decode = runner.step([StepRequest(5, 1, [0, 1], 0, 1), StepRequest(3, 1, [2], 2, 3)], [[6], [2]])
        outputs.append(torch.cat(prefill + decode))
    assert_near(outputs[1], outputs[0], torch.float64)


# ------------------------------------------------------------------------- GPU: Qwen3.5-0.8B sizes, compiled
GPU_DTYPES = [torch.bfloat16, torch.float32]
GPU_TOL_SCALE = 5.0  # compiled tl.exp / sqrt are approximate in fp32


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_fused_kernels_at_qwen3_5_size(dtype: torch.dtype) -> None:
    for num_tokens in (1, 6, 37, 512):
        check_silu_and_mul(dtype, num_tokens, intermediate=3584, tol_scale=GPU_TOL_SCALE)
        check_sigmoid_gate(dtype, num_tokens, heads=8, head_dim=256, tol_scale=GPU_TOL_SCALE)
        check_add_rms_norm(dtype, num_tokens, dim=1024, unit_offset=True, tol_scale=GPU_TOL_SCALE)
        check_qk_norm_rope(dtype, num_tokens, 8, 2, 256, 64, "unit_offset", gated=True, tol_scale=GPU_TOL_SCALE)
        check_gdn_gating(dtype, num_tokens, heads=16, tol_scale=GPU_TOL_SCALE)


def test_an_engine_on_rope_tables_gives_the_same_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine builds the tables on CUDA; here on the CPU (float64, MTP): once its target and MTP head gather
    their RoPE rows from shared tables (the angles, and the CPU's own table, are never used again: they would raise),
    every token is the same."""
    from truespec import LLM, SamplingParams

    llm = LLM(dtype="float64", device="cpu", max_model_len=256, max_num_seqs=2,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    prompts, params = ["def add(a, b):", "import os\n"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    engine = llm.llm_engine
    models = [engine.runner.model, engine.handoff.proposer.head]
    rotary.share_fixed_tables(models, 256 + 2 + 1, torch.float64)
    ropes = [m for model in models for m in model.modules() if isinstance(m, rotary.RotaryEmbedding)]
    assert len(ropes) == 2 and ropes[0].fixed_table is ropes[1].fixed_table

    def computed(*args: object) -> None:
        raise AssertionError("RoPE angles computed despite the table")
    monkeypatch.setattr(rotary.RotaryEmbedding, "_angles", computed)
    monkeypatch.setattr(rotary.RotaryEmbedding, "_table", computed)  # the CPU's own growing table
    llm.reset_prefix_cache()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_rope_table_rows_are_their_angles_bits_at_qwen3_5_length(dtype: torch.dtype) -> None:
    """Qwen3.5's RoPE (head_dim 256, rotary 64, theta 1e7) over its 262,144 positions (+ 4 lookahead): CUDA's
    cos / sin of each row, gathered from the table, have the bits computed for the step's own positions."""
    inv_freq = 1.0 / (1e7 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    rope = rotary.RotaryEmbedding(256, 64, inv_freq, 1.0)
    rope.init_buffers(torch.device("cuda"))
    num_positions = 262_144 + 4
    gen = torch.Generator().manual_seed(11)
    positions = torch.cat([torch.randint(0, num_positions, (4093,), generator=gen),
                           torch.tensor([0, 1, num_positions - 2, num_positions - 1])]).cuda()
    expected = rope._angles(positions, dtype)
    rope.init_fixed_table(num_positions, dtype)
    for got, want in zip(rope(positions, dtype), expected, strict=True):
        assert torch.equal(got, want)


@gpu
@needs_cuda
def test_gpu_an_engine_on_rope_tables_gives_the_bits_of_one_without(monkeypatch: pytest.MonkeyPatch) -> None:
    """The embedded model with MTP, bf16, CUDA graphs: with the engine's RoPE tables (the default on CUDA) and
    without them (each forward computes its angles), the same tokens and logprob bits."""
    from truespec import LLM, SamplingParams
    from truespec.engine import model_setup

    prompts = ["def add(a, b):", "import os\n", "class Stack:\n    def push(self, x):"]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=1)

    def run() -> list[tuple[list[int], list[float]]]:
        llm = LLM(dtype="bfloat16", device="cuda", max_model_len=512, max_num_seqs=4,
                  speculative_config={"method": "mtp", "num_speculative_tokens": 3})
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids,
                                                                  strict=True)]) for o in outs]

    with_tables = run()
    monkeypatch.setattr(model_setup, "share_fixed_tables", lambda *args: None)
    assert run() == with_tables
