"""CPU placement and priority for a CPU engine beside its worker: disjoint CPUs, so neither preempts the other,
and a lower nice value, so that other processes of the host woken on the engine's CPUs mostly yield them. An OpenMP
parallel region waits for its slowest thread; one thread descheduled by the worker's Python stalls the whole
step (vLLM's CPU backend binds its OpenMP threads for the same reason, VLLM_CPU_OMP_THREADS_BIND)."""

from __future__ import annotations

import os
from collections.abc import Callable

# Pinning gives the engine CPUs that the worker stays off, but the kernel still wakes other processes there:
# Postgres backends, Redis and clients sharing the host preempted the queue bench's engine there, leaving it waiting
# in its run queue (bench/NOTES.md). At nice -10 they mostly yield it.
PINNED_ENGINE_NICE = -10


def split_cpus(threads: int) -> tuple[set[int], set[int]] | None:
    """(the worker's CPUs, the engine's CPUs): the engine takes the last `threads` this process may use, the
    worker keeps the rest; None when there is nothing to split."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) <= threads:
        return None
    return set(cpus[:-threads]), set(cpus[-threads:])


def pin_threads(cpus: set[int]) -> None:
    """Pin every thread of this process to `cpus`; threads started later inherit their creator's CPUs."""
    _each_thread(lambda tid: os.sched_setaffinity(tid, cpus))


def set_nice(nice: int) -> bool:
    """Give every thread of this process the nice value `nice` (threads started later inherit their creator's);
    False, and nothing changed, where that is not permitted: lowering it needs CAP_SYS_NICE."""
    try:
        _each_thread(lambda tid: os.setpriority(os.PRIO_PROCESS, tid, nice))
    except PermissionError:
        return False
    return True


def _each_thread(apply: Callable[[int], None]) -> None:
    """Call `apply` with the id of every thread of this process (settings such as CPUs and nice are per thread)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            apply(int(tid))
        except (ProcessLookupError, FileNotFoundError):  # the thread exited meanwhile
            pass
