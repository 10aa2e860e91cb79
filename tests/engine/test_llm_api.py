"""The engine's public surface: step-level driving, rejection, abort, priority, chat, outputs and stats."""

from __future__ import annotations

import time

import pytest
import torch

from sluice.worker.engine import LLM, RequestRejected, SamplingParams
from sluice.worker.engine.sequence import Sequence

STATS_KEYS = {"num_steps", "num_prefill_tokens", "num_decode_tokens", "num_running", "num_waiting", "num_preemptions",
              "prefix_cache_queries", "prefix_cache_hits", "kv_blocks_total", "kv_blocks_used", "weight_bytes",
              "kv_cache_bytes"}


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), max_model_len=128, num_kv_blocks=64)


def drain(llm) -> dict:
    finished = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def test_step_level_engine_streams_progress(llm):
    llm.add_request("one two three", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), "a")
    llm.add_request([7, 8, 9], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), "b")
    seen: dict[str, list[int]] = {"a": [], "b": []}
    finished = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            assert out.token_ids[: len(seen[out.request_id])] == seen[out.request_id]
            seen[out.request_id] = out.token_ids
            if out.finished:
                finished[out.request_id] = out
    assert len(finished["a"].token_ids) == 5 and len(finished["b"].token_ids) == 3
    m = finished["a"].metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finish_time
    assert m.gpu_seconds > 0
    assert finished["a"].prompt == "one two three"
    assert finished["a"].prompt_token_ids == llm.tokenizer.encode("one two three")


def test_a_step_can_return_only_the_finished_requests(llm):
    """The worker's engine process streams nothing: it asks for finished outputs only, and gets the same ones."""
    def run(finished_only: bool) -> tuple[list, list[int]]:
        for i, n in enumerate((2, 5, 3)):
            llm.add_request([5 + i, 6, 7], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), f"r{i}")
        outs, generated = [], []
        while llm.has_unfinished_requests():
            outs += llm.step(finished_only=finished_only)
            generated.append(llm.last_step.num_generated)
        return outs, generated

    everything, generated = run(False)
    finished, generated_too = run(True)
    assert all(o.finished for o in finished) and len(finished) == 3 < len(everything)
    assert [(o.request_id, o.token_ids) for o in finished] == [(o.request_id, o.token_ids) for o in everything
                                                             if o.finished]
    assert generated == generated_too and sum(generated) == 2 + 5 + 3


def test_too_long_requests_are_rejected_and_others_go_on(llm):
    params = SamplingParams(max_tokens=100, temperature=0)
    with pytest.raises(RequestRejected, match=r"plus max_tokens \(100\) is .* more than max_model_len \(128\)"):
        llm.add_request(list(range(5, 60)), params)
    outs = llm.generate([list(range(5, 60)), "fine"], [params, SamplingParams(max_tokens=4, temperature=0)])
    assert outs[0].error and "max_model_len" in outs[0].error and outs[0].token_ids == []
    assert outs[1].error is None and outs[1].finish_reason in ("stop", "length")


def test_prompt_token_ids_outside_the_vocabulary_are_rejected(llm):
    vocab = llm.processor.model_config.vocab_size
    for bad in ([5, vocab], [-1, 5], [vocab + 100], [5, 6, -3, 7]):
        with pytest.raises(RequestRejected, match=rf"prompt token ids must be in \[0, {vocab}\)"):
            llm.add_request(bad, SamplingParams(max_tokens=2))
    llm.add_request([0, vocab - 1], SamplingParams(max_tokens=2))  # both ends are in it


def test_requests_that_could_never_fit_the_cache_are_rejected(llama_dir):
    small = LLM(str(llama_dir), num_kv_blocks=2, block_size=4)
    with pytest.raises(RequestRejected, match="needs 3 KV blocks; the cache has 2"):
        small.add_request(list(range(5, 10)), SamplingParams(max_tokens=4))
    with pytest.raises(RequestRejected, match="empty"):
        small.add_request([], SamplingParams())


def test_abort_frees_everything(llm):
    for i in range(4):
        llm.add_request(f"request {i}", SamplingParams(max_tokens=50, ignore_eos=True), f"abort-{i}")
    llm.step()
    llm.step()
    assert llm.abort("abort-1") and llm.abort("abort-3")
    assert not llm.abort("abort-3")
    finished = drain(llm)
    assert set(finished) == {"abort-0", "abort-2"}
    assert llm.stats()["kv_blocks_used"] == 0


def test_priority_runs_lower_values_first(llama_dir):
    one_at_a_time = LLM(str(llama_dir), max_num_seqs=1)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    for rid, prio in [("late-low", 5), ("first-high", 0), ("second-high", 0), ("mid", 2)]:
        one_at_a_time.add_request(f"prompt {rid}", params, rid, priority=prio)
    order = []
    while one_at_a_time.has_unfinished_requests():
        order += [o.request_id for o in one_at_a_time.step() if o.finished]
    assert order == ["first-high", "second-high", "mid", "late-low"]


