"""Efficiency windows: an engine's steps summed over a span of time, how full they ran, and the window's table row."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from sluice.worker.engine.stats import StepStats

if TYPE_CHECKING:
    from sluice.api.tables import EfficiencyWindow as EfficiencyWindowRow


@dataclass
class EfficiencyWindow:
    """Batch efficiency over [start, end): the sum of the steps run in it, against the engine's limits."""

    start: float
    max_num_seqs: int
    max_num_batched_tokens: int
    num_kv_blocks: int
    end: float = 0.0
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    scheduled_tokens: int = 0
    running_sum: int = 0  # sequences scheduled, summed over the steps
    max_running: int = 0
    kv_blocks_used_sum: int = 0
    preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    busy_seconds: float = 0.0

    def add(self, step: StepStats) -> None:
        self.steps += 1
        self.prefill_tokens += step.num_prefill_tokens
        self.decode_tokens += step.num_decode_tokens
        self.scheduled_tokens += step.num_tokens
        self.running_sum += step.num_seqs
        self.max_running = max(self.max_running, step.num_seqs)
        self.kv_blocks_used_sum += step.kv_blocks_used
        self.preemptions += step.num_preemptions
        self.prefix_cache_queries += step.prefix_cache_queries
        self.prefix_cache_hits += step.prefix_cache_hits
        self.busy_seconds += step.seconds

    def _per_step(self, total: float) -> float:
        return total / self.steps if self.steps else 0.0

    @property
    def mean_running(self) -> float:
        return self._per_step(self.running_sum)

    @property
    def occupancy(self) -> float:
        return self.mean_running / self.max_num_seqs if self.max_num_seqs else 0.0

    @property
    def token_budget_use(self) -> float:
        """Mean scheduled tokens of a step over max_num_batched_tokens."""
        return self._per_step(self.scheduled_tokens) / self.max_num_batched_tokens

    @property
    def kv_cache_use(self) -> float:
        """Mean used KV blocks of a step over all blocks."""
        return self._per_step(self.kv_blocks_used_sum) / self.num_kv_blocks

    @property
    def idle_seconds(self) -> float:
        return max(self.end - self.start - self.busy_seconds, 0.0)

    def to_row(self, worker_id: str, model: str) -> EfficiencyWindowRow:
        """The window as the worker stores it; `model`: the served model name."""
        # imported here: the engine process builds windows and would otherwise load SQLAlchemy for nothing
        from sluice.api.tables import EfficiencyWindow as EfficiencyWindowRow

        return EfficiencyWindowRow(
            worker_id=worker_id, model=model, window_start=self.start, window_end=self.end, steps=self.steps,
            prefill_tokens=self.prefill_tokens, decode_tokens=self.decode_tokens, mean_running_seqs=self.mean_running,
            max_running_seqs=self.max_running, max_num_seqs=self.max_num_seqs, token_budget_use=self.token_budget_use,
            kv_cache_use=self.kv_cache_use, preemptions=self.preemptions,
            prefix_cache_queries=self.prefix_cache_queries, prefix_cache_hits=self.prefix_cache_hits,
            busy_seconds=self.busy_seconds, idle_seconds=self.idle_seconds)
