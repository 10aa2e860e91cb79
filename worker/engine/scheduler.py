"""Iteration-level scheduling: who runs in this step, with chunked prefill and preemption by recompute."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from sluice.worker.engine.block_manager import BlockManager
from sluice.worker.engine.config import EngineConfig
from sluice.worker.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """This step's work: each sequence with its number of new tokens."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    prefix_queries: int = 0
    prefix_hits: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_loras = config.max_loras  # distinct adapters among the running sequences: the device's slots
        self.prefill_first = config.scheduling_policy == "prefill_first"
        self.block_manager = block_manager
        self.waiting: list[tuple[tuple[int, int], Sequence]] = []  # aborted entries are dropped lazily
        self.num_waiting = 0
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        heapq.heappush(self.waiting, (seq.rank, seq))
        self.num_waiting += 1

    def finish(self, seq: Sequence) -> None:
        """Take a sequence out of scheduling for good (done or aborted) and give its blocks back."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.num_waiting -= 1
        seq.status = SequenceStatus.FINISHED
        self.block_manager.free(seq)

    def has_work(self) -> bool:
        return bool(self.running) or self.num_waiting > 0

    def schedule(self) -> SchedulerOutput:
        step = _Step(self, self.max_num_batched_tokens)
        if self.prefill_first:
            step.run_prefills()
            step.admit_waiting()
            step.run_decodes()
        else:
            step.run_decodes()
            step.run_prefills()
            step.admit_waiting()
        step.out.scheduled = list(step.scheduled.items())
        return step.out

    def preempt(self, seq: Sequence) -> None:
        """Give a running sequence's blocks back; it is recomputed from scratch when readmitted."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.add(seq)

    def peek_waiting(self) -> Sequence | None:
        while self.waiting and self.waiting[0][1].is_finished:
            heapq.heappop(self.waiting)
        return self.waiting[0][1] if self.waiting else None


class _Step:
    """Builds one step's schedule under the token budget."""

    def __init__(self, scheduler: Scheduler, budget: int):
        self.s = scheduler
        self.bm = scheduler.block_manager
        self.budget = budget
        self.scheduled: dict[Sequence, int] = {}
        self.out = SchedulerOutput()

    def run_decodes(self) -> None:
        for seq in sorted(self.s.running, key=lambda q: q.rank):
            if self._schedulable(seq) and seq.num_remaining == 1:
                self._schedule_running(seq, 1)

    def run_prefills(self) -> None:
        for seq in sorted(self.s.running, key=lambda q: q.rank):
            if self._schedulable(seq) and seq.num_remaining > 1:
                self._schedule_running(seq, min(seq.num_remaining, self.budget))

    def _schedulable(self, seq: Sequence) -> bool:
        """Budget left, and the sequence still running (not preempted this step) and not yet scheduled."""
        return bool(self.budget) and seq.status is SequenceStatus.RUNNING and seq not in self.scheduled

    def admit_waiting(self) -> None:
        if self.out.preempted:  # memory is short: admitting now would only thrash
            return
        adapters = {seq.lora for seq in self.s.running} - {None}
        skipped: list[Sequence] = []  # waiting for an adapter slot: passed over, not dropped
        while self.budget and len(self.s.running) < self.s.max_num_seqs:
            seq = self.s.peek_waiting()
            if seq is None:
                break
            if seq.lora is not None and seq.lora not in adapters and len(adapters) >= self.s.max_loras:
                skipped.append(heapq.heappop(self.s.waiting)[1])
                continue
            forked = bool(seq.block_table)  # a forked choice comes with its prompt's shared blocks computed
            cached = seq.num_computed_tokens if forked else self.bm.match_prefix(seq)
            if not forked and self.bm.waits_for_pending(seq):  # a running sibling is computing its next block
                self.bm.free(seq)
                skipped.append(heapq.heappop(self.s.waiting)[1])
                continue
            seq.num_computed_tokens = cached
            n = min(seq.num_remaining, self.budget, self.bm.tokens_that_fit(seq))
            if n <= 0:
                self.bm.free(seq)
                seq.num_computed_tokens = 0
                break
            if seq.lora is not None:
                adapters.add(seq.lora)
            heapq.heappop(self.s.waiting)
            self.s.num_waiting -= 1
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = cached
            if not forked:
                self.out.prefix_queries += seq.num_tokens
                self.out.prefix_hits += cached
            seq.status = SequenceStatus.RUNNING
            self.s.running.append(seq)
            self._take(seq, n)
            if not forked:
                self.bm.claim(seq)
        for seq in skipped:
            heapq.heappush(self.s.waiting, (seq.rank, seq))

    def _schedule_running(self, seq: Sequence, n: int) -> None:
        """Schedule n tokens of a running sequence, preempting later-ranked ones when blocks run out."""
        if self.bm.holds(seq, n):
            self._take(seq, n)
            return
        while True:
            n_fit = min(n, self.bm.tokens_that_fit(seq))
            if n_fit > 0:
                self._take(seq, n_fit)
                return
            victim = max(self.s.running, key=lambda q: q.rank)
            self._preempt(victim)
            if victim is seq:
                return

    def _preempt(self, seq: Sequence) -> None:
        self.budget += self.scheduled.pop(seq, 0)
        self.s.preempt(seq)
        self.out.preempted.append(seq)

    def _take(self, seq: Sequence, n: int) -> None:
        self.bm.allocate(seq, n)
        self.scheduled[seq] = n
        self.budget -= n
