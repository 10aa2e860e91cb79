"""Seeded sampling under every scheduling regime, block accounting after aborts, and the limits of SamplingParams."""

from __future__ import annotations

import random

import pytest

from sluice.worker.engine import LLM, SamplingParams


def _prompts(n: int, seed: int, prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(5, 500) for _ in range(prefix)]
    return [shared + [rng.randrange(5, 500) for _ in range(rng.randrange(5, 40))] for _ in range(n)]


def _all_blocks_free(llm: LLM) -> bool:
    bm = llm.block_manager
    return bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_a_seed_torch_cannot_take_is_refused_by_sampling_params(seed):
    """Before, SamplingParams took it and add_request failed inside torch.Generator.manual_seed ("Overflow when
    unpacking long long"), an error naming no field, after the earlier prompts of a generate() were queued."""
    with pytest.raises(ValueError, match="seed must be an integer in"):
        SamplingParams(seed=seed)


def test_the_extreme_seeds_run(llama_dir):
    llm = LLM(str(llama_dir), num_kv_blocks=16)
    outs = llm.generate([[5, 6, 7]] * 2, [SamplingParams(max_tokens=3, seed=s) for s in (-(2**63), 2**64 - 1)])
    assert all(len(o.token_ids) == 3 for o in outs)


def test_seeded_sampling_ignores_batching_preemption_chunking_and_prefix_hits(llama_dir):
    """A seeded request's tokens are its own: alone, batched with others under a tiny cache (preempted and
    recomputed), prefilled in chunks, and with its prefix served from the cache."""
    target, *others = _prompts(9, seed=1, prefix=20)
    params = SamplingParams(max_tokens=16, temperature=0.9, top_k=40, top_p=0.9, min_p=0.01, seed=7, ignore_eos=True)
    noise = [SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True) for _ in others]
    alone = LLM(str(llama_dir), enable_prefix_caching=False).generate([target], [params])[0].token_ids

    pressured = LLM(str(llama_dir), num_kv_blocks=10, block_size=8, max_num_batched_tokens=7)
    outs = pressured.generate([*others, target], [*noise, params])
    assert pressured.stats()["num_preemptions"] > 0 and outs[-1].metrics.num_preemptions > 0
    assert outs[-1].token_ids == alone
    assert _all_blocks_free(pressured)

    cached = LLM(str(llama_dir), block_size=8)
    cached.generate([target[:24] + [1]], SamplingParams(max_tokens=1, temperature=0))
    hit = cached.generate([target], [params])[0]
    assert hit.num_cached_tokens == 24 and hit.token_ids == alone


def test_aborts_mid_prefill_and_mid_decode_free_every_block(llama_dir):
    llm = LLM(str(llama_dir), block_size=4, num_kv_blocks=40, max_num_batched_tokens=6)
    prompts = _prompts(4, seed=2, prefix=12)
    ids = [llm.add_request(p, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)) for p in prompts]
    llm.step()  # the first prompt is part-way through its prefill
    first = llm.requests[ids[0]]
    assert 0 < first.num_computed_tokens < first.num_prompt_tokens
    llm.abort(ids[0])
    while not any(len(llm.requests[i].output_token_ids) > 2 for i in ids[1:]):
        llm.step()
    for i in ids[1:]:
        llm.abort(i)
    assert not llm.has_unfinished_requests()
    assert _all_blocks_free(llm)
    assert llm.reset_prefix_cache() and len(llm.block_manager.free_ids) == llm.block_manager.num_blocks
