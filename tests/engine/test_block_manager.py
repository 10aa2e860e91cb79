"""Block manager: growth-time allocation, prefix sharing with verification, LRU eviction, no leaks."""

from __future__ import annotations

from sluice.worker.engine.block_manager import BlockManager
from sluice.worker.engine.sampling_params import SamplingParams
from sluice.worker.engine.sequence import Sequence

BS = 4


def seq(tokens: list[int]) -> Sequence:
    return Sequence("r", tokens, SamplingParams(), 0.0)


def run_prefill(bm: BlockManager, s: Sequence) -> None:
    """What the scheduler and engine do for a whole prompt: match, allocate, compute, commit."""
    s.num_computed_tokens = bm.match_prefix(s)
    bm.allocate(s, s.num_remaining)
    s.num_computed_tokens = s.num_tokens
    bm.commit_full_blocks(s)


def test_blocks_are_allocated_only_as_the_sequence_grows():
    bm = BlockManager(8, BS)
    s = seq(list(range(5)))
    bm.allocate(s, 3)
    assert len(s.block_table) == 1
    s.num_computed_tokens = 3
    bm.allocate(s, 1)
    assert len(s.block_table) == 1
    s.num_computed_tokens = 4
    bm.allocate(s, 1)
    assert len(s.block_table) == 2
    assert bm.num_free_blocks == 6
    bm.free(s)
    assert bm.num_free_blocks == 8 and all(b.ref_count == 0 for b in bm.blocks)


def test_what_fits_a_sequence_counts_its_own_blocks_and_the_free_ones():
    bm = BlockManager(4, BS)
    s = seq(list(range(6)))
    bm.allocate(s, 6)  # two blocks, two free slots in the second
    s.num_computed_tokens = 6
    assert bm.holds(s, 2) and not bm.holds(s, 3)
    assert bm.tokens_that_fit(s) == 2 + 2 * BS
    bm.allocate(seq(list(range(8))), 8)
    assert bm.tokens_that_fit(s) == 2


def test_shared_prefix_is_reused_with_reference_counts():
    bm = BlockManager(8, BS)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    run_prefill(bm, a)
    b = seq([1, 2, 3, 4, 5, 6, 7, 8, 42, 43])
    hit = bm.match_prefix(b)
    assert hit == 8
    assert b.block_table == a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in b.block_table] == [2, 2]
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8


def test_last_token_is_never_served_from_cache():
    bm = BlockManager(8, BS)
    run_prefill(bm, seq([1, 2, 3, 4, 5, 6, 7, 8]))
    again = seq([1, 2, 3, 4, 5, 6, 7, 8])
    assert bm.match_prefix(again) == 4  # the second block holds the last token: it must be recomputed


def test_hit_requires_identical_tokens_even_when_hashes_collide(monkeypatch):
    import sluice.worker.engine.block_manager as module

    monkeypatch.setattr(module, "chain_hash", lambda parent, tokens: 0)  # every block collides
    bm = BlockManager(8, BS)
    run_prefill(bm, seq([1, 2, 3, 4, 5]))
    other = seq([9, 9, 9, 9, 5])
    assert bm.match_prefix(other) == 0


# two 4-token blocks with equal Python hash() (CPython's tuple hash), found by a birthday search in seconds
COLLIDING = ([14571, 58961, 60645, 8234], [36695, 53933, 28465, 0])


def test_a_block_computed_after_a_colliding_prefix_is_never_a_hit():
    bm = BlockManager(8, BS)
    a, b = COLLIDING
    run_prefill(bm, seq([*a, 7]))
    run_prefill(bm, seq([*b, 1, 2, 3, 4, 9]))  # its second block's K/V were computed after b, not a
    assert bm.match_prefix(seq([*a, 1, 2, 3, 4, 11])) == BS  # only the first block is a's


def test_unreferenced_cached_blocks_are_evicted_least_recently_used_first():
    bm = BlockManager(4, BS)
    a = seq([1, 2, 3, 4, 0])
    run_prefill(bm, a)
    b = seq([5, 6, 7, 8, 0])
    run_prefill(bm, b)
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 4
    # two plain blocks are free; a third allocation must evict a's cached block (older than b's)
    c = seq(list(range(100, 111)))
    bm.allocate(c, 11)
    assert bm.match_prefix(seq([1, 2, 3, 4, 0])) == 0
    d = seq([5, 6, 7, 8, 0])
    assert bm.match_prefix(d) == 4
    bm.free(c)
    bm.free(d)
    assert bm.num_free_blocks == 4 and all(blk.ref_count == 0 for blk in bm.blocks)


def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    run_prefill(bm, seq([1, 2, 3, 4, 5]))
    assert bm.match_prefix(seq([1, 2, 3, 4, 5])) == 0


def test_reset_prefix_cache_forgets_prefixes_only_when_no_blocks_are_held():
    bm = BlockManager(8, BS)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    run_prefill(bm, a)
    assert not bm.reset_prefix_cache()  # a still holds its blocks
    bm.free(a)
    assert bm.reset_prefix_cache()
    assert bm.num_free_blocks == 8 and not bm.evictable and not bm.hash_to_block
    assert bm.match_prefix(seq([1, 2, 3, 4, 5, 6, 7, 8, 9])) == 0
