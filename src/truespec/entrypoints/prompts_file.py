"""Prompts files (``--prompts-file``) and prompts given on the command line.

A prompts file holds one prompt per line: JSON objects with a "prompt" (or "prompt_token_ids") key, or plain
text. Lines end at "\\n" only (a trailing "\\r" is dropped): ``str.splitlines`` would also break at U+2028,
U+2029, U+0085 and form feed, which a JSON string may hold raw. Every problem is a ``ValueError`` naming the
file (and the line), which the CLI prints as one line with exit code 2.
"""

import json
from pathlib import Path

PROMPT_KEYS = ("prompt", "prompt_token_ids")


def read_lines(path: Path) -> list[tuple[int, str]]:
    """The file's non-blank lines with their 1-based numbers."""
    try:
        text = path.read_bytes().decode("utf-8-sig")  # bytes: read_text would also end lines at a lone "\r"
    except UnicodeDecodeError as e:
        raise ValueError(f"prompts file {path}: not valid UTF-8 (byte {e.start}: {e.reason})") from e
    except OSError as e:
        raise ValueError(f"prompts file {path}: cannot read it ({e.strerror or e})") from e
    lines = (line.removesuffix("\r") for line in text.split("\n"))
    return [(n, line) for n, line in enumerate(lines, 1) if line.strip()]


def load_prompts(path: Path) -> list[str | dict]:
    """JSON Lines if the first non-blank line is a JSON object (then every line must be), else plain text."""
    lines = read_lines(path)
    if not lines or not isinstance(_json_or_none(lines[0][1]), dict):
        return [line for _, line in lines]
    return [{k: v for k, v in row.items() if k in PROMPT_KEYS} for row in load_rows(path, lines)]


def load_rows(path: Path, lines: list[tuple[int, str]] | None = None) -> list[dict]:
    """Every line a JSON object with a "prompt" or "prompt_token_ids" key; the rows keep all their keys."""
    return [_prompt_row(path, n, line) for n, line in (read_lines(path) if lines is None else lines)]


def _prompt_row(path: Path, n: int, line: str) -> dict:
    row = _json_or_none(line)
    where = f"prompts file {path}:{n}"  # file:line, as compilers write it
    if not isinstance(row, dict) or not set(PROMPT_KEYS) & row.keys():
        raise ValueError(f"{where}: expected a JSON object with a \"prompt\" or \"prompt_token_ids\" key "
                         "(in JSON Lines every line must be one)")
    if not isinstance(row.get("prompt", ""), str) or not isinstance(row.get("prompt_token_ids", []), list):
        raise ValueError(f"{where}: \"prompt\" must be a string and \"prompt_token_ids\" a list of token ids")
    if not is_valid_unicode(row.get("prompt", "")):
        raise ValueError(f"{where}: the prompt is not valid Unicode (a lone surrogate)")
    return row


def check_cli_prompts(prompts: list[str]) -> None:
    """Prompt arguments: Python turns bytes that are not UTF-8 into lone surrogates (surrogateescape)."""
    for i, prompt in enumerate(prompts, 1):
        if not is_valid_unicode(prompt):
            try:
                shown = repr(prompt.encode("utf-8", "surrogateescape"))  # the bytes as given: b'a\xffb'
            except UnicodeEncodeError:  # a surrogate that stands for no byte
                shown = ascii(prompt)
            raise ValueError(f"prompt argument {i} is not valid UTF-8 text: {shown}")


def is_valid_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True


def _json_or_none(line: str) -> object:
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None
