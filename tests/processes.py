"""Where a process's threads may run and at what nice value, read from /proc: the CPU pinning tests of the
bridge and of `sluice serve`."""

from __future__ import annotations

import os
from pathlib import Path


def thread_cpus(pid: int) -> set[frozenset[int]]:
    """The distinct CPU sets of the process's threads."""
    return {frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{pid}/task")}


def thread_nices(pid: int) -> set[int]:
    """The distinct nice values of the process's threads."""
    return {os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


def engine_child(pid: int) -> int:
    """The engine's process among `pid`'s children (multiprocessing's resource tracker is one too)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    spawned = [int(c) for c in children if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text()]
    assert len(spawned) == 1, children
    return spawned[0]
