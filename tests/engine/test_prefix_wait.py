"""A shared prefix is computed once however its requests arrive: a waiting request whose next block a running one
is computing waits for that block instead of computing it beside it (then finds it in the prefix cache)."""

from __future__ import annotations

import pytest

from sluice.worker.engine import LLM, SamplingParams
from sluice.worker.engine.block_manager import BlockManager
from sluice.worker.engine.sampling_params import SamplingParams as Params
from sluice.worker.engine.sequence import Sequence

PREFIX = [5 + (i * 7) % 200 for i in range(64)]  # four blocks of 16
SUFFIXES = [[300 + i, 301 + i, 302, 303, 304 + i] for i in range(8)]


@pytest.mark.parametrize("budget", [4096, 16], ids=["one-step", "chunked"])
def test_siblings_arriving_together_compute_the_prefix_once(llama_dir, budget):
    llm = LLM(str(llama_dir), block_size=16, max_num_batched_tokens=budget)
    params = SamplingParams(max_tokens=4, temperature=0)
    outs = llm.generate([PREFIX + s for s in SUFFIXES], params)
    stats = llm.stats()
    # the first computes the prefix and its suffix; each sibling only its own 5 tokens
    assert stats["num_prefill_tokens"] == len(PREFIX) + 5 * len(SUFFIXES)
    assert stats["prefix_cache_hits"] == len(PREFIX) * (len(SUFFIXES) - 1)
    alone = LLM(str(llama_dir), block_size=16, enable_prefix_caching=False)
    assert [o.token_ids for o in outs] == [alone.generate([PREFIX + s], params)[0].token_ids for s in SUFFIXES]
    assert not llm.block_manager.pending


def test_without_prefix_caching_nobody_waits(llama_dir):
    llm = LLM(str(llama_dir), block_size=16, enable_prefix_caching=False)
    llm.generate([PREFIX + s for s in SUFFIXES], SamplingParams(max_tokens=2, temperature=0))
    assert llm.stats()["num_prefill_tokens"] == (len(PREFIX) + 5) * len(SUFFIXES)


def _seq(name: str, tokens: list[int]) -> Sequence:
    return Sequence(name, tokens, Params(), 0.0)


def test_a_claim_is_released_when_its_sequence_leaves_without_committing():
    bm = BlockManager(32, 4)
    owner, sibling = _seq("owner", list(range(20))), _seq("sibling", list(range(20)) + [99])
    bm.allocate(owner, 20)
    bm.claim(owner)
    assert len(bm.pending) == 5 and bm.waits_for_pending(sibling)
    bm.free(owner)  # preempted or aborted before its blocks were committed
    assert not bm.pending and not owner.pending_hashes and not bm.waits_for_pending(sibling)
    other_adapter = _seq("lora", list(range(20)) + [99])
    other_adapter.lora = "a"
    bm.allocate(owner, 20)
    bm.claim(owner)
    assert not bm.waits_for_pending(other_adapter)  # another adapter's KV is not this prefix
    owner.num_computed_tokens = 20
    bm.commit_full_blocks(owner)
    assert not bm.pending and bm.match_prefix(sibling) == 20
