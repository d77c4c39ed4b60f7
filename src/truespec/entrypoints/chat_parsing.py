"""Tool calls and reasoning in chat responses (``--tool-call-parser``, ``--reasoning-parser``,
``--enable-auto-tool-choice``): the parsers of tool_parsers.py / reasoning_parser.py behind the server's
``ChatOutputParser`` hook.

Streamed and non-streamed responses run the same state machine over the same text (``ReasoningToolStream``), so
they carry the same content, reasoning and ``tool_calls`` however a speculative step cut the text into deltas.
``tool_choice``: "none" turns tool parsing off for the request; "auto" (or unset, with tools) parses calls and needs
``--enable-auto-tool-choice``; "required" and a named function constrain the output to the calls' JSON
(forced_tool_calls.py, whatever the flags); a named function that is not among ``tools``, or either without
``tools``, is a 400 naming ``tool_choice``.
"""

from collections.abc import Callable

from truespec.entrypoints.forced_tool_calls import ForcedToolCalls, tool_name
from truespec.entrypoints.openai_protocol import ChatCompletionRequest, DeltaMessage, UnsupportedError
from truespec.entrypoints.openai_serving import ChatOutputParser
from truespec.entrypoints.reasoning_parser import REASONING_PARSERS, ReasoningToolStream
from truespec.entrypoints.tool_calls import Delta, finish_reason
from truespec.entrypoints.tool_parsers import TOOL_PARSERS


class ParsedChatOutput(ChatOutputParser):
    """One request's content / reasoning / tool-call split, streamed or at once."""

    def __init__(self, stream: ReasoningToolStream) -> None:
        self.stream = stream

    def delta(self, text: str, is_last: bool = False) -> DeltaMessage | None:
        deltas = self.stream.feed(text) if text else []
        if is_last:
            deltas += self.stream.finish()
        return _message(deltas)

    def final(self, text: str) -> DeltaMessage:
        message = self.delta(text, is_last=True) or DeltaMessage()
        message.role = "assistant"
        if message.content is None and not message.tool_calls:
            message.content = ""
        return message

    def finish_reason(self, reason: str | None) -> str | None:
        return finish_reason(self.stream.has_tool_calls, reason)


def chat_parser_factory(tool_call_parser: str | None, reasoning_parser: str | None,
                        enable_auto_tool_choice: bool) -> Callable[[ChatCompletionRequest], ChatOutputParser]:
    """The per-request parser the server's flags ask for (a ValueError names a bad flag)."""
    if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser must be one of {sorted(TOOL_PARSERS)}, got {tool_call_parser!r}")
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser must be one of {sorted(REASONING_PARSERS)}, got {reasoning_parser!r}")
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (qwen3_coder or hermes)")

    def make(req: ChatCompletionRequest) -> ChatOutputParser:
        choice = req.tool_choice
        if req.tools and (choice == "required" or isinstance(choice, dict)):
            name = None if choice == "required" else tool_name(choice, "tool_choice")
            return ForcedToolCalls(req.tools, name, req.parallel_tool_calls)
        tools = _checked_tools(req, tool_call_parser, enable_auto_tool_choice)
        if tools is None and reasoning_parser is None:
            return ChatOutputParser()
        reasoning = REASONING_PARSERS[reasoning_parser]() if reasoning_parser is not None else None
        tool = TOOL_PARSERS[tool_call_parser]() if tools is not None else None
        return ParsedChatOutput(ReasoningToolStream(reasoning, tool, tools or None))

    return make


def _checked_tools(req: ChatCompletionRequest, tool_call_parser: str | None,
                   enable_auto_tool_choice: bool) -> list[dict] | None:
    """The tools to parse calls of (None: no tool parsing), or a 400 naming ``tool_choice``."""
    choice, tools = req.tool_choice, req.tools
    for tool in tools or []:
        tool_name(tool)
    if isinstance(choice, dict):  # without tools (with them, ForcedToolCalls took it)
        raise UnsupportedError("tool_choice", f"tool_choice names function {tool_name(choice, 'tool_choice')!r}, "
                                              "which is not in tools")
    if choice == "required":
        raise UnsupportedError("tool_choice", 'tool_choice "required" needs tools')
    if not tools or choice == "none":
        return None
    if choice not in (None, "auto"):
        raise UnsupportedError("tool_choice", f'tool_choice must be "auto", "none", "required" or a named function, '
                                              f"got {choice!r}")
    if not enable_auto_tool_choice:
        raise UnsupportedError("tool_choice", '"auto" tool choice needs the server started with '
                                              "--enable-auto-tool-choice and --tool-call-parser")
    return tools


def _message(deltas: list[Delta]) -> DeltaMessage | None:
    """Several parser deltas as one OpenAI delta (content and reasoning concatenated, calls in order)."""
    content = "".join(d.content for d in deltas if d.content)
    reasoning = "".join(d.reasoning for d in deltas if d.reasoning)
    calls = [{"index": d.tool_call.index, "id": d.tool_call.id, "type": "function",
              "function": {"name": d.tool_call.name, "arguments": d.tool_call.arguments}}
             for d in deltas if d.tool_call is not None]
    if not (content or reasoning or calls):
        return None
    return DeltaMessage(content=content or None, reasoning=reasoning or None, reasoning_content=reasoning or None,
                        tool_calls=calls or None)
