"""Every decoder layer of a CPU step in one compiled call (cpu_kernels/decoder_stack.py, decoder_stack.c) against one
call per layer, on the embedded model through the engine: the same tokens and **bitwise** the same log-probabilities
on a ragged batch (prompt chunks, decodes, ngram verifies), float32 and float64; the kept stack follows a layer whose
weights changed; a step some layer cannot take runs layer by layer."""

import pytest
import torch

from truespec import LLM, SamplingParams
from truespec.assets import DEFAULT_MODEL_DIR
from truespec.cpu_kernels import attention_layer as cpu_attention_layer
from truespec.cpu_kernels import build
from truespec.cpu_kernels import decoder_stack as cpu_decoder_stack

pytestmark = pytest.mark.skipif(build.load() is None, reason="no C compiler: the CPU path keeps its torch ops")
PROMPTS = [{"prompt_token_ids": list(range(10, 10 + n))} for n in (5, 23, 40, 9)] + ["def add(a, b):\n    return"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}


def generate(llm: LLM, stack: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list, list]:
    """(token ids, log-probabilities) per prompt, with the stack on or off; asserts it ran at every step (prompt chunks
    of any length included) or not at all."""
    monkeypatch.setattr(cpu_decoder_stack, "ENABLED", stack)
    calls = []
    call = cpu_decoder_stack.DecoderStackCall.__call__
    monkeypatch.setattr(cpu_decoder_stack.DecoderStackCall, "__call__", lambda *a, f=call: calls.append(1) or f(*a))
    llm.reset_prefix_cache()  # the same prompt chunks each run (a cached prefix would change where chunks start)
    steps = llm.get_metrics()["num_steps"]
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, logprobs=3, ignore_eos=True),
                        use_tqdm=False)  # fmt: skip
    num_steps = llm.get_metrics()["num_steps"] - steps
    assert len(calls) == num_steps > 0 if stack else not calls
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]


def assert_layer_by_layer(llm: LLM, expected_tokens: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the stack on, a run that never takes it (some layer cannot) gives the per-layer tokens."""
    monkeypatch.setattr(cpu_decoder_stack, "ENABLED", True)
    calls = []
    call = cpu_decoder_stack.DecoderStackCall.__call__
    monkeypatch.setattr(cpu_decoder_stack.DecoderStackCall, "__call__", lambda *a, f=call: calls.append(1) or f(*a))
    llm.reset_prefix_cache()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, logprobs=3, ignore_eos=True),
                        use_tqdm=False)  # fmt: skip
    assert not calls and [o.outputs[0].token_ids for o in outs] == expected_tokens


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("spec", [None, NGRAM], ids=["plain", "ngram"])
def test_the_stack_gives_the_per_layer_bits(dtype: str, spec: dict | None, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(str(DEFAULT_MODEL_DIR), dtype=dtype, device="cpu", max_model_len=256, max_num_seqs=3,
              speculative_config=spec)  # fmt: skip
    stacked = generate(llm, True, monkeypatch)
    per_layer = generate(llm, False, monkeypatch)
    assert stacked == per_layer


def test_the_kept_stack_follows_a_changed_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(str(DEFAULT_MODEL_DIR), dtype="float64", device="cpu", max_model_len=256)
    model = llm.llm_engine.runner.model.model
    generate(llm, True, monkeypatch)
    kept = model.cpu_stack.stack
    with torch.no_grad():
        model.layers[3].mlp.down_proj.weight.mul_(1.5)  # an attention layer's weight, in place
    stacked = generate(llm, True, monkeypatch)
    assert model.cpu_stack.stack is not kept
    assert stacked == generate(llm, False, monkeypatch)


def test_a_layer_without_its_call_sends_the_step_layer_by_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(str(DEFAULT_MODEL_DIR), dtype="float32", device="cpu", max_model_len=256)
    expected = generate(llm, False, monkeypatch)
    monkeypatch.setattr(cpu_attention_layer, "ENABLED", False)
    assert_layer_by_layer(llm, expected[0], monkeypatch)


def test_the_kept_stack_follows_rebound_caches_and_states(monkeypatch: pytest.MonkeyPatch) -> None:
    # the stack binds every layer's cache and state pointers: rebinding any of them (as a runner would) must rebuild it
    llm = LLM(str(DEFAULT_MODEL_DIR), dtype="float64", device="cpu", max_model_len=256)
    model = llm.llm_engine.runner.model.model
    expected = generate(llm, True, monkeypatch)
    for rebind in ("kv_cache", "ssm_state"):
        kept = model.cpu_stack.stack
        for layer in model.layers:
            owner = layer.self_attn.attn if layer.layer_type == "full_attention" else layer.linear_attn
            if hasattr(owner, rebind):
                setattr(owner, rebind, getattr(owner, rebind).clone())
        assert generate(llm, True, monkeypatch) == expected
        assert model.cpu_stack.stack is not kept


@pytest.mark.parametrize("wrapped", ["outside", "inside"], ids=["parameter_outside", "parameter_inside"])
def test_an_inference_tensor_weight_sends_the_step_layer_by_layer(wrapped: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # a weight made under torch.inference_mode has no version counter (made a Parameter inside inference mode, reading
    # it raises; outside, it reads 0): its layer keeps the stages, so the stack is off
    llm = LLM(str(DEFAULT_MODEL_DIR), dtype="float32", device="cpu", max_model_len=256)
    expected = generate(llm, False, monkeypatch)
    norm = llm.llm_engine.runner.model.model.layers[5].input_layernorm
    with torch.inference_mode():
        weight = norm.weight.detach().clone()
        if wrapped == "inside":
            norm.weight = torch.nn.Parameter(weight, requires_grad=False)
    if wrapped == "outside":
        norm.weight = torch.nn.Parameter(weight, requires_grad=False)
    assert norm.weight.is_inference()
    assert_layer_by_layer(llm, expected[0], monkeypatch)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_weights_packed_as_bf16_give_the_wide_bits(dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The embedded model's bf16 checkpoint run in float32 / float64: its projections pack as bfloat16
    (linear.NARROW), and a run gives the tokens and log-probabilities of a run over wide packed copies, bit for bit
    (ngram verifies included)."""
    from truespec.cpu_kernels import linear as cpu_linear

    runs = []
    for narrow in (True, False):
        monkeypatch.setattr(cpu_linear, "NARROW", narrow)
        llm = LLM(str(DEFAULT_MODEL_DIR), dtype=dtype, device="cpu", max_model_len=256, max_num_seqs=3,
                  speculative_config=NGRAM)  # fmt: skip
        runs.append(generate(llm, True, monkeypatch))
        layer = llm.llm_engine.runner.model.model.layers[0]
        stored = cpu_linear._packed(layer.mlp.down_proj.weight).stored
        assert stored == (cpu_linear.STORED_BF16 if narrow else cpu_linear.STORED_SAME)
    assert runs[0] == runs[1]
