"""A sporadic straggler over a long horizon: a rare but costly stall that one window misses.

The window rule (:meth:`.straggler.PeerWindows._judge_sporadic`) needs several slow steps in
one 20-step window, so a rank 4x slow on 1 step in 10 (2 slow steps a window, yet ~20% of
the job's time) was never named. Over ``SPORADIC_LONG`` windows it has enough slow steps to
count; but over a longer horizon a healthy job's random spikes add up too, so there the
rank's slow steps must also be unlikely at its *peers'* own rate of slow steps over the
same steps: a spike that every rank has is noise, one rank having many more is not.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

from controller.logic.detection.c4d.robust import binom_tail

#: Sporadic stragglers (slow on fewer than half their steps, see
#: :meth:`.straggler.PeerWindows._judge_sporadic`): a step counts as slow beyond this ratio
#: (and ``straggler_z`` noise sigmas)...
SPORADIC_STEP_SLOWDOWN = 0.2
#: ...on at least this many steps of a full window...
SPORADIC_MIN_STEPS = 4
#: ...whose excess, each capped at this (3x), costs the job at least this share of a step.
SPORADIC_CAP = 2.0
SPORADIC_MIN_COST = 0.15
#: Windows a rank's slow steps are counted over (40 steps with the default 20-step window).
SPORADIC_LONG = 2
#: Largest chance, at the peers' rate of slow steps, of the rank's count being reached.
SPORADIC_ALPHA = 1e-4
#: The peers' rate is taken as at least this (peers with no slow step in 40 steps do not
#: make 2 slow steps of one rank significant).
SPORADIC_RATE_FLOOR = 0.005


@dataclass(slots=True)
class LongSlowSteps:
    """Per rank, the capped excess of each of its last ``span`` steps (0.0: not slow), with
    running counts, so a step costs O(1) per rank and the peers' rate O(ranks) only when a
    rank is a candidate."""

    span: int
    excess: dict[int, deque[float]] = field(default_factory=dict)
    count: dict[int, int] = field(default_factory=dict)

    def record(self, rank: int, excess: float) -> None:
        q = self.excess.get(rank)
        if q is None:
            q = self.excess[rank] = deque(maxlen=self.span)
        if len(q) == self.span and q[0] > 0:
            self.count[rank] -= 1
        q.append(excess)
        if excess > 0:
            self.count[rank] = self.count.get(rank, 0) + 1
        else:
            self.count.setdefault(rank, 0)

    def forget(self, rank: int) -> None:
        self.excess.pop(rank, None)
        self.count.pop(rank, None)

    def judge(
        self,
        rank: int,
        ranks: list[int],
        min_steps: int,
        min_cost: float,
        share: float,
        slow_peers: Collection[int] = (),
    ) -> tuple[float, float, tuple[int, int]] | None:
        """(mean capped excess, cost, (slow steps, steps)) when the rank's slow steps over
        the span number ``min_steps``, cost the job ``min_cost`` of a step (``share``: its
        compute over the step time) and are too many for its peers' rate, else None.

        ``slow_peers`` (ranks already flagged slow) are left out of the peers' rate: a
        steadily slow rank beside it, 15% slower with some jitter, is past the slow-step
        limit on many steps, and counted as a peer it made the rate look like healthy
        noise; a rank 3x slow on every tenth step then dropped in and out of the rule, its
        incident resolving and reopening (found by the fault-pattern sweep)."""
        q = self.excess.get(rank)
        slow = self.count.get(rank, 0)
        if q is None or len(q) < self.span or slow < min_steps:
            return None
        mean = sum(q) / self.span
        if mean * share < min_cost:
            return None
        peers = [r for r in ranks if r != rank and r in self.excess and r not in slow_peers]
        steps = sum(len(self.excess[r]) for r in peers)
        rate = sum(self.count[r] for r in peers) / steps if steps else 1.0
        if binom_tail(self.span, slow, max(SPORADIC_RATE_FLOOR, rate)) > SPORADIC_ALPHA:
            return None
        return mean, mean * share, (slow, self.span)
