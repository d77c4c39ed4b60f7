"""A whole Qwen3.5 gated-attention decoder layer in one compiled call (cpu_kernels/attention_layer.py,
attention_layer.c) against the same layer stage by stage: output, residual stream and the KV cache **bitwise** on
ragged steps (decodes, 1+k verifies, chunks over cached keys starting mid-block, a longer prompt chunk, padding rows),
with and without an incoming residual, float32 and float64 (each stage is the same C function on both paths); short
rows bitwise the same beside a long chunk; a request bitwise the same alone and in the batch (invariant 4); the kept
call follows changed weights and a rebound cache; bad shapes named; the model's layers take it at every step."""

from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from helpers.kernels import NUM_PAD_TOKENS, make_context, paged_batch
from truespec.cpu_kernels import attention_layer as cpu_attention_layer
from truespec.cpu_kernels import build
from truespec.forward_context import set_forward_context
from truespec.models.qwen3_5 import Qwen3_5DecoderLayer

pytestmark = pytest.mark.skipif(build.load() is None, reason="no C compiler: the CPU path keeps its torch ops")
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, ROT, BLOCK_SIZE, NUM_BLOCKS = 24, 4, 2, 8, 4, 4, 40
# (num_cached, query_len): decodes, a 1+3 verify, a 16-token chunk after a cached prefix (mid-block), a fresh prompt
SHORT = [(9, 1), (0, 1), (6, 4), (13, 16), (0, 5)]
LONG = (3, 17)  # a prompt chunk longer than the torch path batches (ops/attention_rows.MAX_BATCHED_QUERY_LEN)


def decoder_layer(dtype: torch.dtype, seed: int = 5) -> Qwen3_5DecoderLayer:
    config = SimpleNamespace(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                             head_dim=HEAD_DIM, attention_bias=False, rms_norm_eps=1e-6, hidden_act="silu",
                             intermediate_size=20)  # fmt: skip
    layer = Qwen3_5DecoderLayer(config, "full_attention").to(dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(*param.shape, generator=gen, dtype=dtype) * param.shape[-1] ** -0.5)
    cache = torch.randn(layer.self_attn.attn.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE), generator=gen, dtype=dtype)
    layer.self_attn.attn.kv_cache = cache
    return layer


