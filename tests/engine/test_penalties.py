"""Penalties, logit_bias and min_tokens: the batched pass equals transformers' own logits processors (and a per-row
transcription of OpenAI's presence/frequency formula), and greedy outputs equal transformers' generate with them."""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from sluice.worker.engine import LLM, SamplingParams
from sluice.worker.engine.penalties import process_logits
from sluice.worker.engine.sequence import Sequence

VOCAB = 64
EOS = {2}


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's definition, row by row over the generated tokens: logit[j] -= c[j] * frequency + (c[j] > 0) *
    presence."""

    def __init__(self, prompt_len: int, frequency: float, presence: float):
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        for row, ids in enumerate(input_ids[:, self.prompt_len:].tolist()):
            for j in set(ids):
                scores[row, j] -= ids.count(j) * self.frequency + self.presence
        return scores


def hf_processors(p: SamplingParams, prompt_len: int, stop_ids: list[int]) -> LogitsProcessorList:
    """transformers' processors for these params, in generate's order (sequence bias, repetition, min new tokens,
    then custom processors)."""
    processors = LogitsProcessorList()
    if p.logit_bias:
        processors.append(SequenceBiasLogitsProcessor([[[t], b] for t, b in p.logit_bias.items()]))
    if p.repetition_penalty != 1:
        processors.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    if p.min_tokens:
        processors.append(MinNewTokensLengthLogitsProcessor(prompt_len, p.min_tokens, stop_ids))
    if p.frequency_penalty or p.presence_penalty:
        processors.append(OpenAIPenalties(prompt_len, p.frequency_penalty, p.presence_penalty))
    return processors


CASES = [
    SamplingParams(max_tokens=20),
    SamplingParams(max_tokens=20, repetition_penalty=1.5),
    SamplingParams(max_tokens=20, repetition_penalty=0.7),
    SamplingParams(max_tokens=20, presence_penalty=1.5),
    SamplingParams(max_tokens=20, frequency_penalty=-0.5, presence_penalty=0.25),
    SamplingParams(max_tokens=20, logit_bias={3: 100.0, 7: -100.0, 9: 0.5}),
    SamplingParams(max_tokens=20, min_tokens=10, stop_token_ids=[5, 6]),
    SamplingParams(max_tokens=20, min_tokens=10, ignore_eos=True, stop_token_ids=[8]),
    SamplingParams(max_tokens=20, min_tokens=2),  # already past: nothing masked
    SamplingParams(max_tokens=20, repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=-1.0,
                   logit_bias={2: 4.0, 11: -3.0}, min_tokens=6),
    SamplingParams(max_tokens=20),
]


def make_seqs(cases: list[SamplingParams], seed: int = 0) -> list[Sequence]:
    rng = random.Random(seed)
    seqs = []
    for i, p in enumerate(cases):
        seq = Sequence(str(i), [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))], p, 0.0)
        # output tokens drawn from a few ids, so that some repeat; some rows have none yet
        seq.token_ids += [rng.randrange(12) for _ in range(rng.choice([0, 3, 5, 8]))]
        seqs.append(seq)
    return seqs


@pytest.mark.parametrize("seed", range(4))
def test_processed_logits_equal_transformers_processors(seed):
    seqs = make_seqs(CASES, seed)
    logits = torch.randn(len(seqs), VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    before = logits.clone()
    got = process_logits(logits, seqs, EOS)
    assert torch.equal(logits, before), "the raw logits (logprobs read them) must be left as they were"
    for row, seq in enumerate(seqs):
        p = seq.params
        stop_ids = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else EOS))
        processors = hf_processors(p, seq.num_prompt_tokens, stop_ids)
        expected = processors(torch.tensor([seq.token_ids]), logits[row:row + 1].clone())[0]
        torch.testing.assert_close(got[row], expected, msg=f"row {row}: {p}")
        if not processors:
            assert torch.equal(got[row], logits[row])
    masked = got[6, [2, 5, 6]]
    assert masked.isneginf().all() and not got[7, 2].isneginf()  # ignore_eos: EOS stays; its stop id goes


def test_a_step_without_them_pays_nothing():
    seqs = make_seqs([SamplingParams(), SamplingParams(min_tokens=1, max_tokens=4)])
    seqs[1].token_ids.append(3)  # min_tokens reached
    logits = torch.randn(2, VOCAB)
    assert process_logits(logits, seqs, EOS) is logits


def test_min_tokens_masks_stop_ids_past_the_vocabulary_safely():
    seqs = make_seqs([SamplingParams(min_tokens=3, max_tokens=4, stop_token_ids=[VOCAB + 5, 4])])
    seqs[0].token_ids = seqs[0].prompt_token_ids[:]
    got = process_logits(torch.zeros(1, VOCAB), seqs, EOS)
    assert got[0].isneginf().nonzero().flatten().tolist() == [2, 4]


# engine against transformers' generate, greedy

def engine_cases(vocab: int, eos: int, seed: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    settings = [
        {},
        {"repetition_penalty": 1.4},
        {"repetition_penalty": 0.8},
        {"presence_penalty": 2.0},
        {"frequency_penalty": 1.2},
        {"frequency_penalty": -0.8, "presence_penalty": 0.6},
        {"logit_bias": {rng.randrange(5, vocab): 6.0, rng.randrange(5, vocab): -100.0}},
        # EOS raised to the top, so that the output ends exactly when min_tokens lets it
        {"logit_bias": {eos: 100.0}, "min_tokens": 5},
        {"repetition_penalty": 1.2, "frequency_penalty": 0.4, "presence_penalty": 0.4,
         "logit_bias": {eos: 3.0, rng.randrange(5, vocab): 2.0}, "min_tokens": 3},
    ]
    cases = []
    for i in range(27):
        prompt = [rng.randrange(5, vocab) for _ in range(1 + (i * 37) % 70)]
        cases.append((prompt, SamplingParams(max_tokens=rng.randrange(8, 24), temperature=0, **settings[i % 9])))
    return cases


def hf_generate(path, cases) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    eos = model.config.eos_token_id
    outs = []
    for ids, p in cases:
        openai = OpenAIPenalties(len(ids), p.frequency_penalty, p.presence_penalty)
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=p.max_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos,
                                 repetition_penalty=p.repetition_penalty, min_new_tokens=p.min_tokens or None,
                                 sequence_bias=[[[t], b] for t, b in p.logit_bias.items()] or None,
                                 logits_processor=LogitsProcessorList([openai]))
        outs.append(gen[0, len(ids):].tolist())
    return outs


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def greedy_case(request, checkpoints):
    path = checkpoints(request.param)
    config = transformers.AutoConfig.from_pretrained(str(path))
    cases = engine_cases(config.vocab_size, config.eos_token_id, seed=3)
    expected = hf_generate(path, cases)
    plain = hf_generate(path, [(ids, SamplingParams(max_tokens=p.max_tokens, temperature=0)) for ids, p in cases])
    changed = [a != b for a, b, (_, p) in zip(expected, plain, cases) if p != cases[0][1]]
    assert sum(changed) >= len(changed) // 2, "the settings change too few outputs to test anything"
    for out, (_, p) in zip(expected, cases):
        if p.min_tokens:  # the biased EOS ends the output as soon as min_tokens lets it
            assert out[p.min_tokens:] == [config.eos_token_id] or p.logit_bias[config.eos_token_id] < 100
    return path, cases, expected


@pytest.mark.parametrize("engine_kwargs", [{}, {"num_kv_blocks": 16}, {"max_num_batched_tokens": 16}],
                         ids=["ample", "preempted", "chunked"])
def test_greedy_equals_transformers_generate(greedy_case, engine_kwargs):
    path, cases, expected = greedy_case
    llm = LLM(str(path), **engine_kwargs)
    got = [o.token_ids for o in llm.generate([ids for ids, _ in cases], [p for _, p in cases])]
    assert got == expected
    if "num_kv_blocks" in engine_kwargs:
        assert llm.stats()["num_preemptions"] > 0


def test_seeded_sampling_with_penalties_ignores_the_batch(llama_dir):
    """A seeded request's tokens depend on its seed alone: run by itself, in a batch, and preempted."""
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=11, repetition_penalty=1.3, presence_penalty=1.0,
                            frequency_penalty=0.5, logit_bias={40: 2.0}, min_tokens=8)
    prompt = list(range(10, 40))
    alone = LLM(str(llama_dir)).generate(prompt, params)[0].token_ids
    others = [list(range(5 + i, 60 + i)) for i in range(12)]
    for kwargs in ({}, {"num_kv_blocks": 16}):
        llm = LLM(str(llama_dir), **kwargs)
        outs = llm.generate([*others, prompt], [SamplingParams(max_tokens=16, presence_penalty=0.5)] * 12 + [params])
        assert outs[-1].token_ids == alone
    assert len(alone) >= 8


