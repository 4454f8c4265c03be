"""CPU time of this process's threads by name, from Linux's /proc: where a window's cycles went.

A step that takes longer while a checkpoint is written either did more work (its threads'
CPU time per step grew: cache or memory-bus contention) or got less of the cores (another
thread ran instead). Comparing the compute threads' time per step in a quiet and a busy window
tells the two apart. Off Linux the snapshots are empty and the benchmark leaves those lines out.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

TASKS = Path("/proc/self/task")
CpuTimes = dict[str, tuple[float, float]]  # thread name -> (user seconds, system seconds)
Snapshot = dict[str, tuple[str, float, float]]  # thread id -> (name, user s, system s)


def snapshot() -> Snapshot:
    """User and system CPU seconds so far of every live thread."""
    if not TASKS.is_dir():
        return {}
    ticks = os.sysconf("SC_CLK_TCK")
    threads = {}
    for task in TASKS.iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        # utime and stime: fields 14 and 15 of proc(5), counted from the state (field 3).
        threads[task.name] = (name, int(fields[11]) / ticks, int(fields[12]) / ticks)
    return threads


def spent(before: Snapshot, after: Snapshot) -> CpuTimes:
    """CPU seconds used between two snapshots, summed by thread name. Threads born since
    count from zero; a thread that ended meanwhile is missing, with its time."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for thread, (name, user, system) in after.items():
        _, user_before, system_before = before.get(thread, (name, 0.0, 0.0))
        totals[name][0] += user - user_before
        totals[name][1] += system - system_before
    return {name: (user, system) for name, (user, system) in totals.items()}
