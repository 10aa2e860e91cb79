"""n > 1: choices forked from one prefill, each with its own generator, every shared block freed after."""

from __future__ import annotations

import json
import pickle

import jsonschema
import pytest

from sluice.worker.engine import LLM, SamplingParams
from sluice.worker.engine.choices import choice_seed
from sluice.worker.engine.structured_outputs import StructuredOutputsParams

PROMPT = list(range(5, 40))  # 35 tokens: 4 full blocks of 8 shared, the rest computed by each choice


def _sampled(**kwargs) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 12, "temperature": 0.9, "top_k": 40, "seed": 11, "ignore_eos": True,
                             **kwargs})


def _all_blocks_free(llm: LLM) -> bool:
    bm = llm.block_manager
    return bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


@pytest.fixture(scope="module")
def lone(llama_dir):
    """Choice i's reference: a lone n=1 request with the seed choice i uses."""
    llm = LLM(str(llama_dir), block_size=8, enable_prefix_caching=False)
    return lambda prompt, params, i: llm.generate([prompt], [_with(params, n=1, seed=choice_seed(params.seed, i))])[0]


def _with(params: SamplingParams, **changes) -> SamplingParams:
    return SamplingParams(**{**vars(params), **changes})


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("prompt", [PROMPT, PROMPT[:6]], ids=["forked", "no-full-block"])
def test_choice_i_equals_a_lone_request_with_its_seed(llama_dir, lone, prefix_caching, prompt):
    llm = LLM(str(llama_dir), block_size=8, enable_prefix_caching=prefix_caching)
    params = _sampled(n=4, logprobs=2)
    out = llm.generate([prompt], [params])[0]
    assert out.finished and len(out.choices) == 4
    for i, choice in enumerate(out.choices):
        ref = lone(prompt, params, i)
        assert choice.token_ids == ref.token_ids and choice.text == ref.text
        assert [lp.token_id for lp in choice.logprobs] == ref.token_ids
    assert len({tuple(c.token_ids) for c in out.choices}) > 1  # independent, not one sample repeated
    assert out.token_ids == out.choices[0].token_ids and out.num_completion_tokens == 4 * 12
    assert out.prompt_token_ids == prompt
    assert _all_blocks_free(llm)


def test_greedy_choices_all_equal_the_lone_greedy_output(llama_dir, lone):
    params = SamplingParams(max_tokens=10, temperature=0, n=3)
    out = LLM(str(llama_dir), block_size=8).generate([PROMPT], [params])[0]
    ref = lone(PROMPT, params, 0).token_ids
    assert [c.token_ids for c in out.choices] == [ref] * 3


def test_the_prompt_is_prefilled_once(llama_dir):
    llm = LLM(str(llama_dir), block_size=8, enable_prefix_caching=False)
    llm.generate([PROMPT], [_sampled(n=5, max_tokens=2)])
    # 32 tokens once by the parent, the last 3 by each choice; then 1 decode token per choice
    assert llm.stats()["num_prefill_tokens"] == 32 + 5 * 3


def test_blocks_are_shared_by_reference_while_the_choices_run(llama_dir):
    llm = LLM(str(llama_dir), block_size=8, enable_prefix_caching=False)
    start = llm.block_manager.num_free_blocks
    llm.add_request(PROMPT, _sampled(n=3, max_tokens=20), "r")
    group = llm.requests["r"]
    while group.parent is not None or not all(len(c.token_ids) > len(PROMPT) for c in group.choices):
        llm.step()
    shared = group.choices[0].block_table[:4]
    assert all(c.block_table[:4] == shared for c in group.choices)
    assert all(llm.block_manager.blocks[b].ref_count == 3 for b in shared)
    assert start - llm.block_manager.num_free_blocks == 4 + 3  # 4 shared, one own block per choice
    assert llm.abort("r") and llm.block_manager.num_free_blocks == start and _all_blocks_free(llm)


@pytest.mark.parametrize("at_step", [0, 1, 3])
def test_abort_frees_every_block_of_every_choice(llama_dir, at_step):
    llm = LLM(str(llama_dir), block_size=8, max_num_batched_tokens=16)
    llm.add_request(PROMPT, _sampled(n=4, max_tokens=30), "r")
    for _ in range(at_step):
        llm.step()
    assert llm.abort("r") and not llm.has_unfinished_requests()
    assert _all_blocks_free(llm)


