"""Model-level exactness (docs/ARCHITECTURE.md, invariant 5): truespec's float64 torch reference models against
transformers' own implementation, and against themselves across batch shapes (ragged prefill, chunked
prefill, decode, verify, padding); plus the checkpoint loader's contract and errors.

Bounds (measured on CPU, float64, 1 and 2 threads; max |logit| ~3.4-4.1):
  * vs transformers forced to float64 (``hf_logits(..., upcast=True)``): measured <= 1.5e-13. Both sides
    do the same float64 math and differ only in summation order (e.g. transformers' chunked GDN vs our
    per-token recurrence), so 1e-11 leaves ~70x headroom while any real math difference (a misplaced
    eps, a wrong head mapping) shows up at >= 1e-8.
  * vs plain transformers float64: transformers runs RMSNorm, RoPE, softmax and GDN in float32 even for
    float64 models (6e-8 relative per rounding); its chunked float32 GDN (exp of cumulative decays,
    triangular solves) amplifies that most. This measures transformers' float32 rounding, not truespec
    (truespec equals the float64 transformers to 1e-13 above): over 12 random draws of each tiny hybrid
    (vocabulary 320), stock vs float64 transformers differ by up to 6.6e-5 (LLLF), 2.7e-5 (FL) and
    2.6e-4 (LFLLLF); dense models <= 9e-7. Bound 1e-3.
  * truespec vs itself in float64 (chunked vs one-shot prefill, verify vs sequential): measured
    <= 1.5e-14 (only matmul blocking differs with the number of rows); bound 1e-12.
"""

import copy
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from helpers import VOCAB_SIZE
from helpers.models import (
    F,
    L,
    NaiveRunner,
    StepRequest,
    build_hf_model,
    hf_logits,
    make_forward_context,
    save_checkpoint,
    save_multimodal_qwen3_5_checkpoint,
    tiny_llama_config,
    tiny_qwen3_5_config,
    tiny_qwen3_config,
)
from truespec.forward_context import set_forward_context
from truespec.models import CausalLM, load_model, resolve_dtype

UPCAST_BOUND = 1e-11  # vs transformers computing in float64 throughout
HF_BOUND = 1e-3  # vs transformers as shipped (float32 norms/RoPE/GDN/softmax): its own rounding, see above
SELF_BOUND = 1e-12  # truespec vs truespec, different batch shapes

CONFIGS = {
    "qwen3_5_LLLF_tied": lambda: tiny_qwen3_5_config([L, L, L, F], tie=True),
    # equal key/value linear heads (as Qwen3.5-0.8B), full attention first
    "qwen3_5_FL": lambda: tiny_qwen3_5_config([F, L], linear_num_key_heads=3, linear_num_value_heads=3),
    # 4 query heads per kv head, half-rotary head_dim 24, value heads grouped 2 per key head
    "qwen3_5_LFLLLF": lambda: tiny_qwen3_5_config(
        [L, F, L, L, L, F], num_heads=8, num_kv_heads=2, head_dim=24, partial_rotary_factor=0.5
    ),
    "qwen3": lambda: tiny_qwen3_config(attention_bias=True),
    "llama_bias": lambda: tiny_llama_config(attention_bias=True, mlp_bias=True),
    "llama_llama3_rope": lambda: tiny_llama_config(
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
    ),
    "llama_yarn_rope": lambda: tiny_llama_config(
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
        }
    ),
    "llama_linear_rope": lambda: tiny_llama_config(
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    ),
}
HYBRIDS = ["qwen3_5_LLLF_tied", "qwen3_5_FL", "qwen3_5_LFLLLF"]

_gen = torch.Generator().manual_seed(1234)
PROMPTS = [torch.randint(0, VOCAB_SIZE, (n,), generator=_gen).tolist() for n in (5, 11, 8)]
LONG_PROMPT = torch.randint(0, VOCAB_SIZE, (13,), generator=_gen).tolist()
# Scattered, non-monotonic block ids so gathering through block tables is exercised.
TABLES = [[11, 3, 7, 0], [5, 14, 1, 9], [2, 12, 6, 15], [4, 10, 13, 8]]

Checkpoint = tuple[PreTrainedModel, Path]


