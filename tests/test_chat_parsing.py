"""The server's tool-call / reasoning hook (entrypoints/chat_parsing.py) on scripted model outputs: the message a
chat response returns at once equals what its streamed deltas add up to, whatever the delta sizes (a speculative
step emits several tokens at once); finish_reason "tool_calls"; tool_choice checked with errors naming it."""

import json
import random

import pytest

from truespec.entrypoints.chat_parsing import chat_parser_factory
from truespec.entrypoints.openai_protocol import ChatCompletionRequest, UnsupportedError

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "number"}, "note": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
QWEN3 = ("<think>\nThe user wants a sum.\n</think>\n\nLet me add.\n<tool_call>\n<function=add>\n<parameter=a>\n2\n"
         "</parameter>\n<parameter=b>\n3.5\n</parameter>\n<parameter=note>\nx < y\nsecond line\n</parameter>\n"
         "</function>\n</tool_call>\n<tool_call>\n<function=now>\n</function>\n</tool_call>")
HERMES = ('<think>plan</think>Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
          " done")
PLAIN = "def add(a, b):\n    return a + b  # <tool not a call"


def request(**kwargs: object) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **kwargs)


def streamed(make: object, req: ChatCompletionRequest, text: str, cuts: list[int]) -> dict:
    """Feed ``text`` cut at ``cuts`` as the server does; add the deltas up the way a client does."""
    parser = make(req)
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    content, reasoning, calls = "", "", {}
    for i, piece in enumerate(pieces):
        delta = parser.delta(piece, is_last=i == len(pieces) - 1)
        if delta is None:
            continue
        content += delta.content or ""
        reasoning += delta.reasoning or ""
        assert delta.reasoning == delta.reasoning_content
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call["index"], {"id": call["id"], "name": call["function"]["name"],
                                                     "arguments": ""})
            entry["arguments"] += call["function"]["arguments"]
    return {"content": content or None, "reasoning": reasoning or None,
            "calls": [calls[i] for i in sorted(calls)], "finish": parser.finish_reason("stop")}


def at_once(make: object, req: ChatCompletionRequest, text: str) -> dict:
    parser = make(req)
    message = parser.final(text)
    calls = [{"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
             for c in message.tool_calls or []]
    return {"content": message.content or None, "reasoning": message.reasoning, "calls": calls,
            "finish": parser.finish_reason("stop")}


@pytest.mark.parametrize("parser, text", [("qwen3_coder", QWEN3), ("hermes", HERMES), ("qwen3_coder", PLAIN)])
def test_streamed_deltas_of_any_size_add_up_to_the_message(parser: str, text: str) -> None:
    make = chat_parser_factory(parser, "qwen3", enable_auto_tool_choice=True)
    req = request(tools=TOOLS, tool_choice="auto")
    expected = at_once(make, req, text)
    rng = random.Random(0)
    cut_sets = [list(range(size, len(text), size)) for size in range(1, 9)]
    cut_sets += [sorted(rng.sample(range(1, len(text)), rng.randint(1, 6))) for _ in range(30)]
    for cuts in cut_sets:
        assert streamed(make, req, text, cuts) == expected, cuts
    if text is QWEN3:
        assert expected["reasoning"] == "\nThe user wants a sum.\n" and expected["finish"] == "tool_calls"
        assert [c["name"] for c in expected["calls"]] == ["add", "now"]
        assert json.loads(expected["calls"][0]["arguments"]) == {"a": 2, "b": 3.5, "note": "x < y\nsecond line"}
        assert expected["content"].strip() == "Let me add."
    if text is PLAIN:
        assert expected == {"content": PLAIN, "reasoning": None, "calls": [], "finish": "stop"}


def test_without_tools_or_with_tool_choice_none_only_reasoning_is_split() -> None:
    make = chat_parser_factory("hermes", "qwen3", enable_auto_tool_choice=True)
    for req in (request(), request(tools=TOOLS, tool_choice="none")):
        result = at_once(make, req, HERMES)
        assert result["reasoning"] == "plan" and result["calls"] == [] and "<tool_call>" in result["content"]
    plain = chat_parser_factory(None, None, enable_auto_tool_choice=False)
    assert plain(request()).final(HERMES).content == HERMES


@pytest.mark.parametrize("choice, tools, message", [
    ("auto", TOOLS, "--enable-auto-tool-choice"), ("required", None, '"required" needs tools'),
    ({"type": "function", "function": {"name": "nope"}}, TOOLS, "not in tools"),
    ({"type": "function", "function": {"name": "add"}}, None, "not in tools"),
    ({"type": "function"}, TOOLS, "tool_choice must be"),
])
def test_tool_choice_errors_name_the_field(choice: object, tools: list | None, message: str) -> None:
    make = chat_parser_factory("qwen3_coder", None, enable_auto_tool_choice=choice != "auto")
    with pytest.raises(UnsupportedError, match=message) as err:
        make(request(tools=tools, tool_choice=choice))
    assert err.value.param == "tool_choice"


REQUIRED = '[{"name": "add", "parameters": {"a": 2, "b": 3.5, "note": "\u00e9 x"}}, {"name": "now", "parameters": {}}]'


@pytest.mark.parametrize(("choice", "text", "calls", "finish"), [
    ("required", REQUIRED, [("add", {"a": 2, "b": 3.5, "note": "é x"}), ("now", {})], "tool_calls"),
    ({"type": "function", "function": {"name": "add"}}, '{"a": 1, "b": 2}', [("add", {"a": 1, "b": 2})], "stop"),
    ("required", '[{"name": "add", "param', [], "stop"),  # cut short: it stays content
])
def test_forced_tool_calls_stream_as_they_return(choice: object, text: str, calls: list, finish: str) -> None:
    """tool_choice "required" / named (whatever the server's flags): the constrained JSON becomes the calls, with
    ids call_0, call_1, ...; any cut of the text streams the same calls; finish_reason as vLLM's."""
    for flags in (("qwen3_coder", "qwen3", True), (None, None, False)):
        make = chat_parser_factory(*flags)
        req = request(tools=TOOLS, tool_choice=choice)
        expected = at_once(make, req, text)
        assert [(c["id"], c["name"], json.loads(c["arguments"])) for c in expected["calls"]] == \
            [(f"call_{i}", name, args) for i, (name, args) in enumerate(calls)]
        assert expected["finish"] == finish and expected["content"] == (None if calls else text)
        assert make(req).structured_outputs.json["type"] == ("array" if choice == "required" else "object")
        for size in range(1, 9):
            assert streamed(make, req, text, list(range(size, len(text), size))) == expected


def test_bad_server_flags_are_named() -> None:
    with pytest.raises(ValueError, match="--tool-call-parser must be one of"):
        chat_parser_factory("pythonic", None, True)
    with pytest.raises(ValueError, match="--reasoning-parser must be one of"):
        chat_parser_factory(None, "deepseek", False)
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        chat_parser_factory(None, None, True)