def test_no_stop_string_before_min_tokens(llama_dir, scripted_tokens):
    llm = LLM(str(llama_dir))
    tokens = llm.tokenizer.encode("a b a b a b", add_special_tokens=False)
    assert len(tokens) == 6

    def run(min_tokens: int):
        scripted_tokens(tokens)
        params = SamplingParams(max_tokens=6, ignore_eos=True, stop=" b", min_tokens=min_tokens)
        out = llm.generate([5, 6], params)[0]
        return out.text, len(out.token_ids), out.finish_reason

    assert run(0) == ("a", 2, "stop")
    assert run(3) == ("a b a", 4, "stop")  # the " b" of the 2nd token came before min_tokens


def test_logit_bias_outside_the_vocabulary_rejects_that_request_only(llama_dir):
    llm = LLM(str(llama_dir))
    vocab = llm.model_config.vocab_size
    bad, good = llm.generate(["a b", "c d"], [SamplingParams(max_tokens=3, logit_bias={1: 1.0, vocab: 1.0}),
                                              SamplingParams(max_tokens=3, logit_bias={vocab - 1: 1.0})])
    assert bad.error == f"logit_bias has token id {vocab}, outside the model's vocabulary [0, {vocab})"
    assert good.error is None and len(good.token_ids) >= 1


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -2.1}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {3: 101}}, "logit_bias"), ({"min_tokens": 17}, "min_tokens"), ({"min_tokens": -1}, "min_tokens")])
def test_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(max_tokens=16, **kwargs)
