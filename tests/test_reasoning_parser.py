"""Reasoning parser and its combination with tool parsers: exact splits, and streams equal to one-shot parses."""

import random

import pytest

from helpers.deltas import cuts
from truespec.entrypoints.reasoning_parser import (
    REASONING_PARSERS,
    Qwen3ReasoningParser,
    ReasoningToolStream,
    extract_reasoning_and_tools,
)
from truespec.entrypoints.tool_calls import Delta, ToolCall, ToolCallResult, collect
from truespec.entrypoints.tool_parsers import TOOL_PARSERS

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]  # fmt: skip
CALL = "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
HERMES = '<tool_call>\n{"name": "get_weather", "arguments": {"days": 2}}\n</tool_call>'
OUTPUTS = [
    "<think>\nhmm\n</think>\n\nAnswer",
    f"<think>\nI should call.\n</think>\n\n{CALL}",
    f"<think>\nlet me {CALL}\n</think>\n\nThe answer {CALL}",
    f"<think>\nlet me {HERMES}\n</think>\n\n{HERMES}\n",
    "hmm </think> answer <think> not a tag",
    "<think>never closed <tool_call>\n<function=get_weather>\n</function>",
    "<thin",
    "<think>ends on </thi",
    "plain answer",
    "",
]


@pytest.mark.parametrize(("text", "starts_in_reasoning", "expected"), [
    ("<think>\nhmm\n</think>\n\nAnswer", False, ("\nhmm\n", "\n\nAnswer")),
    ("<think>\nhmm\n</think>\n\nAnswer", True, ("\nhmm\n", "\n\nAnswer")),
    ("hmm</think>Answer", True, ("hmm", "Answer")),
    ("hmm</think>Answer", False, (None, "hmm</think>Answer")),
    ("Answer <think>x</think>", False, (None, "Answer <think>x</think>")),
    ("<think>never closed", False, ("never closed", None)),
    ("<think></think>", False, (None, None)),
    ("<thin", False, (None, "<thin")),
    ("<thin", True, ("<thin", None)),
    ("<think>ends on </thi", False, ("ends on </thi", None)),
    ("", True, (None, None)),
])  # fmt: skip
def test_reasoning_split(text: str, starts_in_reasoning: bool, expected: tuple[str | None, str | None]) -> None:
    assert Qwen3ReasoningParser(starts_in_reasoning).extract(text) == expected


def test_reasoning_before_a_call() -> None:
    result = extract_reasoning_and_tools(OUTPUTS[1], Qwen3ReasoningParser(), TOOL_PARSERS["qwen3_coder"](), TOOLS)
    assert result == ToolCallResult(None, [ToolCall("call_0", "get_weather", '{"days": 2}')], "\nI should call.\n")


def test_call_inside_thinking_is_a_tool_call_numbered_first() -> None:
    result = extract_reasoning_and_tools(OUTPUTS[2], Qwen3ReasoningParser(), TOOL_PARSERS["qwen3_coder"](), TOOLS)
    assert result.reasoning == "\nlet me " and result.content == "\n\nThe answer "
    assert [c.id for c in result.tool_calls] == ["call_0", "call_1"] and result.has_tool_calls


@pytest.mark.parametrize("text", OUTPUTS)
@pytest.mark.parametrize("tool_parser_name", sorted(TOOL_PARSERS))
def test_combined_parse_equals_reasoning_then_tools_per_channel(text: str, tool_parser_name: str) -> None:
    reasoning_parser, tool_parser = Qwen3ReasoningParser(), TOOL_PARSERS[tool_parser_name]()
    reasoning, content = reasoning_parser.extract(text)
    thought = tool_parser.extract(reasoning or "", TOOLS)
    answer = tool_parser.extract(content or "", TOOLS, first_index=len(thought.tool_calls))
    expected = ToolCallResult(answer.content, thought.tool_calls + answer.tool_calls, thought.content)
    assert extract_reasoning_and_tools(text, reasoning_parser, tool_parser, TOOLS) == expected


