"""tools and tool_choice (OpenAI's function calling), checked at batch creation and read by the worker.

sluice honours tool_choice "none" (the tools are rendered, the model answers in text), "required" and a named
function: for those two the output is forced, by a grammar, to be one call of a listed function (worker/tool_calls.py).
"auto" is refused: deciding between text and a call would need each model family's own call syntax parsed.
"""

from __future__ import annotations

import json
from typing import Any

from sluice.api.response_format import MAX_SCHEMA_CHARS, NAME, check_json_schema

MAX_TOOLS = 128  # as OpenAI
SUPPORTED_CHOICES = '"none", "required" or {"type": "function", "function": {"name": "..."}}'
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


class UnsupportedChoice(ValueError):
    """A tool_choice OpenAI documents that sluice cannot honour ("auto", allowed_tools, custom tools)."""


def check_tools(tools: list[Any]) -> None:
    """Raise ValueError naming the first problem with the function definitions."""
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"{len(tools)} tools; the limit is {MAX_TOOLS}")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not (isinstance(tool, dict) and tool.get("type") == "function"):
            raise ValueError(f'{where}: only function tools ({{"type": "function", "function": {{...}}}}) are '
                             "supported")
        if tool.keys() != {"type", "function"} or not isinstance(tool["function"], dict):
            raise ValueError(f'{where}: a tool takes "type" and a "function" object, nothing else')
        function = tool["function"]
        if unknown := function.keys() - _FUNCTION_KEYS:
            raise ValueError(f"{where}.function has unknown fields {sorted(unknown)}; it takes "
                             f"{sorted(_FUNCTION_KEYS)}")
        name = function.get("name")
        if not (isinstance(name, str) and NAME.fullmatch(name)):
            raise ValueError(f"{where}.function.name is required: 1 to 64 letters, digits, '_' or '-'")
        if name in names:
            raise ValueError(f"{where}.function.name {name!r} is used by an earlier tool; names must be unique")
        names.add(name)
        if not isinstance(function.get("description", ""), str | None) or not isinstance(
                function.get("strict", False), bool | None):
            raise ValueError(f"{where}.function.description must be a string and .strict a boolean")
        if function.get("parameters") is not None:
            check_json_schema(function["parameters"], f"{where}.function.parameters")
    # every forced call's grammar holds all the schemas at once: the engine's limit applies to their sum
    size = sum(len(json.dumps(parameters(t), ensure_ascii=False, separators=(",", ":"))) for t in tools)
    if size > MAX_SCHEMA_CHARS:
        raise ValueError(f"the tools' parameters schemas are {size} characters together; the limit is "
                         f"{MAX_SCHEMA_CHARS}")


def parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters schema; OpenAI reads none as a function without parameters."""
    given = tool["function"].get("parameters")
    return given if given is not None else {"type": "object", "properties": {}, "additionalProperties": False}


def forced_tools(tool_choice: str | dict[str, Any] | None, tools: list[dict[str, Any]] | None) -> list[dict] | None:
    """The tools one of which the output must call, or None when the model answers in text. Raises
    UnsupportedChoice for a choice sluice cannot honour and ValueError for one that cannot be honoured at all."""
    if tool_choice is None:
        if tools:  # OpenAI's default with tools is "auto"
            raise UnsupportedChoice(f'tools without tool_choice means "auto", which is not supported: set tool_choice '
                                    f"to {SUPPORTED_CHOICES}")
        return None
    if tool_choice == "none":
        return None
    if tool_choice == "required":
        named = None
    elif (isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
          and isinstance(tool_choice.get("function"), dict)):
        if tool_choice.keys() != {"type", "function"} or tool_choice["function"].keys() != {"name"}:
            raise ValueError('a named tool_choice is {"type": "function", "function": {"name": "..."}}, nothing else')
        named = tool_choice["function"]["name"]
    else:
        raise UnsupportedChoice(f"{json.dumps(tool_choice)} is not supported; tool_choice must be {SUPPORTED_CHOICES}")
    if not tools:
        raise ValueError("a forced tool_choice needs tools")
    if named is None:
        return tools
    chosen = [t for t in tools if t["function"]["name"] == named]
    if not chosen:
        raise ValueError(f"names the function {named!r}, which is not in tools")
    return chosen
