"""Mechanically generated tasks: fast-apply edits, docstring->function chat, function-signature completion."""

import ast
import difflib
import keyword
import random
import re
import textwrap
from dataclasses import dataclass

from .corpus import SourceFile

IDENT = re.compile(r"(?<![A-Za-z0-9_])[A-Za-z_][A-Za-z0-9_]*(?![A-Za-z0-9_])")
LITERAL = re.compile(r"(?<![A-Za-z0-9_.])\d+(?![A-Za-z0-9_.])|'[A-Za-z0-9_ ]{0,16}'|\"[A-Za-z0-9_ ]{0,16}\"")
MAX_FUNCTION_CHARS = 1600
MAX_SNIPPET_CHARS = 480
COMPLETION_CONTEXT_LINES = 24


@dataclass(frozen=True)
class Function:
    signature: str  # dedented `def ...:` line(s), ending with a newline
    body: str  # dedented body lines (docstring included), ending with a newline
    docstring: str | None  # inspect.cleandoc'ed


@dataclass(frozen=True)
class Completion:
    context: str  # up to COMPLETION_CONTEXT_LINES lines of the file before the def (decorators included)
    signature: str  # the def line(s), original indentation, ending with a newline
    body: str  # original indentation


@dataclass(frozen=True)
class EditTask:
    original: str
    instruction: str
    updated: str


def extract_functions(file: SourceFile, documented_only: bool = False) -> list[Function]:
    """Every (async) def that dedents cleanly to column 0 and fits MAX_FUNCTION_CHARS."""
    try:
        tree = ast.parse(file.text)
    except (SyntaxError, ValueError):
        return []
    lines = file.text.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.body[0].lineno == node.lineno:
            continue
        doc = ast.get_docstring(node, clean=True)
        if documented_only and not doc:
            continue
        fn = _function(node, lines, doc)
        if fn is not None:
            out.append(fn)
    return out


def _function(node: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str], doc: str | None) -> Function | None:
    body_start = node.body[0].lineno - 1
    if lines[body_start - 1].rstrip()[-1:] != ":":
        return None
    src = "".join(lines[node.lineno - 1 : node.end_lineno])
    if len(src) > MAX_FUNCTION_CHARS or not src.endswith("\n"):
        return None
    code = textwrap.dedent(src)
    if code[:1].isspace():  # a multi-line string reaches left of the def: no clean dedent
        return None
    code_lines = code.splitlines(keepends=True)
    num_sig = body_start - (node.lineno - 1)
    return Function("".join(code_lines[:num_sig]), "".join(code_lines[num_sig:]), doc or None)


def extract_completions(file: SourceFile, max_body_chars: int = 1200) -> list[Completion]:
    """Function-signature completion prompts in their file's context (original indentation kept)."""
    try:
        tree = ast.parse(file.text)
    except (SyntaxError, ValueError):
        return []
    lines = file.text.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.body[0].lineno == node.lineno:
            continue
        def_line, body_line = node.lineno - 1, node.body[0].lineno - 1
        body = "".join(lines[body_line : node.end_lineno])
        if lines[body_line - 1].rstrip()[-1:] != ":" or len(body) > max_body_chars or not body.endswith("\n"):
            continue
        context = "".join(lines[max(0, def_line - COMPLETION_CONTEXT_LINES) : def_line])
        out.append(Completion(context, "".join(lines[def_line:body_line]), body))
    return out


def chat_pairs(functions: list[Function]) -> list[tuple[str, str]]:
    """(user = the docstring, assistant = the whole function) for documented functions."""
    return [(fn.docstring, fn.signature + fn.body) for fn in functions if fn.docstring and len(fn.docstring) >= 8]


def _unique_lines(lines: list[str]) -> list[int]:
    return [i for i, ln in enumerate(lines) if ln.strip() and lines.count(ln) == 1]


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def _rename(lines: list[str], rng: random.Random, pool: list[str]) -> tuple[str, list[str]] | None:
    text = "".join(lines)
    names = sorted({m for m in IDENT.findall(text) if len(m) > 1 and not keyword.iskeyword(m)})
    if not names:
        return None
    old, new = rng.choice(names), rng.choice(pool)
    if new in names:
        return None
    updated = IDENT.sub(lambda m: new if m.group(0) == old else m.group(0), text)
    return f"rename {old} to {new}", updated.splitlines(keepends=True)


def _delete(lines: list[str], rng: random.Random, pool: list[str]) -> tuple[str, list[str]] | None:
    cands = _unique_lines(lines)
    if len(cands) < 2:
        return None
    i = rng.choice(cands)
    return f"delete the line:\n{lines[i]}", lines[:i] + lines[i + 1 :]


def _insert(lines: list[str], rng: random.Random, pool_lines: list[str]) -> tuple[str, list[str]] | None:
    cands = _unique_lines(lines)
    if not cands:
        return None
    i = rng.choice(cands)
    indent = _indent(lines[i]) + ("    " if lines[i].rstrip().endswith(":") else "")
    new = indent + rng.choice(pool_lines).strip() + "\n"
    return f"after the line:\n{lines[i]}insert the line:\n{new}", lines[: i + 1] + [new] + lines[i + 1 :]


