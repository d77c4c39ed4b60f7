"""The constraint a request puts on its output, as the engine's ``StructuredOutputsParams`` (vLLM's fields):
OpenAI's ``response_format`` ({"type": "json_schema", "json_schema": {"schema": ...}} or {"type": "json_object"}),
vLLM's ``structured_outputs`` field (``json`` / ``regex`` / ``choice`` / ``grammar`` / ``json_object``), or the
JSON a forced tool call needs (``tool_choice`` "required" or a named function: forced_tool_calls.py). At most one
of them; each is a 400 naming its field when it is malformed or does not compile."""

from dataclasses import replace
from typing import Any

from truespec.engine.llm_engine import LLMEngine
from truespec.entrypoints.openai_protocol import SamplingRequest, UnsupportedError
from truespec.sampling_params import SamplingParams, StructuredOutputsParams


def constrained_params(params: SamplingParams, req: SamplingRequest,
                       tool_calls: StructuredOutputsParams | None = None) -> tuple[SamplingParams, str | None]:
    """``params`` with the request's constraint, and the request field that set it (None: unconstrained)."""
    given = {name: value for name, value in (("response_format", response_format_params(req.response_format)),
                                              ("structured_outputs", _own_params(req.structured_outputs)),
                                              ("tool_choice", tool_calls)) if value is not None}
    if len(given) > 1:
        raise UnsupportedError(sorted(given)[0], f"only one of {sorted(given)} may constrain the output")
    if not given:
        return params, None
    ((field, constraint),) = given.items()
    return replace(params, structured_outputs=constraint), field


def check_constraint(engine: LLMEngine, params: SamplingParams, field: str) -> None:
    """On the engine thread: compile the constraint (cached for the request itself); a 400 naming ``field`` if it
    does not compile (a tool's parameters schema: ``tools``)."""
    try:
        engine.structured_outputs.check(params)
    except ValueError as e:
        raise UnsupportedError("tools" if field == "tool_choice" else field, str(e)) from None


def response_format_params(response_format: dict[str, Any] | None) -> StructuredOutputsParams | None:
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    json_schema = response_format.get("json_schema")
    schema = json_schema.get("schema") if isinstance(json_schema, dict) else None
    if kind == "json_schema" and isinstance(schema, dict):
        return StructuredOutputsParams(json=schema)
    raise UnsupportedError("response_format", 'response_format must be {"type": "text"}, {"type": "json_object"} or '
                                              '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}, '
                                              f"got {response_format!r}"[:300])


def _own_params(fields: dict[str, Any] | None) -> StructuredOutputsParams | None:
    if fields is None:
        return None
    try:
        return StructuredOutputsParams(**fields)
    except (TypeError, ValueError) as e:  # an unknown key, two constraints, a wrong type
        raise UnsupportedError("structured_outputs", f"structured_outputs: {e}"[:500]) from None