def test_either_parser_may_be_absent() -> None:
    qwen3, coder = Qwen3ReasoningParser(), TOOL_PARSERS["qwen3_coder"]()
    for text in OUTPUTS:
        reasoning, content = qwen3.extract(text)
        assert extract_reasoning_and_tools(text, qwen3, None) == ToolCallResult(content, [], reasoning)
        assert extract_reasoning_and_tools(text, None, coder, TOOLS) == coder.extract(text, TOOLS)
        assert extract_reasoning_and_tools(text, None, None) == ToolCallResult(text or None, [], None)


def test_reasoning_streams_eagerly_holding_only_a_possible_end_tag() -> None:
    stream = Qwen3ReasoningParser().stream()
    assert stream.feed("<thi") == []
    assert stream.feed("nk>abc</th") == [Delta(reasoning="abc")]
    assert stream.feed("ink>\n") == [Delta(content="\n")] and stream.is_reasoning_done
    assert stream.finish() == []


@pytest.mark.parametrize("starts_in_reasoning", [False, True])
@pytest.mark.parametrize("index", range(len(OUTPUTS)))
def test_streamed_reasoning_concatenates_to_the_non_streaming_split(starts_in_reasoning: bool, index: int) -> None:
    parser = Qwen3ReasoningParser(starts_in_reasoning)
    text = OUTPUTS[index]
    for pieces in cuts(text, seed=index):
        stream = parser.stream()
        deltas = [delta for piece in pieces for delta in stream.feed(piece)] + stream.finish()
        result = collect(deltas)
        assert (result.reasoning, result.content) == parser.extract(text), pieces


@pytest.mark.parametrize("tool_parser_name", sorted(TOOL_PARSERS))
@pytest.mark.parametrize("starts_in_reasoning", [False, True])
@pytest.mark.parametrize("index", range(len(OUTPUTS)))
def test_streamed_reasoning_and_tools_concatenate_to_the_non_streaming_result(
        tool_parser_name: str, starts_in_reasoning: bool, index: int) -> None:  # fmt: skip
    reasoning_parser, tool_parser = REASONING_PARSERS["qwen3"](starts_in_reasoning), TOOL_PARSERS[tool_parser_name]()
    text = OUTPUTS[index]
    expected = extract_reasoning_and_tools(text, reasoning_parser, tool_parser, TOOLS, id_prefix="call_r_")
    for pieces in cuts(text, seed=index):
        stream = ReasoningToolStream(reasoning_parser, tool_parser, TOOLS, id_prefix="call_r_")
        deltas = [delta for piece in pieces for delta in stream.feed(piece)] + stream.finish()
        assert collect(deltas) == expected, pieces
        assert stream.has_tool_calls == expected.has_tool_calls


FRAGMENTS = ["<tool_call>", "</tool_call>", "<function=get_weather>", "<function=nope>", "</function>",
             "<parameter=days>", "</parameter>", "\n", " ", "7", "x", "<", ">", "<think>", "</think>", "<tool", "</",
             '{"name": "get_weather", "arguments": {"days": 1}}', '{"name": "get_weather"']  # fmt: skip


@pytest.mark.parametrize("tool_parser_name", sorted(TOOL_PARSERS))
def test_random_markup_streams_equal_the_non_streaming_result(tool_parser_name: str) -> None:
    rng = random.Random(0)
    tool_parser = TOOL_PARSERS[tool_parser_name]()
    for trial in range(300):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 14)))
        reasoning_parser = Qwen3ReasoningParser(starts_in_reasoning=trial % 2 == 1)
        expected = extract_reasoning_and_tools(text, reasoning_parser, tool_parser, TOOLS)
        for pieces in [next(cuts(text, seed=trial)), *list(cuts(text, seed=trial))[-3:]]:
            stream = ReasoningToolStream(reasoning_parser, tool_parser, TOOLS)
            deltas = [delta for piece in pieces for delta in stream.feed(piece)] + stream.finish()
            assert collect(deltas) == expected, pieces
