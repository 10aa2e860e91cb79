"""Structured outputs: every constrained output parses and validates (the jsonschema library), greedy and sampled,
under preemption and chunked prefill; greedy tokens equal transformers' generate driven by xgrammar's own logits
processor; a bad schema fails its request only; a batch under one schema compiles it once."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest
import torch
import transformers
import xgrammar as xgr
from xgrammar.contrib.hf import LogitsProcessor

from sluice.worker.engine import LLM, SamplingParams
from sluice.worker.engine.grammar import Grammars, json_schema_ebnf
from sluice.worker.engine.structured_outputs import MAX_SPEC_CHARS, StructuredOutputsParams

NAME = {"type": "string", "maxLength": 6}
# bounded so that a model with random weights closes every value: strings have a maxLength or a pattern of bounded
# length, arrays a maxItems, numbers bounds (and few digits: a random model would otherwise write them forever)
SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0,
                                                                         "maximum": 150}},
                 "required": ["name", "age"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "arrays": {"type": "object", "properties": {
        "ids": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 99}, "minItems": 2,
                "maxItems": 4}},
        "required": ["ids"], "additionalProperties": False},
    "enums": {"type": "object", "properties": {
        "colour": {"enum": ["red", "green", "blue"]}, "flag": {"type": "boolean"}, "none": {"type": "null"}},
        "required": ["colour", "flag", "none"], "additionalProperties": False},
    "numbers": {"type": "object", "properties": {
        "score": {"type": "number", "minimum": 0, "maximum": 1}, "count": {"type": "integer", "exclusiveMinimum": 3,
                                                                          "maximum": 7}},
        "required": ["score", "count"], "additionalProperties": False},
    "patterns": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}, "date": {"type": "string",
                                                                               "pattern": "^20[0-9]{2}$"}},
        "required": ["code", "date"], "additionalProperties": False},
    "optional": {"type": "object", "properties": {"a": NAME, "b": {"type": "integer", "minimum": 0, "maximum": 9},
                                                  "c": {"type": "boolean"}},
                 "required": ["a"], "additionalProperties": False},
    "refs": {"$defs": {"digit": {"type": "integer", "minimum": 0, "maximum": 9},
                       "point": {"type": "object", "properties": {"x": {"$ref": "#/$defs/digit"},
                                                                  "y": {"$ref": "#/$defs/digit"}},
                                 "required": ["x", "y"], "additionalProperties": False}},
             "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
             "required": ["start", "end"], "additionalProperties": False},
}
LOOSE = r'[^\"\\\r\n]'  # xgrammar's character of a length-bounded string: control characters included
PROMPTS = [[5 + i, 17, 40 + 3 * i, 9] * (1 + i % 3) for i in range(3)]
SAMPLED = dict(temperature=1.0, top_k=50, top_p=0.95, min_p=0.02)
REGIMES = {
    "plain": {},
    "preemption": dict(num_kv_blocks=40, block_size=4, max_num_seqs=8),
    "chunked_prefill": dict(max_num_batched_tokens=5),
}


def constrained(schema: dict, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=120, structured_outputs=StructuredOutputsParams(json=schema), **kwargs)


def run_schemas(llm: LLM, sampled: bool):
    cases = [(name, prompt, i) for name in SCHEMAS for i, prompt in enumerate(PROMPTS)]
    params = [constrained(SCHEMAS[name], **(dict(SAMPLED, seed=i) if sampled else dict(temperature=0)))
              for name, _, i in cases]
    return cases, llm.generate([p for _, p, _ in cases], params)


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_every_output_validates_against_its_schema(llama_dir, regime, sampled):
    llm = LLM(str(llama_dir), **REGIMES[regime])
    cases, outs = run_schemas(llm, sampled)
    for (name, _, _), out in zip(cases, outs):
        assert out.finish_reason == "stop", (name, out.text)
        jsonschema.validate(json.loads(out.text), SCHEMAS[name])
    if regime == "preemption":
        assert llm.stats()["num_preemptions"] > 0
    assert llm.stats()["kv_blocks_used"] == 0 and llm.grammars.stats.compiles == len(SCHEMAS)


def test_greedy_outputs_do_not_depend_on_preemption_or_chunking(llama_dir):
    tokens = {regime: [o.token_ids for o in run_schemas(LLM(str(llama_dir), **kwargs), sampled=False)[1]]
              for regime, kwargs in REGIMES.items()}
    assert tokens["preemption"] == tokens["plain"] and tokens["chunked_prefill"] == tokens["plain"]


def test_greedy_tokens_equal_transformers_with_xgrammars_logits_processor(llama_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(llama_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32)
    llm = LLM(str(llama_dir))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=model.config.vocab_size,
                                              stop_token_ids=sorted(llm.eos_token_ids))
    compiler = xgr.GrammarCompiler(info)
    for name, schema in SCHEMAS.items():
        grammar = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        ebnf = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
        if LOOSE in ebnf:  # length-bounded strings: JSON's characters only, as the engine narrows them
            grammar = compiler.compile_grammar(ebnf.replace(LOOSE, r'[^\0-\x1f\"\\]'))
        ours = llm.generate(PROMPTS, constrained(schema, temperature=0))
        for prompt, out in zip(PROMPTS, ours):
            with torch.no_grad():
                gen = model.generate(torch.tensor([prompt]), attention_mask=torch.ones_like(torch.tensor([prompt])),
                                     max_new_tokens=120, do_sample=False, logits_processor=[LogitsProcessor(grammar)],
                                     eos_token_id=sorted(llm.eos_token_ids), pad_token_id=tokenizer.eos_token_id)
            assert out.token_ids == gen[0, len(prompt):].tolist(), name


def test_length_bounded_strings_exclude_control_characters(llama_dir):
    schema = json.dumps(NAME)
    assert LOOSE in str(xgr.Grammar.from_json_schema(schema))  # else the engine's narrowing is moot
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(llama_dir))
    vocab = transformers.AutoConfig.from_pretrained(str(llama_dir)).vocab_size
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab))
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(json_schema_ebnf(schema)))
    assert matcher.accept_string('"')
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(bitmask)
    logits = torch.zeros(1, vocab)
    xgr.apply_token_bitmask_inplace(logits, bitmask)
    allowed = set(torch.nonzero(logits[0] == 0).flatten().tolist())
    control = {i for i in range(vocab) if any(ord(c) < 32 for c in tokenizer.decode([i]))}
    assert control and allowed and not allowed & control


def test_json_object_choice_and_regex(llama_dir):
    llm = LLM(str(llama_dir))
    specs = [StructuredOutputsParams(choice=["alpha", "beta", "gamma delta"]),
             StructuredOutputsParams(regex="[a-c]{2,5}!"), StructuredOutputsParams(json_object=True)]
    outs = llm.generate([PROMPTS[0]] * 3, [SamplingParams(max_tokens=40, temperature=0, structured_outputs=s)
                                           for s in specs])
    assert outs[0].text in ("alpha", "beta", "gamma delta") and outs[0].finish_reason == "stop"
    assert outs[1].finish_reason == "stop" and outs[1].text[-1] == "!" and set(outs[1].text[:-1]) <= set("abc")
    # an object with any properties may outrun max_tokens on random weights: what came out is an object's start
    assert outs[2].text.startswith("{")
    if outs[2].finish_reason == "stop":
        assert isinstance(json.loads(outs[2].text), dict)


def test_max_tokens_before_the_json_closes_is_length(llama_dir):
    llm = LLM(str(llama_dir))
    spec = StructuredOutputsParams(json=SCHEMAS["nested"])
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=3, temperature=0, structured_outputs=spec))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3 and out.text.startswith('{"user"'[:len(out.text)])


def test_a_bad_schema_fails_its_request_only(llama_dir):
    llm = LLM(str(llama_dir))
    bad = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}})
    outs = llm.generate(PROMPTS, [SamplingParams(max_tokens=8, temperature=0, structured_outputs=bad),
                                  constrained(SCHEMAS["enums"], temperature=0), SamplingParams(max_tokens=8)])
    assert outs[0].finished and outs[0].error.startswith("the grammar could not be compiled: ")
    assert "missing" in outs[0].error and "json_schema_converter" not in outs[0].error
    assert outs[1].error is None and outs[1].finish_reason == "stop" and outs[2].error is None
    assert not llm.requests and not llm.has_unfinished_requests()


@pytest.mark.parametrize("spec, message", [
    (dict(json="{not json"), "not JSON"),
    (dict(json="[1]"), "must be a JSON object"),
    (dict(json={"description": "x" * MAX_SPEC_CHARS}), "the limit is 65536"),
    (dict(), "exactly one"),
    (dict(json_object=True, regex="a"), "exactly one"),
    (dict(choice=[]), "non-empty list"),
])
def test_malformed_specs_are_refused_before_the_engine(spec, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**spec)


def test_one_schema_compiles_once_and_aborts_while_compiling_leave_nothing(llama_dir, monkeypatch):
    llm = LLM(str(llama_dir), max_num_seqs=4)
    params = constrained(SCHEMAS["enums"], temperature=0)
    outs = llm.generate([PROMPTS[i % 3] for i in range(20)], params)
    assert all(o.finish_reason == "stop" for o in outs) and llm.grammars.stats.compiles == 1
    assert llm.grammars.stats.mask_steps > 0
    compile_ = Grammars._compile
    monkeypatch.setattr(Grammars, "_compile", lambda self, spec, job: (time.sleep(0.3), compile_(self, spec, job))[1])
    llm.add_request(PROMPTS[0], constrained(SCHEMAS["refs"]), "slow")
    assert llm.abort("slow") and not llm.has_unfinished_requests() and llm.scheduler.num_waiting == 0


def test_a_grammar_past_the_compile_time_limit_fails_its_request(llama_dir, monkeypatch):
    llm = LLM(str(llama_dir))
    llm.grammars.compile_timeout = 0.05
    compile_ = Grammars._compile
    monkeypatch.setattr(Grammars, "_compile", lambda self, spec, job: (setattr(job, "started", time.perf_counter()),
                                                                       time.sleep(0.5), compile_(self, spec, job))[2])
    out = llm.generate(PROMPTS[0], constrained(SCHEMAS["refs"], temperature=0))[0]
    assert out.error == "the grammar took more than 0.05 s to compile"
