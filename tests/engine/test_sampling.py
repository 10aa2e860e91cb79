"""Sampling: seeded requests are batch-independent; filters, stops, logprobs and finish reasons behave."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from sluice.worker.engine import LLM, SamplingParams
from sluice.worker.engine.llm import LLMEngine
from sluice.worker.engine.sampler import _filter, _sample_rows, sample
from sluice.worker.engine.sequence import Sequence

PROMPTS = ["The zen of python", "Beautiful is better than ugly.", "Errors should never pass", "Now is better"]


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir))


def test_seeded_request_is_the_same_alone_and_in_a_batch(llm):
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234)
    alone = llm.generate(PROMPTS[0], params)[0].token_ids
    others = [SamplingParams(max_tokens=16, temperature=1.0) for _ in PROMPTS[1:]]
    batched = llm.generate(PROMPTS, [params, *others])[0].token_ids
    assert alone == batched
    reseeded = llm.generate(PROMPTS[0], SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=99))
    assert reseeded[0].token_ids != alone


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0))
    top1 = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.8, top_k=1, seed=3))
    assert [o.token_ids for o in greedy] == [o.token_ids for o in top1]


def test_filters_keep_exactly_the_allowed_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]] * 3))
    seqs = [Sequence(str(i), [1], p, 0.0) for i, p in enumerate([
        SamplingParams(top_k=2), SamplingParams(top_p=0.8), SamplingParams(min_p=0.25)])]
    kept = torch.isfinite(_filter(logits, seqs))
    assert kept.tolist() == [[True, True, False, False, False],   # top-2
                             [True, True, True, False, False],    # 0.5+0.2 < 0.8 <= 0.85
                             [True, True, True, False, False]]    # p >= 0.25 * 0.5


def _hf_filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """transformers' warpers in generate()'s order: top_k, then top_p, then min_p."""
    warpers = ([TopKLogitsWarper(p.top_k)] if p.top_k > 0 else []) + [TopPLogitsWarper(p.top_p),
                                                                       MinPLogitsWarper(p.min_p)]
    for warp in warpers:
        logits = warp(None, logits)
    return logits


def test_filters_match_transformers_warpers():
    """top_p and min_p read the distribution top_k leaves: [.4, .3, .2, .1] with top_k=2 renormalises to [.57, .43],
    so top_p=0.5 keeps one token (top_p on the whole distribution kept two)."""
    cases = [SamplingParams(top_k=2, top_p=0.5)] + [
        SamplingParams(top_k=k, top_p=p, min_p=m) for k in (-1, 1, 3, 20) for p in (0.3, 0.75, 1.0) for m in (0, 0.2)]
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(cases), 50, generator=gen) * 2
    logits[0, :4] = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    logits[0, 4:] = -30
    seqs = [Sequence(str(i), [1], p, 0.0) for i, p in enumerate(cases)]
    ours = _filter(logits.clone(), seqs)
    assert torch.isfinite(ours[0]).nonzero().flatten().tolist() == [0]
    for row, p in enumerate(cases):
        assert torch.equal(ours[row], _hf_filter(logits[row:row + 1].clone(), p)[0]), p


def test_filtered_sampling_follows_the_transformers_distribution():
    logits = torch.tensor([0.35, 0.25, 0.2, 0.12, 0.08]).log().repeat(4000, 1)
    params = SamplingParams(top_k=3, top_p=0.7)  # top-3 renormalised: [.44, .31, .25]; top_p keeps two
    tokens = _sample_rows(logits.clone(), [Sequence(str(i), [1], params, 0.0) for i in range(4000)])
    freq = torch.bincount(tokens, minlength=5).float() / 4000
    assert torch.allclose(freq, _hf_filter(logits[:1].clone(), params)[0].softmax(-1), atol=0.03)


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().repeat(4000, 1)
    seqs = [Sequence(str(i), [1], SamplingParams(temperature=1.0), 0.0) for i in range(4000)]
    tokens, _ = sample(logits, seqs)
    freq = torch.bincount(torch.tensor(tokens), minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def test_stop_string_ends_generation_and_is_not_in_the_text(llm):
    free = llm.generate(PROMPTS[1], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    assert len(free.text) > 6
    stop = free.text[3:6]
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=24, temperature=0, stop=[stop], ignore_eos=True))[0]
    assert out.finish_reason == "stop"
    assert stop not in out.text and free.text.startswith(out.text)
    assert out.token_ids == free.token_ids[: len(out.token_ids)] and len(out.token_ids) < len(free.token_ids)


def test_one_token_completing_two_stops_cuts_at_the_earliest(llm, scripted_tokens):
    """' THE' completes both stops; the text ends before the first match in the text, not in the stop list."""
    tokens = llm.tokenizer.encode("Now is better THE end", add_special_tokens=False)
    assert " THE" in [llm.tokenizer.decode([t]) for t in tokens]  # one token
    scripted_tokens(tokens)
    stop = ["H", "T"]
    out = llm.generate(PROMPTS[3], SamplingParams(max_tokens=len(tokens), stop=stop, ignore_eos=True))[0]
    text = llm.tokenizer.decode(tokens)
    assert out.finish_reason == "stop" and out.text == text[:min(text.find(s) for s in stop)] == "Now is better "


def test_truncate_at_stop_keeps_no_stop_string():
    seq = Sequence("s", [1], SamplingParams(stop=["later", "b", "xy"]), 0.0)
    seq.text = "a xyb later"
    assert LLMEngine._truncate_at_stop(seq, len(seq.text)) and seq.text == "a "
    seq.text = "none here"
    assert not LLMEngine._truncate_at_stop(seq, len(seq.text)) and seq.text == "none here"
    seq.text = "x later"  # "later" ends in the new 2 characters: found though it starts before them
    assert LLMEngine._truncate_at_stop(seq, 2) and seq.text == "x "


def test_stop_token_ids_and_length(llm):
    free = llm.generate(PROMPTS[2], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 10
    # a target that adds text of its own where it first comes (a special token or half a character would not)
    texts = [o.text for o in llm.generate([PROMPTS[2]] * 10, [SamplingParams(max_tokens=n, temperature=0,
                                                                             ignore_eos=True) for n in range(1, 11)])]
    at = next(i for i in range(1, 10) if texts[i] != texts[i - 1] and free.token_ids.index(free.token_ids[i]) == i)
    target = free.token_ids[at]
    out = llm.generate(PROMPTS[2], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[target]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == free.token_ids[: at + 1]
    # the stop token is counted but its text is not output (vLLM's default): the text of the tokens before it
    assert out.text == texts[at - 1]


def test_eos_stops_unless_ignored(llm, monkeypatch):
    free = llm.generate(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    eos = free.token_ids[5]
    monkeypatch.setattr(llm, "eos_token_ids", {eos})  # pretend a token greedy decoding reaches is the model's eos
    stopped = llm.generate(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0))[0]
    assert stopped.finish_reason == "stop"
    at = free.token_ids.index(eos)
    assert stopped.token_ids == free.token_ids[: at + 1]
    before = llm.generate(PROMPTS[0], SamplingParams(max_tokens=at, temperature=0, ignore_eos=True))[0]
    assert stopped.text == before.text  # an eos that is an ordinary token keeps its text out too
    ignored = llm.generate(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    assert ignored.token_ids == free.token_ids and ignored.finish_reason == "length"


def test_logprobs_match_transformers(llm, llama_dir):
    out = llm.generate(PROMPTS[3], SamplingParams(max_tokens=5, temperature=0, logprobs=3))[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32)
    ids = torch.tensor([out.prompt_token_ids + out.token_ids])
    with torch.no_grad():
        ref = model(ids).logits[0].log_softmax(-1)
    assert len(out.logprobs) == 5
    for i, lp in enumerate(out.logprobs):
        row = ref[len(out.prompt_token_ids) - 1 + i]
        assert lp.token_id == out.token_ids[i]
        assert math.isclose(lp.logprob, row[lp.token_id].item(), abs_tol=1e-4)
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()
        assert lp.top[0][0] == lp.token_id  # greedy picks the top token


def test_undetokenized_outputs_decode_to_the_engines_text(llm):
    """detokenize=False: the same tokens, no text from the engine, and detokenizer.decode rebuilds exactly the text
    the engine builds token by token (sampled tokens at temperature 2 split characters and hit special ids)."""
    from sluice.worker.engine.detokenizer import TokenText, decode

    prompts = PROMPTS * 4
    params = [SamplingParams(max_tokens=24, temperature=2.0, seed=i, ignore_eos=True) for i in range(len(prompts))]
    texts = llm.generate(prompts, params)
    for p in params:
        p.detokenize = False
    tokens = llm.generate(prompts, params)
    token_text = TokenText.of(llm.tokenizer)
    for with_text, without in zip(texts, tokens):
        assert without.text is None and without.token_ids == with_text.token_ids
        assert decode(llm.tokenizer, token_text, without.prompt_token_ids, without.token_ids) == with_text.text
    assert any(t.text for t in texts)


def test_detokenize_is_checked():
    with pytest.raises(ValueError, match="detokenize must be a boolean"):
        SamplingParams(detokenize="no")
    with pytest.raises(ValueError, match="stop strings need detokenize=True"):
        SamplingParams(stop=["."], detokenize=False)


def test_replayed_text_leaves_out_the_stop_token_as_the_engine_does(llm):
    """The worker's replay (Responses, detokenize=False) of a request that stopped on a stop token gives the text the
    engine gives detokenizing it: the stop token's own text left out."""
    from sluice.worker.translate import Responses

    free = llm.generate(PROMPTS[1], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    texts = [o.text for o in llm.generate([PROMPTS[1]] * 12, [SamplingParams(max_tokens=n, temperature=0,
                                                                             ignore_eos=True) for n in range(1, 13)])]
    at = next(i for i in range(1, 12) if texts[i] != texts[i - 1] and free.token_ids.index(free.token_ids[i]) == i)
    params = SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[free.token_ids[at]], ignore_eos=True)
    with_text = llm.generate(PROMPTS[1], params)[0]
    params.detokenize = False
    without = llm.generate(PROMPTS[1], params)[0]
    assert with_text.finish_reason == without.finish_reason == "stop" and without.text is None
    assert Responses(llm.tokenizer).generation(without).text == with_text.text == texts[at - 1]
