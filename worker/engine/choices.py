"""n > 1 (parallel sampling): one request's choices, forked from a single prefill of its prompt."""

from __future__ import annotations

from dataclasses import dataclass, field

from sluice.worker.engine.sampling_params import SEED_RANGE, SamplingParams
from sluice.worker.engine.sequence import Sequence

MAX_N = 128


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice i's seed: seed + i, as vLLM seeds its child requests, wrapped into what torch.Generator takes."""
    if seed is None:
        return None
    s = seed + index
    return s - 2**64 if s > SEED_RANGE[1] else s


@dataclass(eq=False)
class Choices:
    """A request with n > 1. `parent` prefills the prompt's full blocks once and never samples; at the fork every
    choice takes those blocks by reference and computes the rest of the prompt (at most a block) itself, so no
    partial block is ever shared and nothing needs copying on write."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int
    lora: str | None = None  # the adapter every sequence of it runs with
    parent: Sequence | None = None  # None once forked, or when the prompt has no full block to share
    choices: list[Sequence] = field(default_factory=list)
    # the parent's share of the request: its prefix-cache hits, step time and preemptions
    num_cached_tokens: int = 0
    gpu_seconds: float = 0.0
    num_preemptions: int = 0

    @property
    def is_finished(self) -> bool:
        return self.parent is None and all(c.is_finished for c in self.choices)

    def sequences(self) -> list[Sequence]:
        return ([self.parent] if self.parent is not None else []) + self.choices

    def take_parent(self) -> Sequence:
        """Detach the prefilled parent, keeping its share of the request's figures."""
        parent, self.parent = self.parent, None
        self.num_cached_tokens, self.gpu_seconds = parent.num_cached_tokens, parent.gpu_seconds
        self.num_preemptions = parent.num_preemptions
        return parent
