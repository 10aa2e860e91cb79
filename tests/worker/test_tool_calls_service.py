"""Forced tool calls through the whole service with the openai SDK: a live API, a GPU worker process, PostgreSQL and
Redis; the output lines read as the SDK's ChatCompletion, whose message.tool_calls carry a listed function and
arguments valid against its parameters."""

from __future__ import annotations

import json
import time

import jsonschema
import openai
from openai.types.chat import ChatCompletion
from servers import serve_app

from sluice.api import store
from sluice.api.server import create_app
from sluice.api.settings import Settings

LOOKUP = {"type": "object", "properties": {"sku": {"type": "integer", "minimum": 1, "maximum": 99},
                                           "color": {"enum": ["red", "blue"]}},
          "required": ["sku", "color"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": LOOKUP}},
         {"type": "function", "function": {"name": "ping"}}]


def line(custom_id: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": f"Find {custom_id}"}],
                     "max_tokens": 60, "temperature": 0, **body}}


def test_forced_tool_calls_through_the_service(cluster):
    with cluster.sessions.begin() as session:
        _, key = store.create_api_key(session, store.get_or_create_tenant(session, "acme").id)
    lines = [line("plain", max_tokens=5),
             line("named", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "lookup"}}),
             line("required", tools=TOOLS, tool_choice="required", temperature=1.0, seed=5),
             line("auto", tools=TOOLS)]
    with serve_app(create_app(cluster.sessions, cluster.app, Settings(models=("tiny",)))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        cluster.start_worker("--max-num-seqs", "4")
        data = "".join(json.dumps(x) + "\n" for x in lines).encode()
        file_id = client.files.create(file=("input.jsonl", data), purpose="batch").id
        batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.time() + 120
        while (batch := client.batches.retrieve(batch.id)).status != "completed" and time.time() < deadline:
            time.sleep(0.25)
        assert (batch.request_counts.completed, batch.request_counts.failed) == (3, 1), batch
        outputs = {o["custom_id"]: ChatCompletion.model_validate(o["response"]["body"]).choices[0] for o in
                   map(json.loads, client.files.content(batch.output_file_id).text.splitlines())}
        errors = {e["custom_id"]: e["error"] for e in
                  map(json.loads, client.files.content(batch.error_file_id).text.splitlines())}
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
