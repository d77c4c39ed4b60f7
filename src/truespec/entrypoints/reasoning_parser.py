"""Reasoning parser (``qwen3``): ``<think>REASONING</think>CONTENT`` -> ``(reasoning, content)``, and its
combination with a tool parser.

The thinking block opens at the very start of the output; with ``starts_in_reasoning`` (the chat template already
put ``<think>`` in the prompt) the output starts inside it, and an opening tag there is dropped all the same. A
block never closed is reasoning to the end: a stream cannot know that ``</think>`` will not come, and the one-shot
parse agrees with the stream. Text is kept verbatim (vLLM's behaviour), as is everything after ``</think>``.

Combining (``ReasoningToolStream`` / ``extract_reasoning_and_tools``): the reasoning parser runs first and splits
the text into two channels; the tool parser then runs over each channel, the reasoning first, so a call written
inside the thinking block is still a call, with the answer's calls numbered after it. This equals
``rp.extract(text)`` followed by ``tp.extract(reasoning)`` and ``tp.extract(content, first_index=<calls so far>)``.
"""

from typing import Any, ClassVar, Literal

from truespec.entrypoints.tool_calls import Delta, ToolCallResult, collect
from truespec.entrypoints.tool_parsers import ToolCallStream, ToolParser, partial_tag_len

THINK_START, THINK_END = "<think>", "</think>"


class ReasoningStream:
    """One request's incremental split: ``feed`` each new piece of text, then ``finish`` once."""

    def __init__(self, starts_in_reasoning: bool = False) -> None:
        self.starts_in_reasoning = starts_in_reasoning
        self._state: Literal["start", "reasoning", "content"] = "start"  # start -> [reasoning ->] content
        self._buf = ""  # text seen but not yet decided: a possible tag

    @property
    def is_reasoning_done(self) -> bool:
        return self._state == "content"

    def feed(self, text: str) -> list[Delta]:
        self._buf += text
        out: list[Delta] = []
        if self._state == "start":
            if self._buf.startswith(THINK_START):
                self._buf, self._state = self._buf[len(THINK_START) :], "reasoning"
            elif not THINK_START.startswith(self._buf):  # no opening tag; otherwise wait for more text
                self._state = "reasoning" if self.starts_in_reasoning else "content"
        if self._state == "reasoning":
            end = self._buf.find(THINK_END)
            cut = end if end >= 0 else len(self._buf) - partial_tag_len(self._buf, THINK_END)
            self._emit(out, self._buf[:cut])
            self._buf = self._buf[cut + len(THINK_END) :] if end >= 0 else self._buf[cut:]
            self._state = "content" if end >= 0 else "reasoning"
        if self._state == "content":
            self._emit(out, self._buf)
            self._buf = ""
        return out

    def finish(self) -> list[Delta]:
        if self._state == "start":  # a proper prefix of <think> (or nothing): it never became the tag
            self._state = "reasoning" if self.starts_in_reasoning else "content"
        out: list[Delta] = []
        self._emit(out, self._buf)  # the start of a </think> that never came
        self._buf = ""
        return out

    def _emit(self, out: list[Delta], text: str) -> None:
        if text:
            out.append(Delta(reasoning=text) if self._state == "reasoning" else Delta(content=text))


class Qwen3ReasoningParser:
    """Stateless: ``stream`` makes the per-request state, ``extract`` splits a whole output."""

    name: ClassVar[str] = "qwen3"

    def __init__(self, starts_in_reasoning: bool = False) -> None:
        self.starts_in_reasoning = starts_in_reasoning

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.starts_in_reasoning)

    def extract(self, text: str) -> tuple[str | None, str | None]:
        stream = self.stream()
        result = collect(stream.feed(text) + stream.finish())
        return result.reasoning, result.content


REASONING_PARSERS: dict[str, type[Qwen3ReasoningParser]] = {"qwen3": Qwen3ReasoningParser}


class ReasoningToolStream:
    """The server's per-request parser: reasoning split first, then tool calls in each channel; either optional."""

    def __init__(self, reasoning_parser: Qwen3ReasoningParser | None, tool_parser: ToolParser | None,
                 tools: list[dict[str, Any]] | None = None, id_prefix: str = "call_") -> None:
        self._reasoning = reasoning_parser.stream() if reasoning_parser is not None else None
        self._tool_parser, self._tools, self._id_prefix = tool_parser, tools, id_prefix
        self._thought = tool_parser.stream(tools, id_prefix, channel="reasoning") if tool_parser else None
        self._answer: ToolCallStream | None = None  # opened once the reasoning is over
        self.num_tool_calls = 0

    @property
    def has_tool_calls(self) -> bool:
        return self.num_tool_calls > 0

    def feed(self, text: str) -> list[Delta]:
        return self._route(self._reasoning.feed(text) if self._reasoning is not None else [Delta(content=text)])

    def finish(self) -> list[Delta]:
        out = self._route(self._reasoning.finish() if self._reasoning is not None else [])
        self._open_answer(out)
        if self._answer is not None:
            out += self._count(self._answer.finish())
        return out

    def _route(self, deltas: list[Delta]) -> list[Delta]:
        out: list[Delta] = []
        for delta in deltas:
            if delta.reasoning is not None:
                out += self._count(self._thought.feed(delta.reasoning)) if self._thought else [delta]
            if delta.content is not None:
                self._open_answer(out)
                out += self._count(self._answer.feed(delta.content)) if self._answer else [delta]
        if self._reasoning is None or self._reasoning.is_reasoning_done:
            self._open_answer(out)
        return out

    def _open_answer(self, out: list[Delta]) -> None:
        """The thinking block is over: flush its held text and number the answer's calls after its calls."""
        if self._thought is None:
            return
        out += self._count(self._thought.finish())
        self._answer = self._tool_parser.stream(self._tools, self._id_prefix, self._thought.next_index)
        self._thought = None

    def _count(self, deltas: list[Delta]) -> list[Delta]:
        self.num_tool_calls += sum(delta.tool_call is not None and delta.tool_call.id is not None for delta in deltas)
        return deltas


def extract_reasoning_and_tools(text: str, reasoning_parser: Qwen3ReasoningParser | None,
                                tool_parser: ToolParser | None, tools: list[dict[str, Any]] | None = None,
                                id_prefix: str = "call_") -> ToolCallResult:
    """The non-streaming parse: the concatenation of ``ReasoningToolStream``'s deltas over the whole text."""
    stream = ReasoningToolStream(reasoning_parser, tool_parser, tools, id_prefix)
    return collect(stream.feed(text) + stream.finish())
