"""`sluice run` with response_format: json_schema and json_object lines give JSON content, a schema that does not
compile is an error line naming response_format, and plain lines run beside them."""

from __future__ import annotations

import json

import jsonschema

from sluice.api.batch_lines import CHAT_URL
from sluice.worker.cli import main

SCHEMA = {"type": "object", "properties": {"label": {"enum": ["spam", "ham"]},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 10}},
          "required": ["label", "score"], "additionalProperties": False}


def chat(custom_id: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": CHAT_URL,
            "body": {"model": "m", "messages": [{"role": "user", "content": f"Classify {custom_id}"}], **body}}


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema, "strict": True}}


def test_mixed_lines(tmp_path, llama_dir):
    lines = [chat("plain", max_tokens=5),
             *[chat(f"schema{i}", max_tokens=60, temperature=i / 4, seed=i, response_format=json_schema(SCHEMA))
               for i in range(4)],
             chat("object", max_tokens=60, temperature=0, response_format={"type": "json_object"}),
             chat("text", max_tokens=5, response_format={"type": "text"}),
             chat("bad", max_tokens=5, response_format=json_schema({"type": "object", "properties": {
                 "a": {"$ref": "#/$defs/nowhere"}}})),
             chat("malformed", response_format=json_schema({"type": 12}))]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["run", str(source), "-o", str(out), "--model", str(llama_dir)]) == 1
    bodies = {r["custom_id"]: r["response"]["body"] for r in map(json.loads, out.read_text().splitlines())}
    assert set(bodies) == {"plain", "schema0", "schema1", "schema2", "schema3", "object", "text"}
    for i in range(4):
        choice = bodies[f"schema{i}"]["choices"][0]
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    obj = bodies["object"]["choices"][0]
    assert obj["message"]["content"].startswith("{")
    if obj["finish_reason"] == "stop":
        assert isinstance(json.loads(obj["message"]["content"]), dict)
    errors = {e["custom_id"]: e["error"] for e in map(json.loads, (tmp_path / "out.errors.jsonl").read_text()
                                                      .splitlines())}
    assert errors["bad"]["code"] == "invalid_value" and errors["bad"]["param"] == "body.response_format"
    assert errors["bad"]["message"].startswith("line 8: body.response_format: the grammar could not be compiled: ")
    assert "nowhere" in errors["bad"]["message"]
    assert errors["malformed"]["param"] == "body.response_format" and "not a valid JSON schema" in \
        errors["malformed"]["message"]
