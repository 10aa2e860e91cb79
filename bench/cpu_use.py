"""Where a bench run's CPU went: CPU-seconds per process from /proc, grouped, over a measured window.

Linux only (reads /proc/PID/stat and /proc/stat); on a 2-core machine the service and its engine share the CPUs, so
the split says which side a slower run lost its time to.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


@dataclass
class Snapshot:
    by_pid: dict[int, tuple[str, float]]  # pid -> (command name, CPU-seconds so far)
    busy: float  # CPU-seconds all CPUs spent not idle, whoever ran


def snapshot() -> Snapshot:
    by_pid = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # exited meanwhile
                continue
            name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
            by_pid[int(entry.name)] = (name, (int(fields[11]) + int(fields[12])) / TICK)  # utime + stime
    cpu = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return Snapshot(by_pid, (cpu[0] + cpu[1] + cpu[2] + cpu[5] + cpu[6]) / TICK)  # user nice system irq softirq


def split(before: Snapshot, after: Snapshot, groups: dict[str, set[int]]) -> dict[str, float]:
    """CPU-seconds between the snapshots: for each group of pids, for Postgres and Redis by command name, and for
    everything else (kernel threads, other processes); a process that started in between counts from zero."""
    used = {pid: cpu - before.by_pid.get(pid, ("", 0.0))[1] for pid, (_, cpu) in after.by_pid.items()}
    out = {name: sum(used.get(pid, 0.0) for pid in pids) for name, pids in groups.items()}
    named = set().union(*groups.values())
    for label, prefix in (("Postgres", "postgres"), ("Redis", "redis-server")):
        out[label] = sum(v for pid, v in used.items() if pid not in named and after.by_pid[pid][0].startswith(prefix))
    out["other"] = max(after.busy - before.busy - sum(out.values()), 0.0)
    return out
