"""tools and tool_choice at batch creation: function definitions checked like response_format's schema, forced
choices accepted, "auto" and the deprecated fields refused as unsupported_value, errors naming the field."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sluice.api.batch_lines import CHAT_URL, BatchRequest, LineError, parse_line
from sluice.api.response_format import MAX_SCHEMA_CHARS
from sluice.api.tools import MAX_TOOLS

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}}
PING = {"type": "function", "function": {"name": "ping"}}
NAMED = {"type": "function", "function": {"name": "ping"}}


def chat_line(messages=None, **body) -> str:
    return json.dumps({"custom_id": "c", "method": "POST", "url": CHAT_URL,
                       "body": {"messages": messages or [{"role": "user", "content": "hi"}], **body}})


def function(name: str, **fields) -> dict:
    return {"type": "function", "function": {"name": name, **fields}}


@pytest.mark.parametrize("body", [
    dict(tools=[WEATHER, PING], tool_choice="required"),
    dict(tools=[WEATHER, PING], tool_choice=NAMED, parallel_tool_calls=False),
    dict(tools=[WEATHER], tool_choice="required", parallel_tool_calls=True, response_format={"type": "text"}),
    dict(tools=[WEATHER], tool_choice="none"),
    dict(tool_choice="none"),
    dict(tools=[function(f"f{i}") for i in range(MAX_TOOLS)], tool_choice="required"),
    dict(tools=[function("a-B_9", parameters={"type": "object"}, strict=False, description="d")],
         tool_choice="required"),
])
def test_forced_and_none_choices_are_accepted(body):
    assert isinstance(parse_line(chat_line(**body), 1), BatchRequest)


@pytest.mark.parametrize("body, code, param, message", [
    (dict(tools=[WEATHER]), "unsupported_value", "body.tool_choice", 'means "auto", which is not supported'),
    (dict(tools=[WEATHER], tool_choice="auto"), "unsupported_value", "body.tool_choice",
     '"none", "required" or {"type": "function"'),
    (dict(tools=[WEATHER], tool_choice={"type": "allowed_tools", "allowed_tools": {}}), "unsupported_value",
     "body.tool_choice", "is not supported"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_time"}}), "invalid_value",
     "body.tool_choice", "names the function 'get_time', which is not in tools"),
    (dict(tool_choice="required"), "invalid_value", "body.tool_choice", "a forced tool_choice needs tools"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather", "x": 1}}),
     "invalid_value", "body.tool_choice", "nothing else"),
    (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "unsupported_value",
     "body.tool_choice", "cannot also follow response_format"),
    (dict(tools=[WEATHER, WEATHER], tool_choice="none"), "invalid_value", "body.tools",
     "tools[1].function.name 'get_weather' is used by an earlier tool"),
    (dict(tools=[function("a b")], tool_choice="none"), "invalid_value", "body.tools",
     "tools[0].function.name is required: 1 to 64"),
    (dict(tools=[function("x" * 65)], tool_choice="none"), "invalid_value", "body.tools", "1 to 64"),
    (dict(tools=[{"type": "custom", "custom": {"name": "x"}}], tool_choice="none"), "invalid_value", "body.tools",
     "only function tools"),
    (dict(tools=[function("f", parameters={"type": "objekt"})], tool_choice="none"), "invalid_value",
     "body.tools", "tools[0].function.parameters is not a valid JSON schema at type"),
    (dict(tools=[function("f", parameters=[])], tool_choice="none"), "invalid_value", "body.tools",
     "tools[0].function.parameters must be a JSON object"),
    (dict(tools=[function("f", params={})], tool_choice="none"), "invalid_value", "body.tools",
     "unknown fields ['params']"),
    (dict(tools=[function(f"f{i}") for i in range(MAX_TOOLS + 1)], tool_choice="none"), "invalid_value",
     "body.tools", f"the limit is {MAX_TOOLS}"),
    (dict(tools=[function(f"f{i}", parameters={"description": "x" * (MAX_SCHEMA_CHARS // 2)}) for i in range(2)],
          tool_choice="none"), "invalid_value", "body.tools", "together; the limit is"),
    (dict(functions=[WEATHER["function"]]), "unsupported_value", "body.functions", "use tools and tool_choice"),
    (dict(function_call="auto"), "unsupported_value", "body.function_call", "use tools and tool_choice"),
])
def test_bad_tools_and_choices_are_line_errors_naming_the_field(body, code, param, message):
    error = parse_line(chat_line(**body), 1)
    assert isinstance(error, LineError) and (error.code, error.param) == (code, param), error
    assert message in error.message, error.message


@pytest.mark.parametrize("message, param", [
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                                                            "function": {"name": "ping", "arguments": "{}"}}]},
     "body.messages.1.tool_calls"),
    ({"role": "tool", "tool_call_id": "call_1", "content": "pong"}, "body.messages.1.role"),
    ({"role": "function", "name": "ping", "content": "pong"}, "body.messages.1.role"),
])
def test_multi_turn_tool_messages_are_refused_as_unsupported(message, param):
    error = parse_line(chat_line([{"role": "user", "content": "hi"}, message], tools=[PING], tool_choice="none"), 1)
    assert isinstance(error, LineError) and (error.code, error.param) == ("unsupported_value", param), error


def test_the_api_checks_tools_without_torch_or_xgrammar():
    line = chat_line(tools=[WEATHER], tool_choice="required")
    code = (f"import sys; from sluice.api.batch_lines import parse_line; assert parse_line({line!r}, 1).custom_id == "
            "'c'; assert not {'torch', 'xgrammar'} & set(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)
