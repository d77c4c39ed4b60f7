"""``truespec verify`` finds real divergences and only those, and the CLI's speculative options work:
--speculative-config (with metrics), --prompts-file, clear errors with exit code 2."""

import json
from pathlib import Path

import pytest
import torch

from helpers.engine import OracleProposer
from truespec import LLM, SamplingParams
from truespec.entrypoints.cli import main as cli_main
from truespec.entrypoints.verify import DEBUG_FAULTS, first_divergence, top2_margin, verify
from truespec.outputs import CompletionOutput

ENGINE = dict(dtype="float64", device="cpu", max_model_len=400)
CLI_ENGINE = ["--dtype", "float64", "--device", "cpu", "--max-model-len", "400"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
TEXTS = ["def add(a, b):", "for i in range(10):", "print(i * i)", "import os", "class Point:", "x = 1",
         "return a + b", "self.x = x"]


def repeated_patterns(num: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(1, 300, (n,), generator=g).tolist() * 6} for n in range(2, 2 + num)]


@pytest.fixture(scope="module")
def oracle_prompts(tiny_models: dict[str, Path]) -> tuple[list[dict], dict[tuple[int, ...], list[int]]]:
    """Prompts and their greedy continuations, for a proposer whose drafts get accepted."""
    prompts = repeated_patterns(4, seed=1)
    llm = LLM(str(tiny_models["hybrid"]), **ENGINE)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    return prompts, {tuple(p["prompt_token_ids"]): o.outputs[0].token_ids for p, o in zip(prompts, outs, strict=True)}


def test_verify_ngram_on_hybrid_is_identical(tiny_models: dict[str, Path]) -> None:
    engines = []
    results = verify(str(tiny_models["hybrid"]), repeated_patterns(4) + TEXTS[:2],
                     dict(ENGINE, speculative_config=NGRAM), max_tokens=24, ignore_eos=True,
                     candidate_hook=engines.append)
    assert all(r.is_identical for r in results), [r.divergence for r in results]
    assert all(len(r.baseline_token_ids) == 24 for r in results)
    assert engines[0].get_metrics()["num_drafts"] > 0


class OracleHook:
    """Candidate hook: drafts come from the reference continuation (so they get accepted), with the
    stale-state fault injected or not; keeps the candidate LLM to read its metrics."""

    def __init__(self, oracle_prompts: tuple[list[dict], dict], fault: bool) -> None:
        self.reference, self.fault, self.llm = oracle_prompts[1], fault, None

    def __call__(self, llm: LLM) -> None:
        llm.llm_engine.proposer = OracleProposer(self.reference, 3, 300)
        if self.fault:
            DEBUG_FAULTS["stale-state"](llm)
        self.llm = llm


def test_verify_identical_when_drafts_are_accepted(tiny_models: dict[str, Path], oracle_prompts: tuple) -> None:
    hook = OracleHook(oracle_prompts, fault=False)
    results = verify(str(tiny_models["hybrid"]), oracle_prompts[0], dict(ENGINE, speculative_config=NGRAM),
                     max_tokens=40, candidate_hook=hook)
    assert all(r.is_identical for r in results)
    assert all(n > 0 for n in hook.llm.get_metrics()["num_accepted_tokens_per_pos"])


def test_verify_reports_stale_state_after_acceptance(tiny_models: dict[str, Path], oracle_prompts: tuple) -> None:
    hook = OracleHook(oracle_prompts, fault=True)
    results = verify(str(tiny_models["hybrid"]), oracle_prompts[0], dict(ENGINE, speculative_config=NGRAM),
                     max_tokens=40, candidate_hook=hook)
    diverged = [r for r in results if not r.is_identical]
    assert len(diverged) >= 3, results
    for r in diverged:
        d = r.divergence
        assert d.position > 0  # the first token comes from the prefill, before any acceptance
        assert r.candidate_token_ids[:d.position] == r.baseline_token_ids[:d.position]
        assert d.baseline_token == r.baseline_token_ids[d.position] != d.candidate_token
        assert d.candidate_token == r.candidate_token_ids[d.position]
        assert d.baseline_margin > 0 and d.candidate_margin > 0 and d.baseline_text and d.candidate_text


def test_first_divergence_when_one_run_stops_early() -> None:
    class Tok:
        def decode(self, ids: list[int]) -> str:
            return f"<{ids[0]}>"

    lp = [{5: -0.1, 6: -2.6}, {7: -0.5, 8: -1.0}, {9: -0.2, 1: -3.0}]
    base, cand = CompletionOutput(0, "", [5, 7, 9], "length", logprobs=lp), CompletionOutput(0, "", [5, 7], "stop")
    d = first_divergence(base, cand, Tok())
    assert (d.position, d.baseline_token, d.candidate_token, d.candidate_text) == (2, 9, None, "<end>")
    assert d.baseline_margin == pytest.approx(2.8) and d.candidate_margin is None
    assert first_divergence(base, base, Tok()) is None
    assert top2_margin({3: -1.0, 4: -0.25, 5: -7.0}) == 0.75


