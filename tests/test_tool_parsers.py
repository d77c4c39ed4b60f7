"""Tool-call parsers: exact non-streaming results, and streamed deltas that concatenate to them for every cut."""

import json
from typing import Any

import pytest

from helpers.deltas import cuts
from truespec.entrypoints.tool_calls import Delta, ToolCall, collect, finish_reason
from truespec.entrypoints.tool_parsers import TOOL_PARSERS, HermesToolParser, Qwen3CoderToolParser, ToolParser


def tool(name: str, **types: Any) -> dict[str, Any]:
    properties = {param: {"type": kind} for param, kind in types.items()}
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": properties}}}


TOOLS = [tool("get_weather", city="string", days="integer"),
         tool("typed", i="integer", f="number", b="boolean", n="null", a="array", o="object", s="string",
              u=["integer", "null"])]  # fmt: skip


def qwen_call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={param}>\n{value}\n</parameter>\n" for param, value in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def hermes_call(name: str, arguments: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def streamed(parser: ToolParser, pieces: list[str], tools: list[dict[str, Any]] | None) -> list[Delta]:
    stream = parser.stream(tools)
    return [delta for piece in pieces for delta in stream.feed(piece)] + stream.finish()


WEATHER = qwen_call("get_weather", city="Paris", days="3")
QWEN_OUTPUTS = [
    WEATHER,
    f"Let me check.\n\n{WEATHER}\n{qwen_call('get_weather', city='Rome', days='1')}\nDone.",
    qwen_call("typed", i="42", f="2.5", b="true", n="null", a="[1, 2]", o='{"k": "v"}', s="x\n<b> a < b </b>\n"),
    f"{WEATHER}{WEATHER}  \n\n",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n",  # unclosed
    "a <tool_call> b <tool_call>\n<function=get_weather>\n</function>\n</tool_call> c </tool_call> <tool_ d <",
    "<tool_call>\nno function here\n</tool_call>",
    "plain text with < and <tool and </tool_call> but no call",
    "  \n <tool",
    "",
]
HERMES_OUTPUTS = [
    hermes_call("get_weather", {"city": "Paris", "days": 3}),
    f"Sure.\n{hermes_call('get_weather', {'city': 'Oslo'})}\n\n{hermes_call('typed', {'s': '</x> <'})}\nBye",
    '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',  # bad JSON
    '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',  # unknown tool
]


def test_single_call_is_a_tool_call_without_content() -> None:
    result = Qwen3CoderToolParser().extract(WEATHER, TOOLS)
    assert result.content is None
    assert result.tool_calls == [ToolCall("call_0", "get_weather", '{"city": "Paris", "days": 3}')]
    assert result.has_tool_calls and finish_reason(result.has_tool_calls, "stop") == "tool_calls"
    assert finish_reason(False, "length") == "length"


def test_text_around_calls_kept_and_whitespace_between_calls_dropped() -> None:
    result = Qwen3CoderToolParser().extract(QWEN_OUTPUTS[1], TOOLS)
    assert result.content == "Let me check.\n\n\nDone."
    assert [(c.id, c.name, json.loads(c.arguments)) for c in result.tool_calls] == [
        ("call_0", "get_weather", {"city": "Paris", "days": 3}), ("call_1", "get_weather", {"city": "Rome", "days": 1})]
    assert Qwen3CoderToolParser().extract(QWEN_OUTPUTS[3], TOOLS).content is None


def test_parameter_values_typed_by_schema() -> None:
    text = qwen_call("typed", i="42", f="2.5", b="True", n="null", a="[1, 2]", o='{"k": [true]}',
                     s="line1\n<b>x</b> a < b\nline3", u="null", extra="5")  # fmt: skip
    arguments = json.loads(Qwen3CoderToolParser().extract(text, TOOLS).tool_calls[0].arguments)
    assert arguments == {"i": 42, "f": 2.5, "b": True, "n": None, "a": [1, 2], "o": {"k": [True]},
                         "s": "line1\n<b>x</b> a < b\nline3", "u": None, "extra": "5"}  # fmt: skip


