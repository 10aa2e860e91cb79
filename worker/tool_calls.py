"""Forced tool calls: the JSON schema a call must match, and the call read back out of the generated text.

A forced call (tool_choice "required" or a named function, api/tools.py) is generated as one JSON object,
{"name": <a listed function>, "arguments": <valid against its parameters>}, under the same grammar path as
response_format, and returned in OpenAI's `message.tool_calls` shape.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import replace
from typing import Any

from sluice.api.batch_lines import Body, ChatBody
from sluice.api.results import Generation
from sluice.api.tools import forced_tools, parameters


def forced(body: Body) -> list[dict[str, Any]] | None:
    """The tools a valid body's output must call one of; None when it answers in text."""
    return forced_tools(body.tool_choice, body.tools) if isinstance(body, ChatBody) else None


def call_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """One call of one of `tools`: "name" first, so the grammar fixes the function before its arguments."""
    calls = []
    for i, tool in enumerate(tools):
        base = "#/properties/arguments" if len(tools) == 1 else f"#/anyOf/{i}/properties/arguments"
        calls.append({"type": "object", "properties": {"name": {"const": tool["function"]["name"]},
                                                       "arguments": _rebased(parameters(tool), base)},
                      "required": ["name", "arguments"], "additionalProperties": False})
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


_VALUES = {"const", "enum", "default", "examples"}  # JSON data, not schemas: a "$ref" key there is not a reference


def _rebased(schema: Any, base: str) -> Any:
    """`schema` with its local references ("#/$defs/x", which point into the tool's own parameters) pointing to the
    same place from the call schema's root, where the parameters sit at `base`."""
    if isinstance(schema, list):
        return [_rebased(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    return {key: (base + value[1:] if key == "$ref" and isinstance(value, str) and value.startswith("#")
                  else value if key in _VALUES else _rebased(value, base)) for key, value in schema.items()}


def with_tool_calls(gen: Generation, body: Body) -> Generation:
    """The generation (each choice of an n > 1 one) as a tool call when its body forced one and the call's JSON was
    completed; otherwise as it is (max_tokens or a stop string cut the JSON: finish_reason "length" or "stop", the
    text as content, as OpenAI)."""
    if forced(body) is None:
        return gen
    if gen.choices:
        choices = [_as_call(c) for c in gen.choices]
        return replace(_as_call(gen), choices=choices)
    return _as_call(gen)


def _as_call(gen: Generation) -> Generation:
    if gen.finish_reason != "stop":
        return gen
    try:
        call = json.loads(gen.text)
    except ValueError:
        return gen
    if not (isinstance(call, dict) and isinstance(call.get("name"), str) and "arguments" in call):
        return gen
    arguments = json.dumps(call["arguments"], ensure_ascii=False, separators=(",", ":"))
    tool_call = {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                 "function": {"name": call["name"], "arguments": arguments}}
    return replace(gen, finish_reason="tool_calls", tool_calls=[tool_call])
