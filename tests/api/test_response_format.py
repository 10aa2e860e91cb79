"""response_format at batch creation: the three types accepted, malformed ones an invalid_value line naming it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sluice.api.batch_lines import CHAT_URL, BatchRequest, LineError, parse_line
from sluice.api.response_format import MAX_SCHEMA_CHARS

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def chat_line(response_format) -> str:
    return json.dumps({"custom_id": "c", "method": "POST", "url": CHAT_URL,
                       "body": {"messages": [{"role": "user", "content": "hi"}], "response_format": response_format}})


@pytest.mark.parametrize("fmt", [
    {"type": "text"}, {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}},
    {"type": "json_schema", "json_schema": {"name": "t-1", "schema": SCHEMA, "strict": False, "description": "d"}},
    {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "object"}, "strict": True}},
    {"type": "json_schema", "json_schema": {"name": "no_schema"}},
])
def test_structured_formats_are_accepted(fmt):
    assert isinstance(parse_line(chat_line(fmt), 1), BatchRequest)


@pytest.mark.parametrize("fmt, message", [
    ({"type": "xml"}, 'type must be "text", "json_object" or "json_schema"'),
    ({"type": "json_object", "schema": SCHEMA}, "takes no other field"),
    ({"type": "json_schema"}, 'takes one other field, "json_schema"'),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "json_schema.name is required"),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}}, "json_schema.name is required"),
    ({"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "extra": 1}}, "unknown fields ['extra']"),
    ({"type": "json_schema", "json_schema": {"name": "t", "schema": [SCHEMA]}}, "must be a JSON object"),
    ({"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": "yes"}}, "strict must be"),
    ({"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "objekt"}}},
     "not a valid JSON schema at type: 'objekt' is not valid"),
    ({"type": "json_schema", "json_schema": {"name": "t", "schema": {"properties": {"a": {"minimum": "0"}}}}},
     "at properties/a/minimum"),
    ({"type": "json_schema", "json_schema": {"name": "t", "schema": {"description": "x" * MAX_SCHEMA_CHARS}}},
     f"the limit is {MAX_SCHEMA_CHARS}"),
])
def test_malformed_formats_are_an_invalid_value_naming_response_format(fmt, message):
    error = parse_line(chat_line(fmt), 1)
    assert isinstance(error, LineError) and (error.code, error.param) == ("invalid_value", "body.response_format")
    assert message in error.message, error.message


def test_the_api_checks_schemas_without_torch_or_xgrammar():
    line = chat_line({"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}})
    code = (f"import sys; from sluice.api.batch_lines import parse_line; assert parse_line({line!r}, 1).custom_id == "
            "'c'; assert not {'torch', 'xgrammar'} & set(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)
