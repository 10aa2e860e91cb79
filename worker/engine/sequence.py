"""Per-request state: tokens, progress through the KV cache, sampling state, timings."""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from sluice.worker.engine.sampling_params import SamplingParams

_arrival_order = itertools.count()


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprobs:
    """Logprob of the sampled token and the top-N alternatives at one position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    prompt: str | None = None
    order: int = field(default_factory=lambda: next(_arrival_order))
    token_ids: list[int] = field(init=False)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    pending_hashes: list[bytes] = field(default_factory=list)  # blocks it claimed to compute (BlockManager.claim)
    generator: torch.Generator | None = None
    matcher: Any = None  # its grammar's xgrammar GrammarMatcher (structured outputs; grammar.py)
    grammar: Any = None  # the compiled grammar the matcher runs, from which an n > 1 request's choices fork theirs
    finish_reason: str | None = None
    text: str | None = ""  # None: not detokenized (SamplingParams.detokenize)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # incremental detokenizer state: output tokens as strings, and offsets into them
    detok_tokens: list[str] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    gpu_seconds: float = 0.0
    num_preemptions: int = 0
    group: Any = None  # the Choices (choices.py) of an n > 1 request this sequence is the parent or a choice of
    lora: str | None = None  # the LoRA adapter it runs with (None: the base model)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def hash_root(self) -> bytes | None:
        """What its first block's prefix-cache hash chains from: an adapter's KV differs from the base model's."""
        return None if self.lora is None else hashlib.sha256(b"lora\0" + self.lora.encode()).digest()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_remaining(self) -> int:
        """Tokens whose K/V are not yet in the cache (1 for a decoding sequence)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def rank(self) -> tuple[int, int]:
        """Scheduling rank: lower priority value first, then first come first served."""
        return (self.priority, self.order)
