"""Structured outputs through the whole service with the openai SDK: a live API, a GPU worker process, PostgreSQL
and Redis; mixed lines (plain, json_schema, json_object, a schema that does not compile, a malformed one)."""

from __future__ import annotations

import json

import jsonschema
from sdk_batches import chat_line, run_batch

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                           "confidence": {"type": "integer", "minimum": 1, "maximum": 5}},
          "required": ["answer", "confidence"], "additionalProperties": False}


def line(custom_id: str, **body) -> dict:
    return chat_line(custom_id, f"Is {custom_id} simple?", **body)


def json_schema(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_structured_outputs_through_the_service(cluster):
    lines = [line("plain", max_tokens=5), line("schema", response_format=json_schema(SCHEMA)),
             line("sampled", temperature=1.0, seed=3, response_format=json_schema(SCHEMA)),
             line("object", response_format={"type": "json_object"}),
             line("bad", response_format=json_schema({"properties": {"a": {"$ref": "#/$defs/nowhere"}}})),
             line("malformed", response_format=json_schema({"type": "objekt"}))]
    ran = run_batch(cluster, lines)
    assert (ran.batch.request_counts.completed, ran.batch.request_counts.failed) == (4, 2), ran.batch
    outputs, errors = {k: body["choices"][0] for k, body in ran.outputs.items()}, ran.errors
    for name in ("schema", "sampled"):
        assert outputs[name]["finish_reason"] == "stop"
        jsonschema.validate(json.loads(outputs[name]["message"]["content"]), SCHEMA)
    assert outputs["object"]["message"]["content"].startswith("{")
    assert (errors["bad"]["code"], errors["bad"]["param"]) == ("invalid_value", "body.response_format")
    assert "the grammar could not be compiled" in errors["bad"]["message"] and "nowhere" in errors["bad"]["message"]
    assert errors["malformed"]["param"] == "body.response_format"
    assert "not a valid JSON schema" in errors["malformed"]["message"]
