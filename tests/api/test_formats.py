"""The public formats without an engine: line validation (api.batch_lines), the mapping onto sampling arguments
(worker.translate) and the response shapes (api.results)."""

from __future__ import annotations

import json

from sluice.api.batch_lines import CHAT_URL, COMPLETIONS_URL, BatchRequest, BatchValidator, LineError, parse_line
from sluice.api.results import Generation, TokenLogprob, chat_completion, error_line, text_completion
from sluice.worker.translate import chat_messages, sampling_args


def line(custom_id="a", url=COMPLETIONS_URL, **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_sampling_args_map_openai_fields_and_defaults():
    chat = parse_line(line(url=CHAT_URL, messages=[{"role": "user", "content": "hi"}], logprobs=True,
                           temperature=0, stop="\n", seed=3, top_k=5), 1)
    assert isinstance(chat, BatchRequest)
    assert sampling_args(chat.body, room=100) == {"max_tokens": 100, "logprobs": 0, "temperature": 0, "top_k": 5,
                                                  "seed": 3, "stop": ["\n"]}
    assert sampling_args(chat.body, room=-5)["max_tokens"] == 1
    capped = parse_line(line(url=CHAT_URL, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=7), 1)
    assert sampling_args(capped.body, room=100)["max_tokens"] == 7
    plain = parse_line(line(prompt=[[1, 2, 3]], logprobs=2, top_p=0.5), 1)
    assert plain.body.prompt == [1, 2, 3]
    assert sampling_args(plain.body, room=100) == {"max_tokens": 16, "logprobs": 2, "top_p": 0.5}


def test_chat_messages_join_text_parts_and_rename_developer():
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    request = parse_line(line(url=CHAT_URL, messages=[{"role": "developer", "content": "be brief"},
                                                      {"role": "user", "content": parts, "name": "ann"}]), 1)
    assert chat_messages(request.body) == [{"role": "system", "content": "be brief"},
                                           {"role": "user", "content": "one\ntwo", "name": "ann"}]


def test_an_invalid_line_still_claims_its_custom_id():
    validator = BatchValidator()
    first = validator.validate(line("x", temperature=9, prompt="p"), 1)
    second = validator.validate(line("x", prompt="p"), 2)
    assert isinstance(first, LineError) and first.custom_id == "x"
    assert second.code == "duplicate_custom_id" and second.message == "line 2: custom_id: 'x' is already used by line 1"


def test_all_problems_of_a_line_are_named():
    error = parse_line(line(prompt="p", temperature=-1, colour="red"), 4)
    assert error.message == ("line 4: body.temperature: Input should be greater than or equal to 0 (got -1); "
                             "body.colour: unknown field")
    assert (error.code, error.param) == ("invalid_value", "body.temperature")


def generation(**kw) -> Generation:
    return Generation(**{"text": "hi!", "finish_reason": "stop", "prompt_tokens": 4, "completion_tokens": 2,
                         "cached_tokens": 1, "created": 1700000000, **kw})


def test_response_shapes():
    lps = [TokenLogprob("hi", -0.5, [("hi", -0.5), ("ho", -1.0)]), TokenLogprob("!", -0.25, [("!", -0.25)])]
    chat = chat_completion(generation(logprobs=lps), "m")
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "hi!", "refusal": None}
    assert chat["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6,
                             "prompt_tokens_details": {"cached_tokens": 1}}
    first = chat["choices"][0]["logprobs"]["content"][0]
    assert first == {"token": "hi", "logprob": -0.5, "bytes": [104, 105],
                     "top_logprobs": [{"token": "hi", "logprob": -0.5, "bytes": [104, 105]},
                                      {"token": "ho", "logprob": -1.0, "bytes": [104, 111]}]}
    text = text_completion(generation(logprobs=lps), "m")
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == "hi!"
    assert text["choices"][0]["logprobs"] == {"tokens": ["hi", "!"], "token_logprobs": [-0.5, -0.25],
                                              "top_logprobs": [{"hi": -0.5, "ho": -1.0}, {"!": -0.25}],
                                              "text_offset": [0, 2]}
    assert text_completion(generation(), "m")["choices"][0]["logprobs"] is None


def test_error_line_shape():
    record = error_line(parse_line("{", 9))
    assert record["response"] is None and record["custom_id"] is None
    assert record["error"]["code"] == "invalid_json_line" and record["error"]["line"] == 9
    assert record["error"]["message"].startswith("line 9: not valid JSON")