def test_chat_applies_the_template(llm):
    conv = [{"role": "user", "content": "hello there"}]
    params = SamplingParams(max_tokens=6, temperature=0)
    out = llm.chat(conv, params)[0]
    templated = llm.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert templated.endswith("<|assistant|>\n")
    assert out.prompt_token_ids == llm.tokenizer.encode(templated, add_special_tokens=False)
    assert out.token_ids == llm.generate(out.prompt_token_ids, params)[0].token_ids
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    with_tools = llm.chat(conv, params, tools=tools)[0]
    rendered = llm.tokenizer.apply_chat_template(conv, tools=tools, tokenize=False, add_generation_prompt=True)
    assert '"name": "get_time"' in rendered
    assert with_tools.prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)


def test_text_drops_special_tokens_as_transformers_decode_does(llm, scripted_tokens):
    tokens = llm.tokenizer.encode("hi<|user|>\nhello<|assistant|> there<|system|>.", add_special_tokens=False)
    scripted_tokens(tokens)
    params = SamplingParams(max_tokens=len(tokens), ignore_eos=True)
    out = llm.chat([{"role": "user", "content": "hello there"}], params)[0]
    assert out.token_ids == tokens
    assert out.text == llm.tokenizer.decode(tokens, skip_special_tokens=True) == "hi\nhello there."


def test_stats_report_the_run(llm):
    before = llm.stats()
    assert STATS_KEYS <= set(before)
    llm.generate(["a b c d e f", "g h"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    after = llm.stats()
    assert after["num_decode_tokens"] - before["num_decode_tokens"] == 2 * 3
    assert after["num_prefill_tokens"] > before["num_prefill_tokens"]
    assert after["kv_blocks_total"] == 64 and after["kv_blocks_used"] == 0
    assert after["kv_cache_bytes"] == 2 * 2 * 64 * 16 * 2 * 16 * 4  # layers * K,V * blocks * bs * kv_heads * dim * 4
    assert after["weight_bytes"] > 0


@pytest.mark.parametrize("ago", [10.0, None])
def test_arrival_time_is_kept(llm, ago):
    t = 0.0 if ago is None else time.time() - ago  # 0.0 is a time, not "none given"
    llm.add_request("x", SamplingParams(max_tokens=1), "timed", arrival_time=t)
    assert drain(llm)["timed"].metrics.arrival_time == t


def test_kv_cache_memory_sets_the_number_of_blocks(llama_dir):
    per_block = 2 * 2 * 16 * 2 * 16 * 4  # K and V, layers, block_size, kv heads, head_dim, float32
    llm = LLM(str(llama_dir), kv_cache_memory=10 * per_block + 100)
    assert llm.stats()["kv_blocks_total"] == 10
    assert llm.stats()["kv_cache_bytes"] == 10 * per_block


@pytest.mark.parametrize("text", ["one two three", "", "  leading and trailing  ", "line\nbreaks\n\n",
                                  "unicode: naïve café ✓ 東京", "<|user|>\nspecial tokens inside<|assistant|>\n"])
def test_the_processor_tokenizes_as_transformers_does(llm, text):
    processor = llm.processor
    assert processor.tokenizer.backend_tokenizer is not None  # the fast path is the one under test
    assert processor.encode(text) == llm.tokenizer.encode(text)
    assert processor.token_ids(text, special=False) == llm.tokenizer.encode(text, add_special_tokens=False)
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": text or "hi"}]
    assert processor.encode_chat(conv) == llm.tokenizer.apply_chat_template(conv, add_generation_prompt=True,
                                                                           return_dict=False)


def test_the_last_layer_runs_only_the_sampled_rows(llm):
    """A prompt token's last-layer output is never read, only its K and V: the last layer's o_proj and MLP run on
    the sampled rows alone, and their hidden states are those of the whole forward's."""
    runner, bm = llm.runner, llm.block_manager
    decode, whole, partial = (Sequence(f"k{i}", [5 + (j * 7 + i) % 90 for j in range(n)], SamplingParams(), 0.0)
                              for i, n in enumerate((12, 17, 30)))
    bm.allocate(decode, 11)
    runner.run([(decode, 11)])  # its prompt but the last token is in the cache: that token is a decode row
    decode.num_computed_tokens = 11
    try:
        for seq, n in ((decode, 1), (whole, 17), (partial, 20)):
            bm.allocate(seq, n)
        for scheduled, sampled in (([(decode, 1), (whole, 17), (partial, 20)], [decode, whole]), ([(partial, 20)], [])):
            batch = runner.prepare(scheduled)
            assert batch.sample_seqs == sampled  # a prompt cut short by the token budget samples nothing
            with torch.inference_mode():
                everything = runner.model(batch.input_ids, batch.positions, runner.caches, batch.attention)
                kept = runner.model(batch.input_ids, batch.positions, runner.caches, batch.attention,
                                    keep=batch.logits_rows)
            assert kept.shape == (len(sampled), everything.shape[1])
            torch.testing.assert_close(kept, everything[batch.logits_rows], rtol=1e-5, atol=1e-5)
    finally:
        for seq in (decode, whole, partial):
            bm.free(seq)
    assert bm.num_used_blocks == 0


def test_outputs_pickle_whole(llm):
    """The engine's process sends outputs to the worker pickled, through their own __reduce__: every field back."""
    import pickle

    outs = llm.generate(["one", "two three"], SamplingParams(max_tokens=5, logprobs=2, detokenize=True))
    back = pickle.loads(pickle.dumps(outs))
    assert back == outs and back[1].metrics == outs[1].metrics and back[1].logprobs == outs[1].logprobs
    assert back[1].metrics.finish_time is not None and back[1].text == outs[1].text
