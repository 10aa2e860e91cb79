"""Decode buckets: contiguous, at least DECODE_BUCKET rows, larger only within the byte budget."""

from __future__ import annotations

import random

from sluice.worker.engine.attention import BUCKET_BYTES, DECODE_BUCKET, bucket_ends


def check(context_lens: list[int], block_size: int, token_bytes: int) -> list[int]:
    ends = bucket_ends(context_lens, block_size, token_bytes)
    starts = [0, *ends[:-1]]
    assert ends[-1] == len(context_lens) and all(a < b for a, b in zip(starts, ends))
    for a, b in zip(starts, ends):
        if b - a > DECODE_BUCKET:  # grown past the minimum: its K and V, padded to whole blocks, fit the budget
            assert (b - a) * -(-context_lens[b - 1] // block_size) * block_size * token_bytes <= BUCKET_BYTES
        if b < len(context_lens):  # a full bucket: the minimum, or one more row would not have fit
            assert b - a >= DECODE_BUCKET
            grown = (b + 1 - a) * -(-context_lens[b] // block_size) * block_size * token_bytes
            assert b - a == DECODE_BUCKET or grown > BUCKET_BYTES
    return ends


def test_buckets_cover_every_row_within_the_budget():
    rng = random.Random(0)
    for _ in range(200):
        lens = sorted(rng.randrange(1, 3000) for _ in range(rng.randrange(1, 300)))
        check(lens, rng.choice([8, 16, 32]), rng.choice([256, 2048, 8192]))


def test_long_contexts_keep_the_minimum_and_short_ones_share_a_bucket():
    # the bench Llama (4 KV heads of 64 float32: 2 KiB of K and V per token) at 330 tokens: 8 rows a bucket
    assert bucket_ends([330] * 64, 16, 2048) == [8 * i for i in range(1, 9)]
    # the demo model (2 KV heads of 16: 256 bytes per token): 250 rows at 32 tokens fit one bucket; at 40 tokens
    # (3 blocks, 12 KiB a row) 170 rows fill 2 MiB
    assert bucket_ends([32] * 250, 16, 256) == [250]
    assert bucket_ends([40] * 250, 16, 256) == [170, 250]
    assert bucket_ends([5] * 3, 16, 2048) == [3]
