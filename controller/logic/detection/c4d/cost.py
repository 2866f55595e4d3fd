"""What a straggler costs the job: the time the other ranks waited for it, per step.

Two numbers come from it. ``extra_s`` (how much of a rise in the job's communication time a
straggler may explain) is its extra compute over what it takes when healthy: its peers'
median compute in the step (or, alone in its group, its own history's), never the whole
group's median. With two ranks that median is the mean of the straggler and its peer, so a
30 ms delay read as ~45 ms; a rank alone was referred to its own (slow) compute, ~55 ms.

The step cost is what the job lost, which can be less than the rank's extra compute: where
another rank arrives later anyway (a slower pipeline stage, the slowest healthy rank of a
big jittery group) the job waits for that one. Every rank leaves a synchronous collective
together, so the least wait of the *other* ranks less the rank's own is how long after the
next-to-last rank it arrived: the time the job waited for it alone, at most its extra
compute (healthy, it would have arrived that much earlier). Measured per step from the
summaries, no model of the layout needed. Other suspects (flagged or open stragglers as of
the step before) are not counted as "other ranks": four slow ranks of a node would each
hide behind the other three and cost ~0, while the job waits for them all.

Simulated (``tests/controller/c4d/test_straggler_cost.py``, 2 stages x 2 replicas, one
collective a step over the job, rank 1 +30 ms): stages of 50 and 80 ms, extra 44.5 ms and
cost 42% before, 33.7 ms (30 ms and the noise margin) and 0% now, the job losing 0.5%;
stages of 50 and 60 ms, cost 43% before and 21.6% now, the job losing 21.8%.

Blind spot: where the waits sum many collectives of different groups (p2p between stages),
a wait the rank had to spare before its delay is read as slack, which holds for one
collective a step and approximately beyond it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection, Hashable, Iterable, Mapping
from dataclasses import dataclass

from controller.logic.detection.c4d.robust import fmedian
from trainguard.wire import StepSummary


@dataclass(frozen=True, slots=True)
class LeastWaits:
    """The two least waits of one step among the job's unsuspected ranks."""

    #: The rank with the least wait (None: no rank in the pool).
    rank: int | None
    first_s: float
    second_s: float

    def other_than(self, rank: int) -> float:
        """The least wait of any rank but ``rank`` (inf: no other rank)."""
        return self.second_s if rank == self.rank else self.first_s


def least_waits(rows: Mapping[int, StepSummary], suspects: Collection[int]) -> LeastWaits:
    """The step's least waits, stragglers suspected the step before left out (all ranks
    where that leaves fewer than two)."""
    pool = [s for r, s in rows.items() if r not in suspects]
    if len(pool) < 2:
        pool = list(rows.values())
    best: tuple[float, int | None] = (math.inf, None)
    second = math.inf
    for s in pool:
        w = s.collective_wait_s
        if w < best[0]:
            best, second = (w, s.rank), best[0]
        elif w < second:
            second = w
    return LeastWaits(best[1], best[0], second)


def held_s(compute_s: float, expected_s: float, wait_s: float, others_s: float) -> float:
    """Seconds the job waited for this rank in one step: how long after every other rank
    it arrived, at most its compute beyond what it takes when healthy."""
    return max(0.0, min(compute_s - expected_s, others_s - wait_s))


def window_cost(held: deque[float], step_s: deque[float], window_steps: int) -> float:
    """Share of each step the job waits for a rank: the median over its window of the
    seconds it held the job (padded with zeros like its score, so a window not yet full
    does not read a warm-up burst as a cost), over its median step time."""
    median_step_s = fmedian(step_s)
    if median_step_s <= 0:
        return 0.0
    return fmedian([*held, *[0.0] * (window_steps - len(held))]) / median_step_s


def extra_time(reach: float, healthy_s: deque[float]) -> float:
    """Seconds per step a rank may add to its peers' waits: its score's excess over 1, the
    score taken ``straggler_z`` standard errors up (``reach``, in logs: the noise margin, so
    a rank is credited no less than it may take), times the compute it takes when healthy
    (the window's median)."""
    return max(0.0, math.exp(reach) - 1) * fmedian(healthy_s)


def explained(extras: Iterable[tuple[Hashable, float]]) -> float:
    """How much of a rise in the job's communication time (its shortest wait) stragglers
    can account for, in seconds per step, from (peer group, :func:`extra_time`) pairs.

    Where ranks are coupled beyond one collective (pipeline stages), a straggler's extra
    compute reaches every rank's wait, its own included, so the shortest wait rises by up
    to its extra time per step. Stragglers of one peer group run side by side (the slowest
    one sets the delay); those of different groups may sit in series (pipeline stages), so
    their delays add up.
    """
    by_group: dict[Hashable, float] = {}
    for key, extra_s in extras:
        by_group[key] = max(by_group.get(key, 0.0), extra_s)
    return sum(by_group.values())


def rest_of_job(rows: Mapping[int, StepSummary], rank: int) -> tuple[float, float] | None:
    """The median compute and wait of every rank but ``rank`` in this step (None: alone)."""
    others = [s for r, s in rows.items() if r != rank]
    if not others:
        return None
    return fmedian(s.compute_time_s for s in others), fmedian(s.collective_wait_s for s in others)