def test_completion_top_logprobs_always_hold_the_sampled_token():
    """OpenAI's completions logprobs: "The API will always return the logprob of the sampled token, so there may be
    up to logprobs+1 elements" in each top_logprobs entry (vLLM likewise); chat's top_logprobs are only the top."""
    lps = [TokenLogprob("b", -2.0, [("a", -0.1)]), TokenLogprob("a", -0.1, [("a", -0.1)]), TokenLogprob("c", -3.0, [])]
    text = text_completion(generation(logprobs=lps), "m")["choices"][0]["logprobs"]
    assert text["top_logprobs"] == [{"a": -0.1, "b": -2.0}, {"a": -0.1}, {"c": -3.0}]
    chat = chat_completion(generation(logprobs=lps), "m")["choices"][0]["logprobs"]["content"]
    assert [[t["token"] for t in entry["top_logprobs"]] for entry in chat] == [["a"], ["a"], []]


def test_documented_fields_sluice_cannot_honour_are_unsupported_not_unknown():
    chat = dict(url=CHAT_URL, messages=[{"role": "user", "content": "hi"}])
    for field, value in [("tool_choice", "auto"), ("functions", [{"name": "f"}]), ("function_call", "auto"),
                         ("modalities", ["text", "audio"]), ("audio", {"voice": "alloy"}),
                         ("reasoning_effort", "low"), ("stream_options", {"include_usage": True})]:
        error = parse_line(line(**chat, **{field: value}), 1)
        assert (error.code, error.param) == ("unsupported_value", f"body.{field}"), (field, error)
    error = parse_line(line(prompt="p", stream_options={"include_usage": True}), 1)
    assert (error.code, error.param) == ("unsupported_value", "body.stream_options")
    # tools without tool_choice mean OpenAI's "auto" (tests/api/test_tools.py has the rest)
    error = parse_line(line(**chat, tools=[{"type": "function", "function": {"name": "f"}}]), 1)
    assert (error.code, error.param) == ("unsupported_value", "body.tool_choice")


def test_documented_fields_left_at_their_default_or_inert_are_accepted():
    request = parse_line(line(url=CHAT_URL, messages=[{"role": "user", "content": "hi"}], tools=[],
                              tool_choice="none", response_format={"type": "text"}, modalities=["text"],
                              parallel_tool_calls=False, metadata={"run": "7"}, store=False, service_tier="auto",
                              user="u1"), 1)
    assert isinstance(request, BatchRequest)
    assert sampling_args(request.body, room=10) == {"max_tokens": 10, "logprobs": None}
    assert parse_line(line(url=CHAT_URL, messages=[{"role": "user", "content": "hi"}], metadata={"n": 7}),
                      1).code == "invalid_value"


def test_penalties_logit_bias_and_min_tokens_map_onto_sampling_args():
    request = parse_line(line(prompt="p", max_tokens=9, presence_penalty=-2, frequency_penalty=1.5,
                              repetition_penalty=1.2, min_tokens=9, logit_bias={"0": 100, "50256": -100, "7": 0.5}), 1)
    assert isinstance(request, BatchRequest)
    assert sampling_args(request.body, room=100) == {
        "max_tokens": 9, "logprobs": None, "presence_penalty": -2, "frequency_penalty": 1.5,
        "repetition_penalty": 1.2, "min_tokens": 9, "logit_bias": {0: 100, 50256: -100, 7: 0.5}}
    chat = parse_line(line(url=CHAT_URL, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=4,
                           min_tokens=4, logit_bias={str(i): 1 for i in range(300)}), 1)
    assert isinstance(chat, BatchRequest) and len(sampling_args(chat.body, room=100)["logit_bias"]) == 300


