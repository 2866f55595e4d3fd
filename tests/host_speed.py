"""How fast this host runs Python, so that a suite's wall time can be compared across hosts.

``make test`` has a time budget "on this 2-core machine", but the machines differ: on one
host ``import torch`` took 1.0 s of CPU, on another of the same kind 3.1-3.5 s, and the
whole suite's CPU moved with it (~640 s against ~1,900 s). A wall time quoted without the
host's speed cannot be compared with the next one. So every run prints, at its end, the
CPU seconds of a fixed pure-Python workload measured before the workers start (the best of
three, on an idle host: the least disturbed reading) beside the CPU the whole run used
(pytest, its workers, and every process they waited for).
"""

from __future__ import annotations

import resource
import time

#: Repeats of the workload; the fastest counts (anything else the host did only slows it).
_REPEATS = 3


def _workload() -> int:
    """Interpreter work of the kind the suite does: arithmetic, dicts, strings, calls."""
    table: dict[str, int] = {}
    total = 0
    for i in range(200_000):
        key = f"k{i % 512}"
        table[key] = table.get(key, 0) + i
        total += len(key) * (i & 7)
    return total + sum(table.values())


def reference_s(repeats: int = _REPEATS) -> float:
    """CPU seconds of one :func:`_workload`, the fastest of ``repeats``."""
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        _workload()
        best = min(best, time.process_time() - start)
    return best


def run_cpu_s() -> float:
    """CPU seconds of this process and of every child it (or theirs) waited for."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def summary(reference: float, cpu_s: float) -> str:
    """The line a run ends with (pytest's own line gives the wall time)."""
    return (
        f"host speed: reference workload {reference * 1000:.0f} ms of CPU (tests/host_speed.py);"
        f" this run used {cpu_s:.0f} s of CPU (pytest, its workers and their children)"
    )
