"""``tool_choice`` "required" and a named function, as vLLM serves them: the output is constrained to JSON (a
structured outputs JSON schema built from ``tools``) and that JSON becomes the message's ``tool_calls`` directly,
with no tool-call markup and no tool-call parser.

- Named (``{"type": "function", "function": {"name": N}}``): the output is N's arguments, a JSON object following
  N's ``parameters`` schema: one call. ``finish_reason`` is the engine's ("stop"), as vLLM and OpenAI give for a
  named call.
- "required": the output is a JSON array of at least one ``{"name": <a tool's name>, "parameters": <its
  arguments>}`` (exactly one with ``parallel_tool_calls: false``): one call per item, its arguments
  re-serialised. ``finish_reason`` "tool_calls" when it stopped.
``content`` is "". Streaming: a named call's arguments stream as they are generated (its first delta carries the
call's id and name); the calls of "required" go out once the array is complete, with the request's last output.
Call i's id is ``call_i`` either way, so the streamed calls add up to the non-streamed ones. A named call's
arguments are the text as generated; a "required" output that is not the expected array (cut short by
``max_tokens`` or a stop string) stays ``content``. No reasoning is split off: the grammar holds the output to the
calls' JSON from its first token.
"""

import copy
import json
from typing import Any

from truespec.entrypoints.openai_protocol import DeltaMessage, UnsupportedError
from truespec.entrypoints.openai_serving import ChatOutputParser
from truespec.sampling_params import StructuredOutputsParams

NO_PARAMETERS = {"type": "object", "properties": {}}  # a tool without a parameters schema takes an empty object


class ForcedToolCalls(ChatOutputParser):
    def __init__(self, tools: list[dict[str, Any]], name: str | None, parallel_tool_calls: bool = True) -> None:
        """``name``: the named function (checked to be one of ``tools``); None: "required"."""
        self.name = name
        schema = tool_calls_schema(tools, name, max_calls=None if parallel_tool_calls else 1)
        self.structured_outputs = StructuredOutputsParams(json=schema)
        self.text = ""
        self.num_calls = 0  # calls handed out so far

    def delta(self, text: str, is_last: bool = False) -> DeltaMessage | None:
        first, self.text = not self.text, self.text + text
        if self.name is not None:  # the arguments as they come; the first delta opens the call
            if not text and not (is_last and first):
                return None
            if first:
                self.num_calls = 1
            return DeltaMessage(tool_calls=[{"index": 0, "id": "call_0" if first else None, "type": "function",
                                             "function": {"name": self.name if first else None, "arguments": text}}])
        if not is_last:
            return None
        calls = self._calls()
        if calls is None:
            return DeltaMessage(content=self.text) if self.text else None
        return DeltaMessage(tool_calls=[{"index": i} | call for i, call in enumerate(calls)])

    def final(self, text: str) -> DeltaMessage:
        self.text = text
        calls = [_call(0, self.name, text)] if self.name is not None else self._calls()
        self.num_calls = len(calls or [])
        if calls is None:
            return DeltaMessage(role="assistant", content=text)
        return DeltaMessage(role="assistant", content="", tool_calls=calls)

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.name is None and self.num_calls and reason == "stop" else reason

    def _calls(self) -> list[dict[str, Any]] | None:
        """The calls of a complete "required" array; None if the text is not one."""
        try:
            items = json.loads(self.text)
        except ValueError:
            return None
        if not isinstance(items, list) or not items or not all(
                isinstance(i, dict) and isinstance(i.get("name"), str) and "parameters" in i for i in items):
            return None
        self.num_calls = len(items)
        return [_call(i, item["name"], json.dumps(item["parameters"], ensure_ascii=False))
                for i, item in enumerate(items)]


def _call(index: int, name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{index}", "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_calls_schema(tools: list[dict[str, Any]], name: str | None, max_calls: int | None = None) -> dict[str, Any]:
    """The JSON schema of a named call's arguments (``name``), or of the "required" array (``name`` None): 1 ..
    ``max_calls`` items ``{"name": <tool>, "parameters": <its schema>}``, any of the tools, with every tool's
    ``$defs`` moved to the root where their ``#/$defs/...`` references point (vLLM's schema)."""
    schemas = {tool_name(t): _parameters(t) for t in tools}
    if name is not None:
        if name not in schemas:
            raise UnsupportedError("tool_choice", f"tool_choice names function {name!r}, which is not in tools")
        return schemas[name]
    defs: dict[str, Any] = {}
    items = []
    for tool, parameters in schemas.items():
        parameters = copy.deepcopy(parameters)
        for key, value in (parameters.pop("$defs", None) or {}).items():
            if defs.setdefault(key, value) != value:
                raise UnsupportedError("tools", f"tools define $defs {key!r} twice, differently")
        items.append({"properties": {"name": {"type": "string", "enum": [tool]}, "parameters": parameters},
                      "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    return schema | ({"maxItems": max_calls} if max_calls else {}) | ({"$defs": defs} if defs else {})


def tool_name(tool: object, field: str = "tools") -> str:
    """The ``function.name`` of a tool or a named tool_choice; a 400 naming ``field`` if it has none."""
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise UnsupportedError(field, f'{field} must be {{"type": "function", "function": {{"name": ...}}}}, '
                                      f"got {tool!r}"[:300])
    return function["name"]


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    parameters = tool["function"].get("parameters")
    if parameters is None:
        return dict(NO_PARAMETERS)
    if not isinstance(parameters, dict):
        raise UnsupportedError("tools", f"a tool's parameters must be a JSON schema object, got {parameters!r}"[:300])
    return parameters