def test_untypable_values_fall_back_to_the_verbatim_string() -> None:
    text = qwen_call("typed", i="seven", f="nan", b="yes", a="[1,", o="[1]", s="\n  spaced  \n", u="7.0")
    arguments = json.loads(Qwen3CoderToolParser().extract(text, TOOLS).tool_calls[0].arguments)
    assert arguments == {"i": "seven", "f": "nan", "b": "yes", "a": "[1,", "o": "[1]", "s": "\n  spaced  \n", "u": 7}


def test_without_tools_any_name_is_accepted_and_values_stay_strings() -> None:
    result = Qwen3CoderToolParser().extract(qwen_call("anything", n="3", flag="true"), None)
    assert result.tool_calls == [ToolCall("call_0", "anything", '{"n": "3", "flag": "true"}')]


def test_ids_follow_prefix_and_first_index() -> None:
    result = Qwen3CoderToolParser().extract(WEATHER + WEATHER, TOOLS, id_prefix="call_req7_", first_index=2)
    assert [c.id for c in result.tool_calls] == ["call_req7_2", "call_req7_3"]


@pytest.mark.parametrize("text", [
    QWEN_OUTPUTS[4],  # unclosed
    "<tool_call>\nno function here\n</tool_call>",
    qwen_call("unknown_tool", city="x"),
    "<tool_call>\n<function=get_weather>\n</function>\ntrailing junk\n</tool_call>",
    "\n<tool_call>\n<function=get_weather>",
])  # fmt: skip
def test_malformed_qwen_blocks_come_back_verbatim_as_content(text: str) -> None:
    result = Qwen3CoderToolParser().extract(text, TOOLS)
    assert (result.content, result.tool_calls) == (text, [])


def test_reopened_block_leaves_the_first_as_content() -> None:
    result = Qwen3CoderToolParser().extract(QWEN_OUTPUTS[5], TOOLS)
    assert result.content == "a <tool_call> b  c </tool_call> <tool_ d <"
    assert result.tool_calls == [ToolCall("call_0", "get_weather", "{}")]


def test_hermes_calls_and_surrounding_text() -> None:
    result = HermesToolParser().extract(HERMES_OUTPUTS[1], TOOLS)
    assert result.content == "Sure.\n\nBye"
    assert result.tool_calls == [ToolCall("call_0", "get_weather", '{"city": "Oslo"}'),
                                 ToolCall("call_1", "typed", '{"s": "</x> <"}')]  # fmt: skip


@pytest.mark.parametrize("text", [
    HERMES_OUTPUTS[2], HERMES_OUTPUTS[3], "<tool_call>[1, 2]</tool_call>", '<tool_call>{"name": 3}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": "x"}</tool_call>', '<tool_call>{"name": "get_weather"',
])  # fmt: skip
def test_malformed_hermes_blocks_come_back_verbatim_as_content(text: str) -> None:
    result = HermesToolParser().extract(text, TOOLS)
    assert (result.content, result.tool_calls) == (text, [])


def test_stream_emits_text_and_calls_before_finish_and_holds_only_possible_tags() -> None:
    stream = Qwen3CoderToolParser().stream(TOOLS)
    assert stream.feed("Hi <tool_") == [Delta(content="Hi ")]
    deltas = stream.feed(WEATHER[len("<tool_") :] + " <t")
    assert [d.tool_call.name for d in deltas if d.tool_call] == ["get_weather"] and stream.has_tool_calls
    assert stream.feed("x") == [Delta(content=" <tx")]
    assert stream.finish() == []


@pytest.mark.parametrize("parser_name", sorted(TOOL_PARSERS))
@pytest.mark.parametrize("tools", [TOOLS, None], ids=["tools", "no_tools"])
@pytest.mark.parametrize("index", range(len(QWEN_OUTPUTS + HERMES_OUTPUTS)))
def test_streamed_deltas_concatenate_to_the_non_streaming_result(parser_name: str, tools: Any, index: int) -> None:
    parser = TOOL_PARSERS[parser_name]()
    text = (QWEN_OUTPUTS + HERMES_OUTPUTS)[index]
    expected = parser.extract(text, tools)
    for pieces in cuts(text, seed=index):
        deltas = streamed(parser, pieces, tools)
        assert collect(deltas) == expected, pieces
        assert all(d.content != "" and d.reasoning is None for d in deltas)
        firsts = [d.tool_call for d in deltas if d.tool_call and d.tool_call.id]
        assert [(c.id, c.name) for c in firsts] == [(c.id, c.name) for c in expected.tool_calls]