@pytest.fixture(scope="module", autouse=True)
def single_thread() -> Iterator[None]:
    """These tensors are tiny: one intra-op thread is fastest, and with 2+ threads on a busy 2-core
    machine OpenMP spin-waiting made this file 20x slower (measured 5 s vs 140 s)."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Checkpoint]:
    """name -> (float64 transformers model, its saved checkpoint dir); built once per module."""
    cache: dict[str, Checkpoint] = {}

    def get(name: str) -> Checkpoint:
        if name not in cache:
            hf = build_hf_model(CONFIGS[name]())
            cache[name] = (hf, save_checkpoint(hf, tmp_path_factory.mktemp(name)))
        return cache[name]

    return get


def load64(path: Path) -> CausalLM:
    return load_model(path, "float64").model


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


# ------------------------------------------------------------------------------ parity with transformers
@pytest.mark.parametrize("name", CONFIGS)
def test_ragged_prefill_matches_transformers(checkpoint: Callable[[str], Checkpoint], name: str) -> None:
    hf, path = checkpoint(name)
    runner = NaiveRunner(load64(path))
    reqs = [StepRequest(0, len(p), TABLES[i], state_dst=2 * i) for i, p in enumerate(PROMPTS)]
    outs = runner.step(reqs, PROMPTS)  # three prompts of different lengths in one packed forward
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert max_err(out, hf_logits(hf, prompt, upcast=True)) <= UPCAST_BOUND
        assert max_err(out, hf_logits(hf, prompt)) <= HF_BOUND


@pytest.mark.parametrize("name", [*HYBRIDS, "llama_bias"])
def test_decode_after_prefill_matches_transformers(checkpoint: Callable[[str], Checkpoint], name: str) -> None:
    """Greedy decode of A and B, with C's prefill joining mid-way: every step is a mixed batch."""
    hf, path = checkpoint(name)
    runner = NaiveRunner(load64(path))
    seqs = [list(PROMPTS[0]), list(PROMPTS[1])]
    logits: list[list[torch.Tensor]] = [[], [], []]
    # Each request keeps its state in one slot (src == dst: the layer reads before it writes).
    step = [StepRequest(0, len(s), TABLES[i], state_dst=i) for i, s in enumerate(seqs)]
    feeds = [list(s) for s in seqs]
    for t in range(4):
        if t == 2:  # C's prefill joins a decode batch
            seqs.append(list(PROMPTS[2]))
            step.append(StepRequest(0, len(PROMPTS[2]), TABLES[2], state_dst=2))
            feeds.append(list(PROMPTS[2]))
        outs = runner.step(step, feeds)
        for i, out in enumerate(outs):
            logits[i].append(out)
            seqs[i].append(int(out[-1].argmax()))
        step = [StepRequest(len(s) - 1, 1, TABLES[i], state_src=i, state_dst=i) for i, s in enumerate(seqs)]
        feeds = [[s[-1]] for s in seqs]
    for seq, rows in zip(seqs, logits, strict=True):
        ours = torch.cat(rows)  # logits for positions 0 .. len(seq) - 2
        ref = hf_logits(hf, seq, upcast=True)[: ours.shape[0]]
        assert max_err(ours, ref) <= UPCAST_BOUND
        assert max_err(ours, hf_logits(hf, seq)[: ours.shape[0]]) <= HF_BOUND
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))  # greedy tokens are transformers' tokens


