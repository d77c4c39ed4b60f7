"""The embedded default model ships inside the package, fits its budget, and loads offline with transformers."""

import json
import os
import random
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

import truespec.training
from truespec.assets import ASSETS_DIR, DEFAULT_DRAFT_MODEL_DIR, DEFAULT_MODEL_DIR
from truespec.training.export import load_mtp
from truespec.training.tokenizer import IM_END, SPECIAL_TOKENS, format_chat, format_edit
from truespec.training.train import mtp_logits

MIB = 1 << 20
HELDOUT_PROMPTS = Path(__file__).resolve().parents[1] / "benchmarks" / "prompts" / "heldout.jsonl"
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="module")
def target():
    return AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR).eval()


def heldout_completion_ids(tokenizer, num_tokens: int = 600) -> torch.Tensor:
    """[1, num_tokens] token ids of the held-out completion prompts and references, concatenated."""
    rows = [json.loads(line) for line in HELDOUT_PROMPTS.read_text().splitlines()]
    text = "".join(r["prompt"] + r["reference"] for r in rows if r["kind"] == "completion")[:3000]
    return torch.tensor([tokenizer.encode(text, add_special_tokens=False)[:num_tokens]])


def _shipped_files() -> list[Path]:
    return [p for p in ASSETS_DIR.rglob("*") if p.is_file() and "__pycache__" not in p.parts]


def test_assets_fit_size_budget() -> None:
    files = _shipped_files()
    assert sum(p.stat().st_size for p in files) <= 16 * MIB
    assert max(p.stat().st_size for p in files) <= 15 * MIB
    for d in (DEFAULT_MODEL_DIR, DEFAULT_DRAFT_MODEL_DIR):
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            assert (d / name).is_file(), d / name


def test_tokenizer_round_trips_stdlib_source(tokenizer) -> None:
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(root.glob("*.py"))
    for path in random.Random(0).sample(paths, 12):
        text = path.read_text(encoding="utf-8", errors="replace")
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text, path


def test_tokenizer_round_trips_arbitrary_text(tokenizer) -> None:
    rng = random.Random(1)
    ranges = [(0, 0x7F), (0x80, 0x7FF), (0x800, 0xD7FF), (0xE000, 0xFFFF), (0x10000, 0x10FFFF)]
    for _ in range(50):
        chars = [chr(rng.randint(*rng.choice(ranges))) for _ in range(rng.randint(0, 200))]
        chars += rng.sample(["  ", "\t", "\r\n", "\n\n", " \u00a0", "\x00", "🎉", "<|im_end|>"], 3)
        rng.shuffle(chars)
        text = "".join(chars)
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_special_tokens_and_eos(tokenizer, target) -> None:
    assert tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS) == list(range(len(SPECIAL_TOKENS)))
    assert tokenizer.eos_token_id == 0 and tokenizer.pad_token_id == 3
    assert target.config.eos_token_id == [0, tokenizer.convert_tokens_to_ids(IM_END)]
    assert target.generation_config.eos_token_id == [0, 2]
    prompt = format_edit("x = 1\n", "change the literal 1 to 2", "x = 2\n")
    assert tokenizer.encode(prompt, add_special_tokens=False)[0] == tokenizer.convert_tokens_to_ids("<|instruction|>")


def test_chat_template_renders(tokenizer) -> None:
    config = json.loads((DEFAULT_MODEL_DIR / "tokenizer_config.json").read_text())
    assert "chat_template" in config
    messages = [{"role": "user", "content": "Return the sum."}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == format_chat("Return the sum.")
    turn = messages + [{"role": "assistant", "content": "def f(a, b):\n    return a + b\n"}]
    assert tokenizer.apply_chat_template(turn, tokenize=False) == format_chat(*(m["content"] for m in turn))


@pytest.mark.parametrize("model_dir, model_type", [(DEFAULT_MODEL_DIR, "qwen3_5_text"),
                                                   (DEFAULT_DRAFT_MODEL_DIR, "qwen3")])
def test_models_load_offline_with_transformers(model_dir: Path, model_type: str, tokenizer) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert model.config.model_type == model_type and model.dtype == torch.bfloat16
    assert AutoTokenizer.from_pretrained(model_dir).get_vocab() == tokenizer.get_vocab()
    ids = heldout_completion_ids(tokenizer)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size) and torch.isfinite(logits).all()
    hits = logits[0, :-1].argmax(-1) == ids[0, 1:]
    assert hits.float().mean().item() > 0.4  # the trained weights, read right: measured 0.52 target, 0.48 draft