def _replace(lines: list[str], rng: random.Random, pool_lines: list[str]) -> tuple[str, list[str]] | None:
    cands = _unique_lines(lines)
    if not cands:
        return None
    i = rng.choice(cands)
    new = _indent(lines[i]) + rng.choice(pool_lines).strip() + "\n"
    if new == lines[i]:
        return None
    return f"replace the line:\n{lines[i]}with the line:\n{new}", lines[:i] + [new] + lines[i + 1 :]


def _literal(lines: list[str], rng: random.Random, pool: list[str]) -> tuple[str, list[str]] | None:
    text = "".join(lines)
    found = LITERAL.findall(text)
    cands = sorted({lit for lit in found if found.count(lit) == 1})
    if not cands:
        return None
    old = rng.choice(cands)
    if old[0] in "'\"":
        new = old[0] + rng.choice(pool) + old[0]
    else:
        new = str(rng.choice([0, 1, 2, 3, 8, 10, 16, 100, rng.randrange(1000)]))
    if new == old:
        return None
    updated = LITERAL.sub(lambda m: new if m.group(0) == old else m.group(0), text)
    return f"change the literal {old} to {new}", updated.splitlines(keepends=True)


WORD = re.compile(r"\w+|\s+|[^\w\s]")


def changed_spans(original: str, updated: str) -> list[tuple[int, int]]:
    """The edit points of ``updated``, the few words among many copied ones that a model must decide: character
    ranges (diffed word by word against ``original``) of each new or changed run of words plus the word after it,
    where copying resumes (for a deletion, the two words there)."""
    a = [m.group(0) for m in WORD.finditer(original)]
    b_matches = list(WORD.finditer(updated))
    b = [m.group(0) for m in b_matches]
    spans = []
    for op, _, _, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if op != "equal" and j1 < len(b):
            spans.append((b_matches[j1].start(), b_matches[min(max(j2, j1 + 1), len(b) - 1)].end()))
    return spans


EDIT_OPS = {"rename": _rename, "delete": _delete, "insert": _insert, "replace": _replace, "literal": _literal}


def _novel_names(window: list[str], rng: random.Random, names: list[str]) -> list[str]:
    """Consistently rename up to 3 identifiers to random pool names: text no file contains."""
    text = "".join(window)
    found = sorted({m for m in IDENT.findall(text) if len(m) > 1 and not keyword.iskeyword(m)})
    mapping = {old: rng.choice(names) for old in rng.sample(found, min(3, len(found)))}
    return IDENT.sub(lambda m: mapping.get(m.group(0), m.group(0)), text).splitlines(keepends=True)


def make_edit_task(
    file: SourceFile, rng: random.Random, names: list[str], pool_lines: list[str], augment: bool = False
) -> EditTask | None:
    """A random 4-12 line window of `file`, one mechanical edit; most of the updated code copies the input.

    augment (training only): a third of the windows are random lines from anywhere, a third get novel
    identifier names, so that memorising the corpus cannot stand in for copying from the prompt.
    """
    lines = [ln if ln.endswith("\n") else ln + "\n" for ln in file.text.splitlines(keepends=True)]
    if len(lines) < 4:
        return None
    num = rng.randint(4, min(12, len(lines)))
    start = rng.randrange(len(lines) - num + 1)
    window = lines[start : start + num]
    choice = rng.random() if augment else 1.0
    if choice < 1 / 3:
        window = [rng.choice(pool_lines) for _ in range(num)]
    elif choice < 2 / 3:
        window = _novel_names(window, rng, names)
    while len(window) > 4 and sum(map(len, window)) > MAX_SNIPPET_CHARS:
        window = window[:-1]
    if sum(map(len, window)) > MAX_SNIPPET_CHARS or not any(ln.strip() for ln in window):
        return None
    op_name = rng.choice(sorted(EDIT_OPS))
    pool = pool_lines if op_name in ("insert", "replace") else names
    result = EDIT_OPS[op_name](window, rng, pool)
    if result is None:
        return None
    instruction, updated = result
    original, updated_text = "".join(window), "".join(updated)
    if original == updated_text:
        return None
    return EditTask(original, instruction, updated_text)


def edit_pools(files: list[SourceFile], rng: random.Random) -> tuple[list[str], list[str]]:
    """Identifier names and short code lines (indentation kept) from `files`: new names / inserted lines."""
    names: set[str] = set()
    lines: list[str] = []
    for f in files:
        for ln in f.text.splitlines():
            s = ln.strip()
            if 4 <= len(s) <= 60 and not s.startswith(("#", '"', "'")) and not s.endswith(("\\", ",", "(")):
                lines.append(ln.rstrip() + "\n")
        names.update(m for m in IDENT.findall(f.text[:20000]) if 2 <= len(m) <= 24 and not keyword.iskeyword(m))
    lines = sorted(set(lines))
    rng.shuffle(lines)
    return sorted(names), lines[:50000]


def make_edit_tasks(
    files: list[SourceFile], num: int, rng: random.Random, names: list[str], pool_lines: list[str],
    augment: bool = False,
) -> list[EditTask]:
    out: list[EditTask] = []
    for _ in range(num * 4):
        if len(out) == num:
            break
        task = make_edit_task(rng.choice(files), rng, names, pool_lines, augment)
        if task is not None:
            out.append(task)
    return out
