"""The CLI on bad input: a user error exits 2 with one line naming the argument or file (no traceback); a valid
JSON Lines file is read as JSON Lines whatever Unicode line separators its strings hold; an internal error keeps
its traceback."""

import json
import shutil
from pathlib import Path

import pytest

from truespec.entrypoints.cli import main as cli_main
from truespec.entrypoints.prompts_file import load_prompts
from truespec.llm import LLM

CLI_ENGINE = ["--dtype", "float32", "--device", "cpu", "--max-model-len", "128", "--max-tokens", "2"]
# Valid raw inside a JSON string, but str.splitlines() breaks lines at each of them.
SEPARATORS = ["\u2028", "\u2029", "\u0085", "\x0c", "\x1c", "\x1d", "\x1e", "\x0b"]


def generate(model_dir: Path, *argv: str) -> list[str]:
    return ["generate", "--model", str(model_dir), *CLI_ENGINE, *argv]


def one_line_error(capsys: pytest.CaptureFixture) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_jsonl_prompts_with_unicode_line_separators_stay_jsonl(tmp_path: Path) -> None:
    texts = [f"a{sep}b" for sep in SEPARATORS]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": t}, ensure_ascii=False) + "\r\n" for t in texts), encoding="utf-8")
    assert load_prompts(path) == [{"prompt": t} for t in texts]
    plain = tmp_path / "p.txt"
    plain.write_text("\ufeffx\u2028y\x0c\x1c\x85\r\n\n  \nz\rw\n", encoding="utf-8")  # a BOM, a CRLF, a lone CR
    assert load_prompts(plain) == ["x\u2028y\x0c\x1c\x85", "z\rw"]


def test_cli_completes_each_jsonl_prompt_once(tiny_models: dict[str, Path], tmp_path: Path,
                                              capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "x = 1\u2028y"}, ensure_ascii=False) + "\n"
                    + json.dumps({"prompt_token_ids": [5, 6, 7]}) + "\n", encoding="utf-8")
    assert cli_main(generate(tiny_models["qwen3"], "--prompts-file", str(path))) == 0
    out = capsys.readouterr().out
    assert out.count("[finish_reason=") == 2 and out.startswith("x = 1\u2028y") and '"prompt"' not in out


@pytest.mark.parametrize("content, reason", [
    (None, "cannot read it (Is a directory)"),
    (b"ok\n\xff\xfe\n", "not valid UTF-8 (byte 3"),
])
def test_unreadable_prompts_file_exits_2(tiny_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture,
                                         content: bytes | None, reason: str) -> None:
    path = tmp_path / "prompts"
    path.mkdir() if content is None else path.write_bytes(content)
    assert cli_main(generate(tiny_models["qwen3"], "--prompts-file", str(path))) == 2
    assert f"prompts file {path}: {reason}" in one_line_error(capsys)


def test_prompts_file_without_permission_exits_2(tiny_models: dict[str, Path], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "secret.txt"
    path.write_text("x\n")

    def denied(self: Path) -> bytes:  # chmod does not stop root, who runs the CI
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", denied)
    assert cli_main(generate(tiny_models["qwen3"], "--prompts-file", str(path))) == 2
    assert f"prompts file {path}: cannot read it (Permission denied)" in one_line_error(capsys)


@pytest.mark.parametrize("line", ['{"text": "a"}', '[1, 2]', '"a"', 'not json', '{"prompt": 5}',
                                  '{"prompt_token_ids": "1 2"}', '{"prompt": "a\\ud800b"}'])
def test_bad_jsonl_line_names_file_and_line(tiny_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture,
                                            line: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a"}\n\n' + line + "\n")
    assert cli_main(generate(tiny_models["qwen3"], "--prompts-file", str(path))) == 2
    assert f"prompts file {path}:3: " in one_line_error(capsys)


# argv's invalid UTF-8 byte (Python's surrogateescape), a lone surrogate
@pytest.mark.parametrize("prompt, shown", [("ab\udcff", "b'ab\\xff'"), ("a\ud800", "'a\\ud800'")])
def test_cli_prompt_that_is_not_unicode_exits_2(tiny_models: dict[str, Path], capsys: pytest.CaptureFixture,
                                                prompt: str, shown: str) -> None:
    assert cli_main(generate(tiny_models["qwen3"], "ok", prompt)) == 2
    assert f"prompt argument 2 is not valid UTF-8 text: {shown}" in one_line_error(capsys)


@pytest.mark.parametrize("content", ["{x", "[1, 2]", "\xff"])
def test_invalid_generation_config_names_the_file(tiny_models: dict[str, Path], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture, content: str) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_models["qwen3"], model_dir)
    (model_dir / "generation_config.json").write_text(content, encoding="latin-1")
    assert cli_main(generate(model_dir, "x")) == 2
    assert f"invalid {model_dir / 'generation_config.json'}: " in one_line_error(capsys)


def test_compilation_config_json_error_shows_its_reason(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        cli_main(["generate", "--compilation-config", "{x", "a"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --compilation-config: invalid JSON (Expecting property name" in err


def test_engine_value_error_exits_2_but_internal_error_keeps_its_traceback(
        tiny_models: dict[str, Path], capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(exc: Exception) -> None:
        def generate_fails(*args: object, **kwargs: object) -> None:
            raise exc
        monkeypatch.setattr(LLM, "generate", generate_fails)

    fail(ValueError("prompt 0 is not valid Unicode (a lone surrogate)"))  # the engine's own check
    assert cli_main(generate(tiny_models["qwen3"], "x")) == 2
    assert "error: prompt 0 is not valid Unicode" in one_line_error(capsys)
    fail(RuntimeError("a bug"))
    with pytest.raises(RuntimeError, match="a bug"):  # main() lets it through: Python prints the traceback
        cli_main(generate(tiny_models["qwen3"], "x"))