def test_target_is_hybrid_three_to_one(target) -> None:
    types = target.config.layer_types
    assert types.count("linear_attention") == 3 * types.count("full_attention") > 0


def test_mtp_weights_stored_as_qwen35_checkpoints(target) -> None:
    cfg = target.config
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    expected = {
        "pre_fc_norm_embedding.weight": (h,), "pre_fc_norm_hidden.weight": (h,), "fc.weight": (h, 2 * h),
        "layers.0.input_layernorm.weight": (h,), "layers.0.post_attention_layernorm.weight": (h,),
        "layers.0.self_attn.q_proj.weight": (2 * q, h), "layers.0.self_attn.k_proj.weight": (kv, h),
        "layers.0.self_attn.v_proj.weight": (kv, h), "layers.0.self_attn.o_proj.weight": (h, q),
        "layers.0.self_attn.q_norm.weight": (hd,), "layers.0.self_attn.k_norm.weight": (hd,),
        "layers.0.mlp.gate_proj.weight": (inter, h), "layers.0.mlp.up_proj.weight": (inter, h),
        "layers.0.mlp.down_proj.weight": (h, inter), "norm.weight": (h,),
    }
    with safe_open(DEFAULT_MODEL_DIR / "model.safetensors", "pt") as f:
        names = list(f.keys())
        mtp = {k.removeprefix("mtp."): f.get_slice(k) for k in names if k.startswith("mtp.")}
        assert {k: tuple(v.get_shape()) for k, v in mtp.items()} == expected
        assert {v.get_dtype() for v in mtp.values()} == {"BF16"}
    assert cfg.mtp_num_hidden_layers == 1


def test_mtp_head_predicts_next_next_token(target, tokenizer) -> None:
    """The documented MTP math (embedding first in fc, final-normed hidden, RoPE position t) is the trained one."""
    mtp = load_mtp(DEFAULT_MODEL_DIR, target.config).to(torch.bfloat16).eval()
    ids = heldout_completion_ids(tokenizer)
    with torch.no_grad():
        hidden = target.model(input_ids=ids).last_hidden_state
        hits = mtp_logits(target, mtp, ids, hidden)[0, :-1].argmax(-1) == ids[0, 2:]
    assert hits.float().mean().item() > 0.4


def test_heldout_prompts_file() -> None:
    rows = [json.loads(line) for line in HELDOUT_PROMPTS.read_text(encoding="utf-8").splitlines()]
    assert 200 <= len(rows) <= 1000
    assert {r["kind"] for r in rows} == {"completion", "edit", "chat"}
    assert all(set(r) == {"kind", "prompt", "reference"} and r["prompt"] and r["reference"] for r in rows)
    assert all(r["prompt"].startswith("<|im_start|>user\n") for r in rows if r["kind"] == "chat")
    assert all(r["prompt"].endswith("<|updated|>") for r in rows if r["kind"] == "edit")


def test_smoke_training_runs_end_to_end(tmp_path: Path) -> None:
    src = Path(truespec.training.__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-m", "truespec.training", "--smoke", "--out", str(tmp_path)],
                   check=True, env=env, capture_output=True, timeout=300)
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert {"heldout", "tasks_target", "tasks_draft", "training"} <= set(report)
    with safe_open(tmp_path / "stdlib-qwen35" / "model.safetensors", "pt") as f:
        names = list(f.keys())
    assert "mtp.fc.weight" in names
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "stdlib-qwen3-draft")
    assert model.config.model_type == "qwen3"
    assert (tmp_path / "heldout.jsonl").read_text().count("\n") >= 2
