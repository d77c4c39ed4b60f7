"""OpenAI-style tool-call parsers: model text with tool-call markup -> ``content`` + ``tool_calls``.

Both formats wrap each call in ``<tool_call>BODY</tool_call>`` and differ only in BODY: ``hermes`` holds JSON
``{"name": ..., "arguments": {...}}``; ``qwen3_coder`` holds ``<function=NAME><parameter=P>\\nVALUE\\n</parameter>
...</function>``, each VALUE typed by the tool's JSON schema.

Streaming and non-streaming share one state machine (``extract`` is ``feed(text)`` then ``finish()``), and its
decisions depend only on the text seen so far, never on where the deltas were cut: for every way of cutting an
output, the concatenated deltas equal the one-shot result. A call is emitted whole (id, name, arguments in one
delta) when its ``</tool_call>`` arrives; a block that does not parse (bad JSON, no ``<function=``, unknown tool,
reopened or still open at the end) comes back verbatim as text, never as an exception. Whitespace that separates
only tool calls, or a call from the start or end of the output, is dropped; all other text is kept verbatim.
"""

import json
import math
import re
from abc import ABC, abstractmethod
from dataclasses import replace
from typing import Any, ClassVar, Literal

from truespec.entrypoints.tool_calls import Delta, ToolCallDelta, ToolCallResult, collect

OPEN, CLOSE = "<tool_call>", "</tool_call>"
Channel = Literal["content", "reasoning"]
Schemas = dict[str, dict[str, Any]]  # tool name -> JSON-schema ``properties`` of its parameters
_INVALID = object()


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that could begin ``tag``: held back until later text decides."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def tool_schemas(tools: list[dict[str, Any]] | None) -> Schemas | None:
    """OpenAI ``tools`` -> name -> parameter properties; None (any name, string values) when no tools are given."""
    if not tools:
        return None
    schemas = {}
    for tool in tools:
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            parameters = function.get("parameters")
            properties = parameters.get("properties") if isinstance(parameters, dict) else None
            schemas[function["name"]] = properties if isinstance(properties, dict) else {}
    return schemas


class ToolParser(ABC):
    """A stateless format; ``stream`` makes the per-request state, ``extract`` parses a whole output."""

    name: ClassVar[str]

    @abstractmethod
    def parse_block(self, body: str, schemas: Schemas | None) -> list[tuple[str, str]] | None:
        """The calls ``(name, JSON arguments)`` in one ``<tool_call>`` body, or None when it is malformed."""

    def stream(self, tools: list[dict[str, Any]] | None = None, id_prefix: str = "call_", first_index: int = 0,
               channel: Channel = "content") -> "ToolCallStream":
        return ToolCallStream(self, tool_schemas(tools), id_prefix, first_index, channel)

    def extract(self, text: str, tools: list[dict[str, Any]] | None = None, id_prefix: str = "call_",
                first_index: int = 0) -> ToolCallResult:
        stream = self.stream(tools, id_prefix, first_index)
        return collect(stream.feed(text) + stream.finish())