def test_cli_verify_exit_codes(tiny_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # the target as its own draft model: every draft is accepted, so the fault cannot hide
    config = {"method": "draft_model", "model": str(tiny_models["hybrid"]), "num_speculative_tokens": 3}
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("\n".join(json.dumps({"prompt": t, "id": i}) for i, t in enumerate(TEXTS[:3])) + "\n")
    argv = ["verify", "--model", str(tiny_models["hybrid"]), *CLI_ENGINE, "--max-tokens", "24", "--ignore-eos",
            "--speculative-config", json.dumps(config), "--prompts-file", str(prompts_file), TEXTS[3]]
    assert cli_main(argv) == 0
    out, err = capsys.readouterr()
    assert out.count("identical") == 4 + 1 and "4 of 4 requests identical, 0 diverged (96 baseline" in out
    assert "(acceptance rate 1.000)" in err
    assert cli_main([*argv, "--debug-fault", "stale-state"]) == 1  # verify's self-test: a known bug is caught
    out, err = capsys.readouterr()
    assert out.count("DIVERGED") == 4 and "0 of 4 requests identical, 4 diverged" in out
    assert cli_main(["verify", "--model", str(tiny_models["qwen3"]), *CLI_ENGINE, "--max-tokens", "3",
                     "--speculative-config", json.dumps(NGRAM), "a"]) == 0
    assert "warning: no draft token was accepted" in capsys.readouterr().err


def test_cli_verify_needs_a_configuration(tiny_models: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    assert cli_main(["verify", "--model", str(tiny_models["qwen3"]), *CLI_ENGINE, "x"]) == 2
    err = capsys.readouterr().err
    assert "--speculative-config" in err and "--baseline-eager" in err


def test_cli_verify_against_an_eager_baseline(tiny_models: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    """--baseline-eager alone puts the candidate's CUDA graphs under test (on CPU both run eagerly: identical),
    and with a speculative config the baseline is eager and without speculation."""
    base = ["verify", "--model", str(tiny_models["hybrid"]), *CLI_ENGINE, "--max-tokens", "6", "--baseline-eager"]
    assert cli_main([*base, "def f(x):"]) == 0
    assert "1 of 1 requests identical" in capsys.readouterr().out
    assert cli_main([*base, "--speculative-config", json.dumps(NGRAM), "def f(x):"]) == 0
    assert "1 of 1 requests identical" in capsys.readouterr().out


def test_cli_generate_prints_spec_metrics(tiny_models: dict[str, Path], tmp_path: Path,
                                          capsys: pytest.CaptureFixture) -> None:
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("def f(x):\n\nclass A:\n")  # plain text, one prompt per line; blank lines skipped
    assert cli_main(["generate", "--model", str(tiny_models["qwen3"]), *CLI_ENGINE, "--max-tokens", "12",
                     "--speculative-config", json.dumps(NGRAM), "--prompts-file", str(prompts_file), "x = 1"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("x = 1") and "\ndef f(x):" in out and "\nclass A:" in out
    assert "num_drafts=" in err and "num_accepted_tokens=" in err and "mean_acceptance_length=" in err
    per_pos = err.split("acceptance rate per position:")[1].split("\n")[0].split()
    assert len(per_pos) == 3 and all(0 <= float(x) <= 1 for x in per_pos)
    assert "steps=" in err and "steps_without_drafts=" in err and "draft_skips=" in err and "steps_drafting_off=" in err
    assert cli_main(["generate", "--model", str(tiny_models["qwen3"]), *CLI_ENGINE, "--max-tokens", "2", "x"]) == 0
    assert "num_drafts" not in capsys.readouterr().err  # no speculation, no metrics


@pytest.mark.parametrize("config, message", [('{"method": ngram}', "invalid JSON"),
                                             ('["ngram"]', "must be a JSON object")])
def test_cli_bad_speculative_json_exits_2(config: str, message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        cli_main(["generate", "--speculative-config", config, "x"])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_cli_bad_speculative_config_or_prompts_file_exits_2(tiny_models: dict[str, Path], tmp_path: Path,
                                                             capsys: pytest.CaptureFixture) -> None:
    base = ["generate", "--model", str(tiny_models["qwen3"]), *CLI_ENGINE]
    assert cli_main([*base, "--speculative-config", '{"method": "ngram", "k": 3}', "x"]) == 2
    assert "speculative_config" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\nnot json\n')
    assert cli_main([*base, "--prompts-file", str(bad)]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
    assert cli_main(base) == 2
    assert "no prompts" in capsys.readouterr().err


def test_a_bad_candidate_fails_before_the_baseline_runs(tiny_models: dict[str, Path], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import truespec.entrypoints.verify as verify_module

    def no_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("the baseline ran before the candidate was checked")

    monkeypatch.setattr(verify_module, "_run", no_run)
    bad = {"speculative_config": {"method": "draft_model", "model": str(tmp_path / "none"),
                                  "num_speculative_tokens": 2}, "device": "cpu"}
    with pytest.raises(FileNotFoundError, match="speculative_config"):
        verify_module.verify(str(tiny_models["qwen3"]), ["x"], bad)