def test_penalties_logit_bias_and_min_tokens_out_of_range_name_the_field_and_limit():
    chat = dict(url=CHAT_URL, messages=[{"role": "user", "content": "hi"}])
    cases = [
        (dict(prompt="p", presence_penalty=2.01), "body.presence_penalty", "less than or equal to 2"),
        (dict(prompt="p", frequency_penalty=-3), "body.frequency_penalty", "greater than or equal to -2"),
        (dict(prompt="p", frequency_penalty="1"), "body.frequency_penalty", "valid number"),
        (dict(prompt="p", repetition_penalty=0), "body.repetition_penalty", "greater than 0"),
        (dict(prompt="p", logit_bias={"5": 100.5}), "body.logit_bias.5", "less than or equal to 100"),
        (dict(prompt="p", logit_bias={"5": -101}), "body.logit_bias.5", "greater than or equal to -100"),
        (dict(prompt="p", logit_bias={"-1": 1}), "body.logit_bias", "token ids (strings of integers >= 0), got '-1'"),
        (dict(prompt="p", logit_bias={"a": 1}), "body.logit_bias", "got 'a'"),
        (dict(prompt="p", logit_bias={str(i): 1 for i in range(301)}), "body.logit_bias", "at most 300 items"),
        (dict(prompt="p", logit_bias=[1]), "body.logit_bias", "valid dictionary"),
        (dict(prompt="p", min_tokens=-1), "body.min_tokens", "greater than or equal to 0"),
        (dict(prompt="p", min_tokens=1.5), "body.min_tokens", "valid integer"),
        (dict(prompt="p", max_tokens=3, min_tokens=4), "body", "min_tokens (4) must be <= max_tokens (3)"),
        (dict(**chat, max_completion_tokens=3, min_tokens=4), "body", "min_tokens (4) must be <= max_tokens (3)"),
    ]
    for body, param, text in cases:
        error = parse_line(line(**body), 1)
        assert isinstance(error, LineError), body
        assert error.code == "invalid_value" and error.param == param and text in error.message, (body, error)


def test_n_is_1_to_128_with_or_without_structured_outputs():
    chat = dict(url=CHAT_URL, messages=[{"role": "user", "content": "hi"}])
    tool = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object"}}}
    assert sampling_args(parse_line(line(prompt="x", n=128), 1).body, room=10)["n"] == 128
    assert isinstance(parse_line(line(**chat, n=3, logprobs=True, top_logprobs=2, tools=[tool], tool_choice="none"),
                                 1), BatchRequest)
    for n in (0, 129, "two"):
        error = parse_line(line(prompt="x", n=n), 1)
        assert (error.code, error.param) == ("invalid_value", "body.n"), error
    for extra in (dict(response_format={"type": "json_object"}), dict(tools=[tool], tool_choice="required")):
        assert isinstance(parse_line(line(**chat, n=2, **extra), 1), BatchRequest), extra


def test_n_choices_each_have_their_index_and_usage_counts_the_prompt_once():
    choices = [Generation(text=t, finish_reason=r, prompt_tokens=5, completion_tokens=c, cached_tokens=0, created=1)
               for t, r, c in [("a", "stop", 1), ("bc", "length", 2)]]
    gen = Generation(text="a", finish_reason="stop", prompt_tokens=5, completion_tokens=3, cached_tokens=0, created=1,
                     choices=choices)
    for body in (chat_completion(gen, "m"), text_completion(gen, "m")):
        assert [(c["index"], c["finish_reason"]) for c in body["choices"]] == [(0, "stop"), (1, "length")]
        assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["total_tokens"] == 8
    assert [c["message"]["content"] for c in chat_completion(gen, "m")["choices"]] == ["a", "bc"]


def test_guided_fields_on_completions():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for guide in (dict(guided_json=schema), dict(guided_json=json.dumps(schema)), dict(guided_regex="[a-z]+"),
                  dict(guided_choice=["yes", "no"])):
        request = parse_line(line(prompt="x", **guide), 1)
        assert isinstance(request, BatchRequest), guide
    assert parse_line(line(prompt="x", guided_json=json.dumps(schema)), 1).body.guided_json == schema
    for guide, param, text in [
        (dict(guided_json="{oops"), "body.guided_json", "guided_json is not JSON"),
        (dict(guided_json={"type": "objekt"}), "body.guided_json", "guided_json is not a valid JSON schema"),
        (dict(guided_choice=[]), "body.guided_choice", ""),
        (dict(guided_regex=""), "body.guided_regex", ""),
        (dict(guided_json=schema, guided_choice=["a"]), "body.guided_choice", "at most one of guided_json"),
    ]:
        error = parse_line(line(prompt="x", **guide), 1)
        assert (error.code, error.param) == ("invalid_value", param) and text in error.message, (guide, error)
    error = parse_line(line(url=CHAT_URL, messages=[{"role": "user", "content": "x"}], guided_regex="a"), 1)
    assert (error.code, error.param) == ("unknown_parameter", "body.guided_regex"), error
