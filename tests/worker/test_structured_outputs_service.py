"""Structured outputs through the whole service with the openai SDK: a live API, a GPU worker process, PostgreSQL
and Redis; mixed lines (plain, json_schema, json_object, a forced tool call, n=3 with and without a schema,
penalties, a schema that does not compile, a malformed one)."""

from __future__ import annotations

import json

import jsonschema
from openai.types.chat import ChatCompletion
from sdk_batches import chat_line, run_batch

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                           "confidence": {"type": "integer", "minimum": 1, "maximum": 5}},
          "required": ["answer", "confidence"], "additionalProperties": False}


TOOL = {"type": "function", "function": {"name": "grade", "parameters": SCHEMA}}


def line(custom_id: str, **body) -> dict:
    return chat_line(custom_id, f"Is {custom_id} simple?", **body)


def json_schema(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_structured_outputs_through_the_service(cluster):
    lines = [line("plain", max_tokens=5), line("schema", response_format=json_schema(SCHEMA)),
             line("sampled", temperature=1.0, seed=3, response_format=json_schema(SCHEMA)),
             line("object", response_format={"type": "json_object"}),
             chat_line("n3", "Is plain simple?", n=3, temperature=0.9, seed=5, max_tokens=6, ignore_eos=True),
             line("n3schema", n=3, temperature=1.0, seed=7, response_format=json_schema(SCHEMA)),
             line("tool", n=2, temperature=1.0, seed=2, tools=[TOOL], tool_choice="required"),
             line("penalties", presence_penalty=1.5, frequency_penalty=0.5, logit_bias={"7": -100}, max_tokens=8),
             line("bad", response_format=json_schema({"properties": {"a": {"$ref": "#/$defs/nowhere"}}})),
             line("malformed", response_format=json_schema({"type": "objekt"}))]
    ran = run_batch(cluster, lines)
    assert (ran.batch.request_counts.completed, ran.batch.request_counts.failed) == (8, 2), ran.batch
    outputs, errors = {k: body["choices"][0] for k, body in ran.outputs.items()}, ran.errors
    n3, n3schema = (ChatCompletion.model_validate(ran.outputs[k]) for k in ("n3", "n3schema"))
    assert [c.index for c in n3.choices] == [0, 1, 2] and len({c.message.content for c in n3.choices}) > 1
    # the prompt (the plain line's) counted once, the completion tokens over all three choices
    assert (n3.usage.prompt_tokens, n3.usage.completion_tokens) == (ran.outputs["plain"]["usage"]["prompt_tokens"], 18)
    for choice in n3schema.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    for choice in ChatCompletion.model_validate(ran.outputs["tool"]).choices:
        [call] = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and call.function.name == "grade"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    assert outputs["penalties"]["finish_reason"] in ("stop", "length")
    for name in ("schema", "sampled"):
        assert outputs[name]["finish_reason"] == "stop"
        jsonschema.validate(json.loads(outputs[name]["message"]["content"]), SCHEMA)
    assert outputs["object"]["message"]["content"].startswith("{")
    assert (errors["bad"]["code"], errors["bad"]["param"]) == ("invalid_value", "body.response_format")
    assert "the grammar could not be compiled" in errors["bad"]["message"] and "nowhere" in errors["bad"]["message"]
    assert errors["malformed"]["param"] == "body.response_format"
    assert "not a valid JSON schema" in errors["malformed"]["message"]
