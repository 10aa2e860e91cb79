"""Structured outputs through the whole service with the openai SDK: a live API, a GPU worker process, PostgreSQL
and Redis; mixed lines (plain, json_schema, json_object, a schema that does not compile, a malformed one)."""

from __future__ import annotations

import json
import time

import jsonschema
import openai
from servers import serve_app

from sluice.api import store
from sluice.api.server import create_app
from sluice.api.settings import Settings

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                           "confidence": {"type": "integer", "minimum": 1, "maximum": 5}},
          "required": ["answer", "confidence"], "additionalProperties": False}


def line(custom_id: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": f"Is {custom_id} simple?"}],
                     "max_tokens": 60, "temperature": 0, **body}}


def json_schema(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_structured_outputs_through_the_service(cluster):
    with cluster.sessions.begin() as session:
        _, key = store.create_api_key(session, store.get_or_create_tenant(session, "acme").id)
    lines = [line("plain", max_tokens=5), line("schema", response_format=json_schema(SCHEMA)),
             line("sampled", temperature=1.0, seed=3, response_format=json_schema(SCHEMA)),
             line("object", response_format={"type": "json_object"}),
             line("bad", response_format=json_schema({"properties": {"a": {"$ref": "#/$defs/nowhere"}}})),
             line("malformed", response_format=json_schema({"type": "objekt"}))]
    with serve_app(create_app(cluster.sessions, cluster.app, Settings(models=("tiny",)))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        cluster.start_worker("--max-num-seqs", "4")
        data = "".join(json.dumps(x) + "\n" for x in lines).encode()
        file_id = client.files.create(file=("input.jsonl", data), purpose="batch").id
        batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.time() + 120
        while (batch := client.batches.retrieve(batch.id)).status != "completed" and time.time() < deadline:
            time.sleep(0.25)
        assert (batch.request_counts.completed, batch.request_counts.failed) == (4, 2), batch
        outputs = {o["custom_id"]: o["response"]["body"]["choices"][0] for o in
                   map(json.loads, client.files.content(batch.output_file_id).text.splitlines())}
        errors = {e["custom_id"]: e["error"] for e in
                  map(json.loads, client.files.content(batch.error_file_id).text.splitlines())}
    for name in ("schema", "sampled"):
        assert outputs[name]["finish_reason"] == "stop"
        jsonschema.validate(json.loads(outputs[name]["message"]["content"]), SCHEMA)
    assert outputs["object"]["message"]["content"].startswith("{")
    assert (errors["bad"]["code"], errors["bad"]["param"]) == ("invalid_value", "body.response_format")
    assert "the grammar could not be compiled" in errors["bad"]["message"] and "nowhere" in errors["bad"]["message"]
    assert errors["malformed"]["param"] == "body.response_format"
    assert "not a valid JSON schema" in errors["malformed"]["message"]
