"""``truespec eval ppl`` / ``truespec eval niah`` on the embedded model, at small sizes on CPU: the tables come out,
the perplexity is exp(mean NLL) of the windows' prompt logprobs (and matches transformers), the needles are
well-formed, and a KV cache dtype the engine rejects exits 2 with the engine's own message before any model loads."""

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from truespec import LLM, SamplingParams
from truespec.assets import DEFAULT_MODEL_DIR
from truespec.entrypoints import eval as eval_cli
from truespec.entrypoints.cli import main
from truespec.tokenizer import load_tokenizer

CPU = ["--device", "cpu"]


def test_ppl_is_exp_of_the_mean_nll_of_the_windows_prompt_logprobs(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ppl.json"
    assert main(["eval", "ppl", "--context-len", "40", "--max-windows", "3", *CPU, "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| kv cache dtype | windows | tokens scored | mean NLL (nats) | PPL | PPL vs auto |" in table
    (row,) = json.loads(out.read_text())["results"]
    assert row["kv_cache_dtype"] == "auto" and row["num_windows"] == 3 and row["num_tokens"] == 3 * 39
    assert math.isfinite(row["ppl"]) and 1 < row["ppl"] < 2048 and f"| {row['ppl']:.3f} |" in table

    # the same windows, scored here from prompt_logprobs and by transformers (teacher forcing)
    texts, _ = eval_cli.heldout_texts()
    windows = eval_cli.ppl_windows(load_tokenizer(str(DEFAULT_MODEL_DIR)), texts, 40, 3)
    llm = LLM(device="cpu", max_model_len=41)
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], SamplingParams(max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)
    nll = [-entry[t] for o in outs for entry, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:], strict=True)]
    assert len(nll) == row["num_tokens"] and row["ppl"] == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-12)
    hf = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor(windows)
        logprobs = torch.log_softmax(hf(ids).logits[:, :-1].double(), dim=-1)
    hf_nll = -logprobs.gather(2, ids[:, 1:, None]).mean().item()
    assert row["mean_nll"] == pytest.approx(hf_nll, abs=1e-4)  # both float32 (transformers: its own kernels)


def test_niah_prints_its_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "niah.json"
    assert main(["eval", "niah", "--context-len", "64", "--num-needles", "2", *CPU, "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| kv cache dtype | start | middle | end | total |" in table
    (row,) = json.loads(out.read_text())["results"]
    assert row["kv_cache_dtype"] == "auto" and all(0 <= row[p] <= 2 for p in ("start", "middle", "end"))
    assert f"| auto | {row['start']}/2 | {row['middle']}/2 | {row['end']}/2 |" in table


def test_needles_are_planted_once_where_asked_within_the_context() -> None:
    tokenizer = load_tokenizer(str(DEFAULT_MODEL_DIR))
    texts, _ = eval_cli.heldout_texts()
    needles = eval_cli.make_needles(tokenizer, texts, 256, 4, seed=3)
    assert [n["position"] for n in needles] == ["start"] * 4 + ["middle"] * 4 + ["end"] * 4
    assert needles == eval_cli.make_needles(tokenizer, texts, 256, 4, seed=3)  # seeded
    for n in needles:
        prompt, payload = n["prompt"], n["payload"]
        key = prompt[prompt.rindex("\n") + 1:-len(' = "')]
        needle = f'{key} = "{payload}"\n'
        assert 200 <= len(tokenizer.encode(prompt)) <= 256 and prompt.count(payload) == 1 and needle in prompt
        at = prompt.index(needle) / len(prompt)
        assert {"start": at == 0, "middle": 0.3 < at < 0.7, "end": prompt.endswith(needle + f'\n{key} = "')}[
            n["position"]]


@pytest.mark.parametrize("task", ["ppl", "niah"])
def test_a_rejected_kv_cache_dtype_exits_2_before_anything_runs(task: str, capsys: pytest.CaptureFixture[str],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(eval_cli, "heldout_texts", lambda: pytest.fail("read the text before checking the dtypes"))
    assert main(["eval", task, "--kv-cache-dtype", "auto", "not_a_dtype", *CPU]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "kv_cache_dtype" in captured.err and "not_a_dtype" in captured.err


def test_a_max_model_len_below_the_context_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "ppl", "--context-len", "64", "--max-model-len", "64", *CPU]) == 2
    assert "--max-model-len" in capsys.readouterr().err