def test_preemption_of_choices_keeps_each_choice_its_own(llama_dir, lone):
    """A tiny cache: choices and a batch mate are preempted and recomputed, and still equal their lone runs."""
    llm = LLM(str(llama_dir), block_size=8, num_kv_blocks=12, max_num_batched_tokens=16)
    params = _sampled(n=3, max_tokens=24)
    mate = SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True)
    outs = llm.generate([list(range(50, 80)), PROMPT], [mate, params])
    assert outs[1].metrics.num_preemptions > 0
    for i, choice in enumerate(outs[1].choices):
        assert choice.token_ids == lone(PROMPT, params, i).token_ids
    assert _all_blocks_free(llm)


def test_usage_counts_the_prompt_once_and_the_output_pickles(llama_dir):
    llm = LLM(str(llama_dir), block_size=8)
    llm.generate([PROMPT], [SamplingParams(max_tokens=1, temperature=0)])  # the prompt's blocks now cached
    out = llm.generate([PROMPT], [_sampled(n=3, max_tokens=5)])[0]
    assert out.num_cached_tokens == 24 and out.num_completion_tokens == 15  # the parent computes its last block
    assert len(out.prompt_token_ids) == len(PROMPT) and out.metrics.gpu_seconds > 0
    back = pickle.loads(pickle.dumps(out))
    assert [c.token_ids for c in back.choices] == [c.token_ids for c in out.choices]


def test_n_limits(llama_dir):
    for n in (0, 129):
        with pytest.raises(ValueError, match=r"n must be an integer in \[1, 128\]"):
            SamplingParams(n=n)
    assert choice_seed(2**64 - 1, 1) == 0  # wrapped into torch's seed range
    assert choice_seed(None, 3) is None and choice_seed(5, 3) == 8


SCHEMA = {"type": "object", "properties": {"tag": {"enum": ["a", "b", "c"]}, "n": {"type": "integer", "minimum": 0,
                                                                                     "maximum": 99}},
          "required": ["tag", "n"], "additionalProperties": False}


@pytest.mark.parametrize("prompt", [PROMPT, PROMPT[:6]], ids=["forked", "no-full-block"])
@pytest.mark.parametrize("regime", [{}, dict(num_kv_blocks=14, max_num_seqs=3)], ids=["plain", "preemption"])
def test_each_choice_under_a_grammar_has_its_own_matcher(llama_dir, lone, prompt, regime):
    """Every choice validates against the schema and equals a lone request with its seed (its own matcher, forked
    from the parent's compiled grammar or compiled for itself when the prompt has no block to share)."""
    llm = LLM(str(llama_dir), block_size=8, **regime)
    params = _sampled(n=4, max_tokens=40, ignore_eos=False,
                      structured_outputs=StructuredOutputsParams(json=SCHEMA))
    out = llm.generate([prompt], [params])[0]
    assert len(out.choices) == 4
    for i, choice in enumerate(out.choices):
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.text), SCHEMA)
        assert choice.token_ids == lone(prompt, params, i).token_ids
    assert len({c.text for c in out.choices}) > 1, "the choices did not sample independently"
    assert llm.grammars.stats.compiles == 1 and _all_blocks_free(llm)


@pytest.mark.parametrize("prompt", [PROMPT, PROMPT[:6]], ids=["forked", "no-full-block"])
def test_a_bad_grammar_fails_an_n_request_once_and_frees_everything(llama_dir, prompt):
    llm = LLM(str(llama_dir), block_size=8)
    bad = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}})
    outs = llm.generate([prompt, prompt], [_sampled(n=3, structured_outputs=bad), _sampled(n=2)])
    assert outs[0].error.startswith("the grammar could not be compiled") and outs[0].finished
    assert outs[1].error is None and len(outs[1].choices) == 2
    assert not llm.requests and not llm.has_unfinished_requests() and llm.num_parents == 0
    assert _all_blocks_free(llm)
