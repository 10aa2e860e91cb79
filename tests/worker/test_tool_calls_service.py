"""Forced tool calls through the whole service with the openai SDK: a live API, a GPU worker process, PostgreSQL and
Redis; the output lines read as the SDK's ChatCompletion, whose message.tool_calls carry a listed function and
arguments valid against its parameters."""

from __future__ import annotations

import json

import jsonschema
from openai.types.chat import ChatCompletion
from sdk_batches import chat_line, run_batch

LOOKUP = {"type": "object", "properties": {"sku": {"type": "integer", "minimum": 1, "maximum": 99},
                                           "color": {"enum": ["red", "blue"]}},
          "required": ["sku", "color"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": LOOKUP}},
         {"type": "function", "function": {"name": "ping"}}]


def line(custom_id: str, **body) -> dict:
    return chat_line(custom_id, f"Find {custom_id}", **body)


def test_forced_tool_calls_through_the_service(cluster):
    lines = [line("plain", max_tokens=5),
             line("named", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "lookup"}}),
             line("required", tools=TOOLS, tool_choice="required", temperature=1.0, seed=5),
             line("auto", tools=TOOLS)]
    ran = run_batch(cluster, lines)
    assert (ran.batch.request_counts.completed, ran.batch.request_counts.failed) == (3, 1), ran.batch
    outputs = {k: ChatCompletion.model_validate(body).choices[0] for k, body in ran.outputs.items()}
    errors = ran.errors
    assert outputs["plain"].message.tool_calls is None
    for custom_id in ("named", "required"):
        choice = outputs[custom_id]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        call = choice.message.tool_calls[0]
        arguments = json.loads(call.function.arguments)
        if custom_id == "named" or call.function.name == "lookup":
            assert call.function.name == "lookup"
            jsonschema.validate(arguments, LOOKUP)
        else:
            assert (call.function.name, arguments) == ("ping", {})
    assert (errors["auto"]["code"], errors["auto"]["param"]) == ("unsupported_value", "body.tool_choice")