@pytest.mark.parametrize("name", ["qwen3_5_LFLLLF", "llama_bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lower_precision_tracks_transformers(
    checkpoint: Callable[[str], Checkpoint], name: str, dtype: torch.dtype
) -> None:
    """float32/bfloat16 paths follow transformers' cast order. Measured max error (logits up to ~4):
    float32 4.6e-5 hybrid (transformers' chunked float32 GDN vs our recurrence), 0 dense; bfloat16 0.12
    hybrid, 0.04 dense (a few bf16 ulps: 2^-7 x 4 = 0.03). Bounds 5e-4 and 0.5: a smoke test of the
    low-precision paths; exactness is asserted in float64 above."""
    hf, path = checkpoint(name)
    hf_low = copy.deepcopy(hf).to(dtype)
    runner = NaiveRunner(load_model(path, dtype).model)
    reqs = [StepRequest(0, len(p), TABLES[i], state_dst=2 * i) for i, p in enumerate(PROMPTS)]
    bound = 5e-4 if dtype == torch.float32 else 0.5
    for prompt, out in zip(PROMPTS, runner.step(reqs, PROMPTS), strict=True):
        assert out.dtype == dtype
        assert max_err(out, hf_logits(hf_low, prompt)) <= bound


# ------------------------------------------------------------------------ truespec against itself
@pytest.mark.parametrize("name", [*HYBRIDS, "llama_bias"])
def test_chunked_prefill_equals_one_shot(checkpoint: Callable[[str], Checkpoint], name: str) -> None:
    model = load64(checkpoint(name)[1])
    table = TABLES[3]
    one_shot = NaiveRunner(model).step([StepRequest(0, 13, table, state_dst=0)], [LONG_PROMPT])[0]
    runner = NaiveRunner(model)  # fresh (NaN-filled) caches
    # (num_cached, num_new, state_src, state_dst); the last chunk reads and writes the same slot.
    chunks = [(0, 5, -1, 3), (5, 4, 3, 6), (9, 4, 6, 6)]
    outs = [
        runner.step([StepRequest(c, n, table, state_src=s, state_dst=d)], [LONG_PROMPT[c : c + n]])[0]
        for c, n, s, d in chunks
    ]
    assert max_err(torch.cat(outs), one_shot) <= SELF_BOUND


@pytest.mark.parametrize("name", HYBRIDS)
def test_verify_keeps_state_after_each_position(checkpoint: Callable[[str], Checkpoint], name: str) -> None:
    """Invariant 2: a verify of 1 + 3 tokens writes the state after *each* token (slots 4..7); resuming
    from slot 4 + a (a = index of the last accepted token) continues exactly as transformers does on
    prompt + verified[: a + 1]. Rejected positions' KV is overwritten by the next step."""
    hf, path = checkpoint(name)
    runner = NaiveRunner(load64(path))
    prompt, verified, bonus = PROMPTS[1], [17, 93, 4, 60], 28
    runner.step([StepRequest(0, len(prompt), TABLES[0], state_dst=0)], [prompt])
    n = len(prompt)
    verify_step = [
        StepRequest(0, len(PROMPTS[2]), TABLES[1], state_dst=8),  # another request's prefill in the batch
        StepRequest(n, 4, TABLES[0], state_src=0, state_dst=4, state_write_start=0),
    ]
    verify_logits = runner.step(verify_step, [PROMPTS[2], verified])[1]
    ref = hf_logits(hf, prompt + verified, upcast=True)
    assert max_err(verify_logits, ref[n:]) <= UPCAST_BOUND
    after_verify = runner.snapshot()
    for accepted in range(4):
        runner.restore(after_verify)
        seq = prompt + verified[: accepted + 1] + [bonus]
        step = StepRequest(len(seq) - 1, 1, TABLES[0], state_src=4 + accepted, state_dst=0)
        out = runner.step([step], [[bonus]])[0]
        assert max_err(out, hf_logits(hf, seq, upcast=True)[-1:]) <= UPCAST_BOUND


def test_padding_rows_are_inert(checkpoint: Callable[[str], Checkpoint]) -> None:
    """Invariant 3: a padding request (slot -1, state_dst -1) and trailing padded tokens write nothing
    and do not change the real request's logits."""
    model = load64(checkpoint("qwen3_5_LFLLLF")[1])
    real = StepRequest(0, 11, TABLES[0], state_dst=1)
    plain = NaiveRunner(model)
    expected = plain.step([real], [PROMPTS[1]])[0]
    expected_caches = plain.snapshot()
    padded = NaiveRunner(model)
    pad = StepRequest(0, 1, [-1], is_padding=True)
    out = padded.step([real, pad], [PROMPTS[1], [0]], num_pad_tokens=3)[0]
    assert max_err(out, expected) <= SELF_BOUND
    for got, want in zip(padded.snapshot(), expected_caches, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=SELF_BOUND, equal_nan=True)


def test_cache_binding_api(checkpoint: Callable[[str], Checkpoint]) -> None:
    model = load64(checkpoint("qwen3_5_LFLLLF")[1])
    attn, gdn = model.attention_layers(), model.gdn_layers()
    assert len(attn) == 2 and len(gdn) == 4
    assert attn[0].kv_cache_shape(10, 16) == (2, 10, 16, 2, 24)
    # conv channels = 2 * key_dim + value_dim = 2 * 2 * 12 + 4 * 10; ssm [value heads, dk, dv]
    assert gdn[0].state_shapes() == ((88, 3), (4, 12, 10))
    assert gdn[0].state_dtypes() == (torch.float64, torch.float64)
    assert load_model(checkpoint("qwen3_5_FL")[1], "bfloat16").model.gdn_layers()[0].state_dtypes() == (
        torch.bfloat16,
        torch.float32,
    )
    ctx = make_forward_context([StepRequest(0, 1, [0], state_dst=0)], block_size=4)
    with set_forward_context(ctx), pytest.raises(RuntimeError, match="not bound"):
        model(torch.tensor([1]), torch.tensor([0]))  # caches never bound: refuses to run


# -------------------------------------------------------------------------------------------- loader
def test_multimodal_checkpoint_loads_text_model_and_keeps_mtp(
    checkpoint: Callable[[str], Checkpoint], tmp_path: Path
) -> None:
    hf, path = checkpoint("qwen3_5_LLLF_tied")
    mtp = save_multimodal_qwen3_5_checkpoint(hf, tmp_path / "mm")
    loaded = load_model(tmp_path / "mm", "float64")
    assert loaded.hf_config.model_type == "qwen3_5_text" and loaded.model.lm_head is None
    assert sorted(loaded.mtp_weights) == sorted(mtp)
    for key, tensor in mtp.items():
        assert torch.equal(loaded.mtp_weights[key], tensor)
    text_only = load64(path)
    for (name, a), (_, b) in zip(loaded.model.state_dict().items(), text_only.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_auto_dtype(checkpoint: Callable[[str], Checkpoint], tmp_path: Path) -> None:
    assert load_model(checkpoint("qwen3")[1]).dtype == torch.float64  # saved in float64
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", "bfloat16", cpu) == torch.float32  # no half math on CPU
    assert resolve_dtype("auto", torch.bfloat16, cuda) == torch.bfloat16
    assert resolve_dtype("auto", None, cuda) == torch.float32
    assert resolve_dtype("fp16", "float32", cpu) == torch.float16
    with pytest.raises(ValueError, match="float8"):
        resolve_dtype("float8", None, cpu)


def _copy(checkpoint: Checkpoint, dst: Path) -> Path:
    return Path(shutil.copytree(checkpoint[1], dst))


def _edit_weights(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_unknown_model_type_names_it(checkpoint: Callable[[str], Checkpoint], tmp_path: Path) -> None:
    path = _copy(checkpoint("qwen3"), tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "mamba2"}))
    with pytest.raises(ValueError, match=r"mamba2.*qwen3_5"):
        load_model(path)


def test_missing_files_name_the_path(checkpoint: Callable[[str], Checkpoint], tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_model(tmp_path / "nowhere")
    path = _copy(checkpoint("qwen3"), tmp_path / "ckpt")
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"safetensors.*ckpt"):
        load_model(path)
    (path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(path)


def test_truncated_safetensors_names_the_file(checkpoint: Callable[[str], Checkpoint], tmp_path: Path) -> None:
    path = _copy(checkpoint("qwen3"), tmp_path / "ckpt")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(path)


def test_missing_tensor_names_it(checkpoint: Callable[[str], Checkpoint], tmp_path: Path) -> None:
    path = _copy(checkpoint("qwen3_5_FL"), tmp_path / "ckpt")
    _edit_weights(path, lambda t: t.pop("model.layers.1.linear_attn.A_log"))
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.1\.linear_attn\.A_log.*model\.safetensors"):
        load_model(path)


def test_shape_mismatch_names_tensor_and_shapes(checkpoint: Callable[[str], Checkpoint], tmp_path: Path) -> None:
    path = _copy(checkpoint("qwen3"), tmp_path / "ckpt")
    _edit_weights(path, lambda t: t.update({"model.norm.weight": torch.ones(71, dtype=torch.float64)}))
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*\(71,\).*\(72,\)"):
        load_model(path)


def test_unexpected_tensor_names_it(checkpoint: Callable[[str], Checkpoint], tmp_path: Path) -> None:
    path = _copy(checkpoint("qwen3"), tmp_path / "ckpt")
    _edit_weights(path, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.ones(3)}))
    with pytest.raises(ValueError, match=r"unexpected.*model\.layers\.0\.mlp\.extra\.weight"):
        load_model(path)


def test_batch_dependent_rope_is_refused(tmp_path: Path) -> None:
    config = tiny_llama_config(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    path = save_checkpoint(build_hf_model(config), tmp_path / "ckpt")
    with pytest.raises(ValueError, match="dynamic"):
        load_model(path)
