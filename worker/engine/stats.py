"""One engine step's own counts: what the live metrics and the efficiency windows add up, step by step."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepStats:
    """What one step did, counted for that step alone (never a running total), and the KV cache after it."""

    seconds: float  # the step's wall time
    num_seqs: int  # sequences scheduled
    num_tokens: int  # tokens scheduled, prefill and decode
    num_generated: int  # sequences that gained a token
    num_prefill_tokens: int  # prompt tokens computed (recomputation after a preemption included)
    num_decode_tokens: int
    num_preemptions: int
    prefix_cache_queries: int  # prompt tokens of the admitted sequences looked up in the prefix cache
    prefix_cache_hits: int  # of which found
    kv_blocks_used: int
