"""Forced tool calls in the worker: the call's JSON schema, the tools rendered by the chat template as transformers
renders them, the grammar asked of the engine, and the generated JSON read back as OpenAI's message.tool_calls."""

from __future__ import annotations

import json

import jsonschema
import pytest
from transformers import AutoTokenizer

from sluice.api.batch_lines import CHAT_URL, ChatBody
from sluice.api.results import Generation, chat_completion
from sluice.worker.engine import InputProcessor
from sluice.worker.engine.config import EngineConfig
from sluice.worker.tool_calls import call_schema, with_tool_calls
from sluice.worker.translate import engine_inputs

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
                   "additionalProperties": False}}}
PING = {"type": "function", "function": {"name": "ping"}}
PAINT = {"type": "function", "function": {"name": "paint", "parameters": {
    "type": "object", "properties": {"color": {"$ref": "#/$defs/color"}, "const": {"const": {"$ref": "#/kept"}}},
    "required": ["color"], "additionalProperties": False, "$defs": {"color": {"enum": ["red", "blue"]}}}}}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def body(**fields) -> ChatBody:
    return ChatBody.model_validate({"messages": MESSAGES, "tools": [WEATHER, PING], **fields})


def generation(text: str, finish_reason: str = "stop") -> Generation:
    return Generation(text=text, finish_reason=finish_reason, prompt_tokens=7, completion_tokens=5, cached_tokens=0,
                      created=0)


@pytest.mark.parametrize("call, valid", [
    ({"name": "get_weather", "arguments": {"city": "Oslo"}}, True),
    ({"name": "ping", "arguments": {}}, True),
    ({"name": "get_weather", "arguments": {"city": "Rome"}}, False),
    ({"name": "get_time", "arguments": {}}, False),
    ({"name": "ping", "arguments": {"x": 1}}, False),  # no parameters: an empty object
    ({"arguments": {}}, False),
    ({"name": "paint", "arguments": {"color": "red", "const": {"$ref": "#/kept"}}}, True),
    ({"name": "paint", "arguments": {"color": "green"}}, False),  # its $ref still reaches its own $defs
])
def test_the_call_schema_takes_a_listed_name_and_its_valid_arguments(call, valid):
    for tools in ([WEATHER, PING, PAINT], [t for t in (WEATHER, PING, PAINT) if t["function"]["name"] == call.get(
            "name")]):
        if tools:
            assert jsonschema.Draft202012Validator(call_schema(tools)).is_valid(call) == valid, tools
    assert list(call_schema([WEATHER])["properties"]) == ["name", "arguments"]  # the name is generated first


@pytest.fixture(scope="module")
def processor(llama_dir):
    return InputProcessor.load(llama_dir, EngineConfig(model=str(llama_dir)), num_kv_blocks=64)


def test_tools_are_rendered_by_the_chat_template_as_transformers_renders_them(processor, llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(llama_dir))
    for choice in ("none", "required", {"type": "function", "function": {"name": "ping"}}):
        token_ids, _ = engine_inputs(processor, CHAT_URL, body(tool_choice=choice))
        assert token_ids == tokenizer.apply_chat_template(MESSAGES, tools=[WEATHER, PING], add_generation_prompt=True,
                                                          return_dict=False)
        prompt = tokenizer.decode(token_ids)
        assert '"name": "get_weather"' in prompt and '"name": "ping"' in prompt and '"Paris", "Oslo"' in prompt
    plain, _ = engine_inputs(processor, CHAT_URL, ChatBody.model_validate({"messages": MESSAGES}))
    assert "get_weather" not in tokenizer.decode(plain)


def test_forced_choices_ask_the_engine_for_the_call_schema(processor):
    _, params = engine_inputs(processor, CHAT_URL, body(tool_choice="required"))
    assert json.loads(params.structured_outputs.json) == call_schema([WEATHER, PING])
    _, params = engine_inputs(processor, CHAT_URL, body(tool_choice={"type": "function",
                                                                      "function": {"name": "get_weather"}}))
    assert json.loads(params.structured_outputs.json) == call_schema([WEATHER])
    _, params = engine_inputs(processor, CHAT_URL, body(tool_choice="none"))
    assert params.structured_outputs is None


def test_a_completed_call_is_returned_as_tool_calls():
    text = '{"name":"get_weather","arguments":{"city":"Oslo"}}'
    gen = with_tool_calls(generation(text), body(tool_choice="required"))
    response = chat_completion(gen, "m")
    choice = response["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    assert response["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize("text, finish_reason, choice", [
    ('{"name":"get_weather","argu', "length", "required"),  # max_tokens cut the JSON: its text, as OpenAI
    ('{"name":"get_weather","arguments":{"city":"Oslo"}}', "stop", "none"),  # not forced: text
    ('{"name":"get_wea', "stop", "required"),  # a stop string cut it
])
def test_an_unfinished_or_unforced_call_stays_text(text, finish_reason, choice):
    choice_body = chat_completion(with_tool_calls(generation(text, finish_reason), body(tool_choice=choice)),
                                  "m")["choices"][0]
    assert choice_body["finish_reason"] == finish_reason and choice_body["message"]["content"] == text
    assert "tool_calls" not in choice_body["message"]


def test_each_choice_of_an_n_request_is_read_back_as_its_own_call():
    calls = ['{"name":"get_weather","arguments":{"city":"Oslo"}}', '{"name":"ping","arguments":{}}',
             '{"name":"get_weather","argu']
    choices = [generation(t, "length" if i == 2 else "stop") for i, t in enumerate(calls)]
    gen = Generation(text=calls[0], finish_reason="stop", prompt_tokens=7, completion_tokens=15, cached_tokens=0,
                     created=0, choices=choices)
    response = chat_completion(with_tool_calls(gen, body(tool_choice="required", n=3)), "m")
    first, second, cut = response["choices"]
    assert [c["index"] for c in response["choices"]] == [0, 1, 2]
    assert first["finish_reason"] == second["finish_reason"] == "tool_calls" and cut["finish_reason"] == "length"
    assert first["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert second["message"]["tool_calls"][0]["function"]["name"] == "ping" and second["message"]["content"] is None
    assert cut["message"]["content"] == calls[2] and "tool_calls" not in cut["message"]
    assert first["message"]["tool_calls"][0]["id"] != second["message"]["tool_calls"][0]["id"]
    assert response["usage"]["completion_tokens"] == 15
