"""The benchmark tooling runs end to end on CPU at tiny sizes: ``truespec bench``, the Qwen3.5-0.8B-shaped
model writer (``--tiny``), and the truespec vs transformers comparison; the GPU runs use the same code."""

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from truespec import LLM, SamplingParams
from truespec.entrypoints import bench
from truespec.entrypoints.cli import main as cli_main

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
TINY_SIZES = ["--batch-sizes", "1", "2", "--input-len", "8", "--output-len", "4"]


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_shape_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("qwen35_shape") / "tiny"
    _script("qwen35_shape").write_model(out, seed=0, tiny=True)
    return out


def test_bench_reports_positive_throughput_per_batch_size(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    bench.add_bench_args(parser)
    args = parser.parse_args([*TINY_SIZES, "--device", "cpu", "--json", str(tmp_path / "bench.json")])
    assert bench.main(args) == 0
    rows = json.loads((tmp_path / "bench.json").read_text())["results"]
    assert [r["batch_size"] for r in rows] == [1, 2]
    assert [r["num_output_tokens"] for r in rows] == [4, 8]  # ignore_eos: every request decodes output_len
    assert all(r["output_tok_per_s"] > 0 and r["step_ms"] > 0 for r in rows)
    # TTFT and TPOT from the requests' timestamps: the first token comes after arrival, and decoding 4 tokens
    # takes 3 inter-token gaps, each shorter than the whole call
    assert all(0 < r["ttft_ms"] < 1000 * r["elapsed_s"] and 0 < r["tpot_ms"] < 1000 * r["elapsed_s"] for r in rows)


def test_bench_prompts_file_rows_with_token_ids_or_text(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    path, out = tmp_path / "p.jsonl", tmp_path / "bench.json"
    path.write_text('{"prompt_token_ids": [5, 6, 7]}\n{"prompt": "def f(x):", "kind": "edit"}\n')
    argv = ["bench", "--model", str(tiny_models["qwen3"]), "--device", "cpu", "--dtype", "float32", "--batch-sizes",
            "1", "3", "--output-len", "2", "--prompts-file", str(path), "--json", str(out)]
    num_text_tokens = len(AutoTokenizer.from_pretrained(tiny_models["qwen3"]).encode("def f(x):"))
    assert cli_main(argv) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["num_prompt_tokens"] for r in rows] == [3, 3 + num_text_tokens + 3]  # the file repeats when short
    assert cli_main([*argv, "--kind", "edit"]) == 0
    assert [r["num_prompt_tokens"] for r in json.loads(out.read_text())["results"]] == [num_text_tokens,
                                                                                       3 * num_text_tokens]


@pytest.mark.parametrize("content, message", [
    ("def f(x):\n", ":1: expected a JSON object"),  # plain text: bench needs JSON Lines
    ('{"prompt": "a"}\n{"prompt": "b"\n', ":2: expected a JSON object"),
    ('{"prompt": "a", "kind": "edit"}\n', "no prompts of kind 'chat' in "),
])
def test_bench_bad_prompts_file_fails_before_loading_the_engine(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                content: str, message: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    # a missing model directory: the prompts file is read, and rejected, before the engine loads
    assert cli_main(["bench", "--model", str(tmp_path / "no_model"), "--prompts-file", str(path),
                     "--kind", "chat"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(path) in err and message in err and err.count("\n") == 1


@pytest.mark.parametrize("argv, message", [
    (["--num-iters", "0"], "argument --num-iters: must be at least 1, got 0"),
    (["--warmup", "-1"], "argument --warmup: must be at least 0"),
    (["--batch-sizes", "2", "0"], "argument --batch-sizes: must be at least 1"),
    (["--output-len", "0"], "argument --output-len: must be at least 1"),
    (["--input-len", "x"], "argument --input-len: expected an integer, got 'x'"),
    (["--json", "/no/such/dir/bench.json"], "argument --json: directory /no/such/dir does not exist"),
    (["--json", "/"], "argument --json: / is a directory"),
])
def test_bench_rejects_bad_arguments_before_the_run(argv: list[str], message: str,
                                                    capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        cli_main(["bench", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_bench_module_entry_exits_2_without_traceback() -> None:
    proc = subprocess.run([sys.executable, "-m", "truespec.entrypoints.bench", "--model", "/no/such/dir",
                           "--output-len", "2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "/no/such/dir" in proc.stderr


def test_random_prompts_are_seeded_and_skip_special_ids() -> None:
    special = list(range(0, 100))
    a = bench.random_prompts(128, special, batch_size=3, input_len=50, seed=7)
    assert a == bench.random_prompts(128, special, batch_size=3, input_len=50, seed=7)
    ids = [t for p in a for t in p["prompt_token_ids"]]
    assert len(ids) == 150 and all(100 <= t < 128 for t in ids)


def test_tiny_qwen35_shape_loads_in_truespec_and_transformers(tiny_shape_dir: Path) -> None:
    config = json.loads((tiny_shape_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text" and config["layer_types"] == ["linear_attention", "full_attention"]
    llm = LLM(str(tiny_shape_dir), dtype="float32", device="cpu", max_model_len=64)
    prompt = {"prompt_token_ids": [10, 3000, 20, 4000, 30]}  # ids beyond the tokenizer's 2048 are valid
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_shape_dir, dtype=torch.float32).eval()
    assert hf.config.vocab_size == config["vocab_size"]
    ref = hf.generate(torch.tensor([prompt["prompt_token_ids"]]), max_new_tokens=4, min_new_tokens=4, do_sample=False,
                      output_logits=True, return_dict_in_generate=True)
    assert out.token_ids == ref.sequences[0, 5:].tolist()
    for logprobs, logits in zip(out.logprobs, ref.logits, strict=True):  # both float32: measured <= 5e-7
        expected = torch.log_softmax(logits[0].double(), dim=-1)
        assert all(abs(v - expected[t].item()) < 1e-5 for t, v in logprobs.items()), logprobs


def test_vs_transformers_runs_both_engines(tiny_shape_dir: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "vs.json"
    monkeypatch.setattr(sys, "argv", ["vs_transformers", "--model", str(tiny_shape_dir), "--device", "cpu",
                                      "--dtype", "float32", *TINY_SIZES, "--json", str(out)])
    _script("vs_transformers").main()
    report = json.loads(out.read_text())
    for name in ("truespec", "transformers"):
        engine = report["engines"][name]
        assert "error" not in engine and engine["bs1_step_s"] > 0
        assert [r["batch_size"] for r in engine["throughput"]] == [1, 2]
        assert all(r["output_tok_per_s"] > 0 for r in engine["throughput"])
    assert report["copy_bandwidth_GBps"] > 0 and all(r["step_s"] > 0 for r in report["roofline"])


def test_vs_transformers_mixed_workload_runs_both_engines(tiny_shape_dir: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    out, script = tmp_path / "mixed.json", _script("vs_transformers")
    monkeypatch.setattr(script, "MIXED_NUM_REQUESTS", 5)  # nano-vllm's 256 requests of 100..1024 tokens, scaled
    monkeypatch.setattr(script, "MIXED_MIN_LEN", 2)
    monkeypatch.setattr(script, "MIXED_MAX_LEN", 9)
    monkeypatch.setattr(sys, "argv", ["vs_transformers", "--model", str(tiny_shape_dir), "--device", "cpu",
                                      "--dtype", "float32", "--mixed", "--hf-mixed", "--hf-mixed-batch-size", "2",
                                      "--json", str(out)])
    script.main()
    engines = json.loads(out.read_text())["engines"]
    assert engines["truespec"]["mixed"]["batch_size"] == 5 and engines["transformers"]["mixed"]["batch_size"] == 2
    assert all(e["mixed"]["num_requests"] == 5 and e["mixed"]["output_tok_per_s"] > 0 for e in engines.values())


def test_compare_no_spec_runs_both_engines_side_by_side(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    parser = argparse.ArgumentParser()
    bench.add_bench_args(parser)
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    args = parser.parse_args([*TINY_SIZES, "--device", "cpu", "--speculative-config", spec, "--compare-no-spec",
                              "--json", str(tmp_path / "bench.json")])
    assert bench.main(args) == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    for rows in (report["results"], report["no_spec_results"]):
        assert [r["batch_size"] for r in rows] == [1, 2] and [r["num_output_tokens"] for r in rows] == [4, 8]
    assert all(r["mean_acceptance_length"] is None for r in report["no_spec_results"])
    assert "speedup" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--compare-no-spec needs --speculative-config"):
        bench.main(parser.parse_args([*TINY_SIZES, "--device", "cpu", "--compare-no-spec"]))
