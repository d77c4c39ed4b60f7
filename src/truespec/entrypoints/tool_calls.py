"""What tool-call and reasoning parsing produce: calls, streamed pieces, and the one-shot result they add up to
(tool_parsers.py, reasoning_parser.py; the server turns them into OpenAI's ``tool_calls`` and
``reasoning_content``)."""

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as OpenAI returns it


@dataclass(frozen=True)
class ToolCallDelta:
    index: int
    id: str | None = None  # set on a call's first delta only
    name: str | None = None  # set on a call's first delta only
    arguments: str = ""  # a fragment: a call's fragments concatenate to its ``ToolCall.arguments``


@dataclass(frozen=True)
class Delta:
    """One streamed piece: text for one channel, or a fragment of one tool call."""

    content: str | None = None
    reasoning: str | None = None
    tool_call: ToolCallDelta | None = None


@dataclass
class ToolCallResult:
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    reasoning: str | None = None  # filled only by the combined reasoning + tool parse

    @property
    def has_tool_calls(self) -> bool:
        return bool(self.tool_calls)


def finish_reason(has_tool_calls: bool, reason: str | None) -> str | None:
    """vLLM's rule: a response that called a tool finishes with ``"tool_calls"``, whatever stopped it."""
    return "tool_calls" if has_tool_calls else reason


def collect(deltas: Iterable[Delta]) -> ToolCallResult:
    """Concatenate streamed deltas into the non-streaming result (empty text -> None)."""
    content, reasoning, calls = [], [], {}
    for delta in deltas:
        content.append(delta.content or "")
        reasoning.append(delta.reasoning or "")
        if (part := delta.tool_call) is not None:
            call = calls.setdefault(part.index, ["", "", ""])
            call[0], call[1] = call[0] or part.id or "", call[1] or part.name or ""
            call[2] += part.arguments
    tool_calls = [ToolCall(*calls[index]) for index in sorted(calls)]
    return ToolCallResult("".join(content) or None, tool_calls, "".join(reasoning) or None)
