"""`sluice run` with tools: forced calls (named and required, greedy and sampled) come back as message.tool_calls whose
name is listed and whose arguments validate against that tool's parameters; tool_choice "none" answers in text;
"auto", an unknown function and a cut call are handled as OpenAI's shapes say."""

from __future__ import annotations

import json

import jsonschema

from sluice.api.batch_lines import CHAT_URL
from sluice.worker.cli import main

# schemas a random model cannot loop in: enums, bounded integers, short strings, small arrays
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "set_volume", "strict": True, "parameters": {
        "type": "object", "properties": {"level": {"type": "integer", "minimum": 0, "maximum": 10},
                                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
        "required": ["level", "tags"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string", "maxLength": 8}}, "required": ["text"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "ping", "description": "no parameters"}},
    {"type": "function", "function": {"name": "paint", "parameters": {  # references into its own $defs
        "type": "object", "properties": {"color": {"$ref": "#/$defs/color"}}, "required": ["color"],
        "additionalProperties": False, "$defs": {"color": {"enum": ["red", "blue"]}}}}},
]
PARAMETERS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "additionalProperties": False})
              for t in TOOLS}


def chat(custom_id: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": CHAT_URL,
            "body": {"model": "m", "messages": [{"role": "user", "content": f"Call a tool for {custom_id}"}],
                     "tools": TOOLS, "max_tokens": 200} | body}


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def test_forced_tool_calls(tmp_path, llama_dir):
    lines = [*[chat(f"required{i}", tool_choice="required", temperature=i / 3, seed=i) for i in range(4)],
             *[chat(f"named_{t['function']['name']}", tool_choice=named(t["function"]["name"]), temperature=0,
                    parallel_tool_calls=False) for t in TOOLS],
             chat("none", tool_choice="none", max_tokens=5),
             chat("cut", tool_choice=named("get_weather"), max_tokens=3),
             chat("auto", tool_choice="auto"),
             chat("default"),
             chat("unknown", tool_choice=named("get_time")),
             chat("uncompiled", tool_choice="required", tools=[{"type": "function", "function": {
                 "name": "bad", "parameters": {"type": "object", "properties": {"a": {"$ref": "#/$defs/nowhere"}}}}}])]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["run", str(source), "-o", str(out), "--model", str(llama_dir)]) == 1
    bodies = {r["custom_id"]: r["response"]["body"] for r in map(json.loads, out.read_text().splitlines())}
    forced = [f"required{i}" for i in range(4)] + [f"named_{t['function']['name']}" for t in TOOLS]
    assert set(bodies) == {*forced, "none", "cut"}
    for custom_id in forced:
        choice = bodies[custom_id]["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        assert choice["message"]["content"] is None
        [call] = choice["message"]["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        name = call["function"]["name"]
        assert name in PARAMETERS
        if custom_id.startswith("named_"):
            assert name == custom_id.removeprefix("named_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMETERS[name])
        assert bodies[custom_id]["usage"]["completion_tokens"] > 0
    text = bodies["none"]["choices"][0]
    assert text["finish_reason"] in ("stop", "length") and isinstance(text["message"]["content"], str)
    assert "tool_calls" not in text["message"]
    cut = bodies["cut"]["choices"][0]
    assert cut["finish_reason"] == "length" and "tool_calls" not in cut["message"]
    assert cut["message"]["content"].startswith('{"')
    errors = {e["custom_id"]: e["error"] for e in map(json.loads, (tmp_path / "out.errors.jsonl").read_text()
                                                      .splitlines())}
    assert set(errors) == {"auto", "default", "unknown", "uncompiled"}
    for custom_id in ("auto", "default"):
        assert (errors[custom_id]["code"], errors[custom_id]["param"]) == ("unsupported_value", "body.tool_choice")
        assert '"required"' in errors[custom_id]["message"]
    assert (errors["unknown"]["code"], errors["unknown"]["param"]) == ("invalid_value", "body.tool_choice")
    assert "'get_time', which is not in tools" in errors["unknown"]["message"]
    # a call whose grammar does not compile fails its own line, blaming the tools
    assert (errors["uncompiled"]["code"], errors["uncompiled"]["param"]) == ("invalid_value", "body.tools")
    assert "nowhere" in errors["uncompiled"]["message"]
