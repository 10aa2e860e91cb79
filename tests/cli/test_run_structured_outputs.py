"""`sluice run` with response_format: json_schema and json_object lines give JSON content, a schema that does not
compile is an error line naming response_format, and plain lines run beside them."""

from __future__ import annotations

import json
import re

import jsonschema

from sluice.api.batch_lines import CHAT_URL, COMPLETIONS_URL
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


def completion(custom_id: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": COMPLETIONS_URL,
            "body": {"model": "m", "prompt": f"Label {custom_id}:", "max_tokens": 40, **body}}


def test_guided_completions_and_n_choices_under_a_schema(tmp_path, llama_dir):
    """vLLM's guided_json / guided_regex / guided_choice on /v1/completions, and n=3 under a json_schema: every
    choice its own valid JSON."""
    lines = [completion("json", guided_json=SCHEMA, temperature=0.8, seed=1),
             completion("json_text", guided_json=json.dumps(SCHEMA), temperature=0),
             completion("regex", guided_regex="[A-Z]{2}-[0-9]{3}", temperature=1.0, seed=2),
             completion("choice", guided_choice=["alpha", "beta", "gamma"], temperature=1.0, seed=3, n=4),
             completion("bad_regex", guided_regex="(unclosed"),
             completion("two", guided_regex="a+", guided_choice=["a"]),
             chat("n3", max_tokens=60, n=3, temperature=1.0, seed=4, response_format=json_schema(SCHEMA))]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["run", str(source), "-o", str(out), "--model", str(llama_dir)]) == 1
    bodies = {r["custom_id"]: r["response"]["body"] for r in map(json.loads, out.read_text().splitlines())}
    for name in ("json", "json_text"):
        jsonschema.validate(json.loads(bodies[name]["choices"][0]["text"]), SCHEMA)
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", bodies["regex"]["choices"][0]["text"])
    assert [c["text"] in ("alpha", "beta", "gamma") for c in bodies["choice"]["choices"]] == [True] * 4
    choices = bodies["n3"]["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2] and all(c["finish_reason"] == "stop" for c in choices)
    for c in choices:
        jsonschema.validate(json.loads(c["message"]["content"]), SCHEMA)
    errors = {e["custom_id"]: e["error"] for e in map(json.loads, (tmp_path / "out.errors.jsonl").read_text()
                                                      .splitlines())}
    assert set(errors) == {"bad_regex", "two"}
    assert errors["bad_regex"]["param"] == "body.guided_regex"
    assert "the grammar could not be compiled" in errors["bad_regex"]["message"]
    assert errors["two"]["param"] == "body.guided_choice" and "at most one of guided_json" in errors["two"]["message"]