class ToolCallStream:
    """One request's incremental parse: ``feed`` each new piece of text, then ``finish`` once.

    Call ``i`` gets id ``f"{id_prefix}{i}"`` (``i`` counts from ``first_index``), so streamed and non-streamed ids
    match. Non-call text goes to the ``channel`` field of its deltas.
    """

    def __init__(self, parser: ToolParser, schemas: Schemas | None, id_prefix: str = "call_", first_index: int = 0,
                 channel: Channel = "content") -> None:
        self.parser, self.schemas, self.id_prefix, self.channel = parser, schemas, id_prefix, channel
        self.next_index = first_index
        self.num_tool_calls = 0
        self._buf = ""  # text seen but not yet decided
        self._in_block = False  # ``_buf`` starts with OPEN
        self._scan = 0  # in a block: tags starting before this offset were already searched for
        self._ws = ""  # whitespace dropped before the open block, given back if the block is malformed
        self._after_text = False  # text was emitted last, so whitespace here is kept

    @property
    def has_tool_calls(self) -> bool:
        return self.num_tool_calls > 0

    def feed(self, text: str) -> list[Delta]:
        self._buf += text
        out: list[Delta] = []
        while self._step_block(out) if self._in_block else self._step_text(out):
            pass
        return out

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        if self._in_block or self._after_text or self._buf.strip():  # held text, or an unclosed block, verbatim
            self._text(out, self._ws + self._buf)
        self._buf, self._ws, self._in_block = "", "", False
        return out

    def _step_text(self, out: list[Delta]) -> bool:
        """Emit text up to the next OPEN; True when a block starts (step again)."""
        buf = self._buf
        if not self._after_text:  # whitespace after the start or a call is dropped unless text follows it
            rest = buf.lstrip()
            if rest.startswith(OPEN):
                self._open_block(rest, ws=buf[: len(buf) - len(rest)])
                return True
            if OPEN.startswith(rest):  # empty, or maybe the start of OPEN: wait
                return False
            self._after_text = True
        start = buf.find(OPEN)
        end = start if start >= 0 else len(buf) - partial_tag_len(buf, OPEN)
        self._text(out, buf[:end])
        if start < 0:
            self._buf = buf[end:]
            return False
        self._open_block(buf[start:], ws="")
        return True

    def _open_block(self, buf: str, ws: str) -> None:
        self._buf, self._ws, self._in_block, self._scan = buf, ws, True, len(OPEN)

    def _step_block(self, out: list[Delta]) -> bool:
        """Close the open block once its CLOSE (or a new OPEN) arrives; True when it was decided."""
        buf = self._buf
        end, reopen = buf.find(CLOSE, self._scan), buf.find(OPEN, self._scan)
        if reopen >= 0 and (end < 0 or reopen < end):  # never closed: its text is plain text
            self._reject(out, reopen)
            return True
        if end < 0:
            self._scan = max(len(OPEN), len(buf) - len(CLOSE) + 1)
            return False
        calls = self.parser.parse_block(buf[len(OPEN) : end], self.schemas)
        if calls is None:
            self._reject(out, end + len(CLOSE))
            return True
        for name, arguments in calls:
            index = self.next_index
            out.append(Delta(tool_call=ToolCallDelta(index, f"{self.id_prefix}{index}", name, arguments)))
            self.next_index, self.num_tool_calls = index + 1, self.num_tool_calls + 1
        self._buf, self._ws, self._in_block, self._after_text = buf[end + len(CLOSE) :], "", False, False
        return True

    def _reject(self, out: list[Delta], end: int) -> None:
        self._text(out, self._ws + self._buf[:end])
        self._buf, self._ws, self._in_block, self._after_text = self._buf[end:], "", False, True

    def _text(self, out: list[Delta], text: str) -> None:
        if not text:
            return
        if out and out[-1].tool_call is None and getattr(out[-1], self.channel) is not None:  # merge into last
            out[-1] = replace(out[-1], **{self.channel: getattr(out[-1], self.channel) + text})
        else:
            out.append(Delta(**{self.channel: text}))


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``."""

    name = "hermes"

    def parse_block(self, body: str, schemas: Schemas | None) -> list[tuple[str, str]] | None:
        call = _json_load(body)
        if not isinstance(call, dict) or not isinstance(name := call.get("name"), str):
            return None
        arguments = call.get("arguments", {})
        if not isinstance(arguments, dict) or (schemas is not None and name not in schemas):
            return None
        return [(name, json.dumps(arguments, ensure_ascii=False))]


_FUNCTION = re.compile(r"\s*<function=([^>]*)>(.*?)(?:</function>|\Z)\s*", re.DOTALL)
# A missing </parameter> ends the value at the next parameter (or the function's end), as vLLM allows.
_PARAMETER = re.compile(r"<parameter=([^>]*)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)


class Qwen3CoderToolParser(ToolParser):
    """``<tool_call>\\n<function=f>\\n<parameter=p>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>``."""

    name = "qwen3_coder"

    def parse_block(self, body: str, schemas: Schemas | None) -> list[tuple[str, str]] | None:
        calls, pos = [], 0
        while pos < len(body) and (match := _FUNCTION.match(body, pos)):
            name = match[1].strip()
            if not name or (schemas is not None and name not in schemas):
                return None
            properties = schemas[name] if schemas is not None else {}
            arguments = {p[1].strip(): typed_value(_unwrap(p[2]), properties.get(p[1].strip()))
                         for p in _PARAMETER.finditer(match[2])}  # fmt: skip
            calls.append((name, json.dumps(arguments, ensure_ascii=False)))
            pos = match.end()
        return calls if calls and pos == len(body) else None


def _unwrap(value: str) -> str:
    """Strip exactly the one newline the format puts on each side of a value."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def typed_value(raw: str, schema: Any) -> Any:
    """``raw`` as the JSON-schema type of its parameter; the string itself when untyped or it does not parse."""
    kinds = schema.get("type") if isinstance(schema, dict) else None
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if "null" in kinds and raw.strip().lower() in ("null", "none"):
        return None
    for kind in kinds:
        if (value := _convert(raw, kind)) is not _INVALID:
            return value
    return raw


def _convert(raw: str, kind: Any) -> Any:
    text = raw.strip()
    if kind == "string":
        return raw
    if kind == "boolean":
        return text.lower() == "true" if text.lower() in ("true", "false") else _INVALID
    if kind not in ("integer", "number", "array", "object"):  # untyped, "null", or a schema we do not read
        return _INVALID
    value = _json_load(text)
    if kind in ("integer", "number"):
        if isinstance(value, bool) or not isinstance(value, int | float):
            return _INVALID
        if isinstance(value, float) and not math.isfinite(value):
            return _INVALID
        if kind == "integer" and isinstance(value, float):
            return int(value) if value.is_integer() else _INVALID
        return value
    if (kind == "array" and isinstance(value, list)) or (kind == "object" and isinstance(value, dict)):
        return value
    return _INVALID


def _json_load(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return _INVALID


TOOL_PARSERS: dict[str, type[ToolParser]] = {"qwen3_coder": Qwen3CoderToolParser, "hermes": HermesToolParser}
