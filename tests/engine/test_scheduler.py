"""The scheduler alone: step order under a small token budget, priority, and who is preempted when blocks run out."""

from __future__ import annotations

import pytest

from sluice.worker.engine.block_manager import BlockManager
from sluice.worker.engine.config import EngineConfig
from sluice.worker.engine.sampling_params import SamplingParams
from sluice.worker.engine.scheduler import Scheduler, SchedulerOutput
from sluice.worker.engine.sequence import Sequence, SequenceStatus


def scheduler(num_blocks: int = 64, block_size: int = 4, **config) -> Scheduler:
    return Scheduler(EngineConfig(model="unused", block_size=block_size, **config),
                     BlockManager(num_blocks, block_size, enable_prefix_caching=False))


def add(s: Scheduler, prompt_len: int, priority: int = 0) -> Sequence:
    seq = Sequence(f"r{len(s.running) + s.num_waiting}", list(range(5, 5 + prompt_len)), SamplingParams(), 0.0,
                   priority)
    s.add(seq)
    return seq


def advance(plan: SchedulerOutput) -> None:
    """What the engine does after the forward: the scheduled tokens are in the cache, and a sequence whose every
    token is now computed samples one more (so it decodes next)."""
    for seq, n in plan.scheduled:
        seq.num_computed_tokens += n
        if seq.num_remaining == 0:
            seq.token_ids.append(1)


@pytest.mark.parametrize("policy, expected", [
    ("decode_first", lambda a, b: [(a, 1), (b, 3)]),  # the decode first, the prefill takes what budget is left
    ("prefill_first", lambda a, b: [(b, 4)]),  # the prefill takes the whole budget: the decode waits a step
])
def test_the_policy_orders_decodes_and_prefills_under_the_budget(policy, expected):
    s = scheduler(max_num_batched_tokens=4, scheduling_policy=policy)
    a, b = add(s, 2), add(s, 10)
    first = s.schedule()
    assert first.scheduled == [(a, 2), (b, 2)]  # both admitted, b's prompt cut short by the budget
    advance(first)
    assert (a.num_remaining, b.num_remaining) == (1, 8)  # a decodes now, b is mid-prefill
    assert s.schedule().scheduled == expected(a, b)


def test_decode_first_admits_waiting_requests_with_the_budget_left():
    s = scheduler(max_num_batched_tokens=4)
    a = add(s, 3)
    advance(s.schedule())
    b = add(s, 10)
    assert s.schedule().scheduled == [(a, 1), (b, 3)]


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    s = scheduler(max_num_seqs=2)
    low, first, second = add(s, 3, priority=1), add(s, 3), add(s, 3)  # low came first, ranks last
    assert s.schedule().scheduled == [(first, 3), (second, 3)]
    assert low.status is SequenceStatus.WAITING and s.num_waiting == 1


@pytest.mark.parametrize("priorities, victim", [((0, 0), 1), ((1, 0), 0)])
def test_the_latest_ranked_running_sequence_is_preempted(priorities, victim):
    """Four 2-token blocks, two 3-token prompts: both decode in their second blocks, then both need a third."""
    s = scheduler(num_blocks=4, block_size=2)
    seqs = [add(s, 3, priority=p) for p in priorities]
    for _ in range(2):
        plan = s.schedule()
        assert not plan.preempted
        advance(plan)
    plan = s.schedule()
    kept = seqs[1 - victim]
    assert plan.preempted == [seqs[victim]] and plan.scheduled == [(kept, 1)]
    assert seqs[victim].status is SequenceStatus.WAITING and seqs[victim].num_computed_tokens == 0
    assert not seqs[victim].block_table and len(kept.block_table) == 3


def test_a_sequence_short_of_blocks_that_ranks_last_preempts_itself():
    """Ranked last though admitted first: its next token needs a block that is not there, so it gives its own blocks
    back rather than take those of the sequence ranked before it, whose next token fits the blocks it has."""
    s = scheduler(num_blocks=4, block_size=2)
    low = add(s, 3, priority=1)
    advance(s.schedule())  # two blocks; its next token fits the second
    high = add(s, 3)
    plan = s.schedule()
    assert plan.scheduled == [(low, 1), (high, 3)]  # the cache is full now
    advance(plan)
    plan = s.schedule()
    assert plan.scheduled == [(high, 1)] and plan.preempted == [low]
    assert high.status is SequenceStatus.RUNNING and low.status is SequenceStatus.WAITING