def inputs(reqs: list, dtype: torch.dtype, seed: int, residual: bool = True) -> tuple:
    """(metadata, h, residual or None, cos, sin) of a step over ``reqs`` plus NUM_PAD_TOKENS padding rows."""
    gen = torch.Generator().manual_seed(seed)
    batch = paged_batch(reqs, BLOCK_SIZE, NUM_BLOCKS, gen)
    num_rows = sum(n for _, n in reqs) + NUM_PAD_TOKENS
    h, res = (torch.randn(num_rows, HIDDEN, generator=gen, dtype=dtype) for _ in range(2))
    angles = torch.rand(num_rows, ROT // 2, generator=gen, dtype=torch.float64) * 6
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    return batch, h, res if residual else None, cos, sin


@torch.no_grad()
def run(layer: Qwen3_5DecoderLayer, step: tuple, whole: bool, monkeypatch: pytest.MonkeyPatch) -> tuple:
    """(output, residual, kv cache) of one forward from a copy of the layer's cache; asserts which path ran."""
    batch, h, residual, cos, sin = step
    attn = layer.self_attn.attn
    cache, attn.kv_cache = attn.kv_cache, attn.kv_cache.clone()
    monkeypatch.setattr(cpu_attention_layer, "ENABLED", whole)
    calls = []
    call = cpu_attention_layer.AttentionLayerCall.__call__
    monkeypatch.setattr(cpu_attention_layer.AttentionLayerCall, "__call__", lambda *a, f=call: calls.append(1) or f(*a))
    with set_forward_context(make_context(batch, h.shape[0])):
        out, res = layer(h, residual, cos, sin)
    assert len(calls) == int(whole)
    result, attn.kv_cache = (out, res, attn.kv_cache), cache
    return result


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("has_residual", [True, False], ids=["residual", "first_layer"])
@pytest.mark.parametrize("reqs", [SHORT, [*SHORT, LONG]], ids=["short", "with_long_chunk"])
def test_whole_layer_gives_the_stage_by_stage_bits(dtype: torch.dtype, has_residual: bool, reqs: list,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    layer = decoder_layer(dtype)
    step = inputs(reqs, dtype, seed=1, residual=has_residual)
    got = run(layer, step, True, monkeypatch)
    expected = run(layer, step, False, monkeypatch)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(got[2], layer.self_attn.attn.kv_cache)  # the step's keys and values were stored


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_short_rows_keep_their_bits_beside_a_long_chunk(dtype: torch.dtype,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    # a long prompt chunk in the step: every other request's rows must not notice
    layer = decoder_layer(dtype, seed=7)
    batch, h, residual, cos, sin = inputs([*SHORT, LONG], dtype, seed=2)
    mixed = run(layer, (batch, h, residual, cos, sin), True, monkeypatch)
    num_short = sum(n for _, n in SHORT)
    short = {key: batch[key][: len(SHORT) + (key == "query_start_loc")] for key in ("query_start_loc", "seq_lens",
                                                                                     "block_tables")}  # fmt: skip
    short["slot_mapping"] = batch["slot_mapping"][:num_short]
    rows = slice(0, num_short)
    alone = run(layer, (short, h[rows], residual[rows], cos[rows], sin[rows]), True, monkeypatch)
    assert torch.equal(alone[0], mixed[0][rows]) and torch.equal(alone[1], mixed[1][rows])
    slots = batch["slot_mapping"][:num_short]
    assert torch.equal(alone[2][:, slots // BLOCK_SIZE, slots % BLOCK_SIZE],
                       mixed[2][:, slots // BLOCK_SIZE, slots % BLOCK_SIZE])  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_request_gives_the_same_bits_alone_and_in_the_batch(dtype: torch.dtype,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    layer = decoder_layer(dtype, seed=3)
    batch, h, residual, cos, sin = inputs(SHORT, dtype, seed=4)
    out, res, _ = run(layer, (batch, h, residual, cos, sin), True, monkeypatch)
    qsl = batch["query_start_loc"].tolist()
    for r in range(len(SHORT)):
        rows = slice(qsl[r], qsl[r + 1])
        one = {"query_start_loc": torch.tensor([0, rows.stop - rows.start]), "seq_lens": batch["seq_lens"][r:r + 1],
               "block_tables": batch["block_tables"][r:r + 1], "slot_mapping": batch["slot_mapping"][rows]}
        alone = run(layer, (one, h[rows], residual[rows], cos[rows], sin[rows]), True, monkeypatch)
        assert torch.equal(alone[0], out[rows]) and torch.equal(alone[1], res[rows])


def weights(layer: Qwen3_5DecoderLayer, **change: torch.Tensor) -> cpu_attention_layer.AttentionLayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    w = cpu_attention_layer.AttentionLayerWeights(
        layer.input_layernorm.weight, 1e-6, True, layer.post_attention_layernorm.weight, 1e-6, True,
        attn.qkv_proj.weight, attn.o_proj.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight, attn.q_norm.weight,
        attn.k_norm.weight, 1e-6, True, (HEADS, KV_HEADS, HEAD_DIM), HEAD_DIM**-0.5)  # fmt: skip
    return w._replace(**change)


def test_bad_shapes_are_named() -> None:
    layer = decoder_layer(torch.float32)
    cache = layer.self_attn.attn.kv_cache
    bad_o = weights(layer, o_proj=layer.self_attn.o_proj.weight[:, :-1])
    with pytest.raises(ValueError, match=r"o_proj \(24, 31\) \(expected \(24, 32\)\)"):
        cpu_attention_layer.AttentionLayerCall(bad_o, cache)
    with pytest.raises(ValueError, match=r"k_norm \(7,\) \(expected \(8,\)\)"):
        cpu_attention_layer.AttentionLayerCall(weights(layer, k_norm=layer.self_attn.k_norm.weight[:-1]), cache)
    call = cpu_attention_layer.AttentionLayerCall(weights(layer), cache)
    batch, h, residual, cos, sin = inputs(SHORT, torch.float32, seed=1)
    meta = tuple(batch[k] for k in ("block_tables", "query_start_loc", "seq_lens", "slot_mapping"))
    with torch.no_grad(), pytest.raises(ValueError, match=r"cos \(3, 4\) / sin \(3, 4\) for 29 rows"):
        call(h, residual, cos[:3], sin[:3], meta)


@pytest.mark.parametrize("change", ["none", "in_place", "replaced", "data", "cache"])
@torch.no_grad()
def test_kept_call_follows_changed_weights_and_cache(change: str) -> None:
    dtype = torch.float64
    layer = decoder_layer(dtype)
    attn = layer.self_attn
    batch, h, residual, cos, sin = inputs(SHORT, dtype, seed=6)
    context = make_context(batch, h.shape[0])
    with set_forward_context(context):
        layer(h, residual, cos, sin)  # builds and keeps the call
    kept = layer.cpu_calls.kept("attention_layer")
    if change == "in_place":
        attn.qkv_proj.weight.mul_(-2.0)
    elif change == "replaced":
        attn.k_norm.weight = torch.nn.Parameter(attn.k_norm.weight + 0.5)
    elif change == "data":
        layer.post_attention_layernorm.weight.data = layer.post_attention_layernorm.weight.data + 1.0
    elif change == "cache":
        attn.attn.kv_cache = attn.attn.kv_cache.clone()
    before = attn.attn.kv_cache.clone()
    with set_forward_context(context):
        got = layer(h, residual, cos, sin)
    assert (layer.cpu_calls.kept("attention_layer") is kept) == (change == "none")
    got_cache, attn.attn.kv_cache = attn.attn.kv_cache, before
    with set_forward_context(context), mock.patch.object(cpu_attention_layer, "ENABLED", False):
        expected = layer(h, residual, cos, sin)
    for a, b in zip((*got, got_cache), (*expected, attn.attn.kv_cache), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("stack", [True, False], ids=["stack", "per_layer"])
def test_the_models_attention_layers_take_it_at_every_step(stack: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # every step of a run takes the call, a 90-token prompt's chunks too: inside the model's one call for all its
    # layers (cpu_kernels/decoder_stack.py), or one call per layer without it
    from truespec import LLM, SamplingParams
    from truespec.assets import DEFAULT_MODEL_DIR
    from truespec.cpu_kernels import decoder_stack as cpu_decoder_stack

    monkeypatch.setattr(cpu_decoder_stack, "ENABLED", stack)
    calls = []
    for cls in (cpu_attention_layer.AttentionLayerCall, cpu_decoder_stack.DecoderStackCall):
        call = cls.__call__
        monkeypatch.setattr(cls, "__call__", lambda *a, f=call, c=cls: calls.append(c) or f(*a))
    llm = LLM(str(DEFAULT_MODEL_DIR), dtype="float32", device="cpu", max_model_len=256)
    llm.generate({"prompt_token_ids": list(range(10, 100))},
                 SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)  # fmt: skip
    attention_layers = sum(1 for t in llm.llm_engine.hf_config.layer_types if t == "full_attention")
    num_steps = llm.get_metrics()["num_steps"]
    if stack:
        assert calls == [cpu_decoder_stack.DecoderStackCall] * num_steps and num_steps > 0
    else:
        assert calls == [cpu_attention_layer.AttentionLayerCall] * num_steps * attention_layers and num_steps > 0
