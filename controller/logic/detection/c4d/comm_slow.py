"""Slow communication: the whole job waits longer in collectives while compute stays even.

A slow link or NIC slows every collective it carries, and in a ring or tree collective that
slows every rank alike, including the last rank to arrive. That rank waits for the transfer
alone, so its wait (the shortest wait of the step) is the step's pure communication time,
unmoved by compute jitter, heavy-tailed spikes or several stragglers on other ranks.

The detector keeps a reference window of that time from healthy steps and a short recent
window. It calls the job slow when the recent median exceeds the reference by
``comm_slow_factor`` *and* by ``straggler_z`` standard errors of the reference noise (so
jittery jobs need a bigger rise), for ``straggler_confirm_steps`` steps in a row. Recovery
needs the recent median back within half the factor for as many steps.

A straggler (a candidate this step or one still open) can explain part of a rise: where
ranks are coupled beyond one collective (pipeline stages), its delay reaches every rank's
wait, its own included. It explains at most its extra compute per step plus a noise margin
(:meth:`StragglerState.explained_wait_s`); the thresholds above apply to the rise beyond
that, so a 7% straggler does not hide a network that got 300 ms slower per step.

A host-wide slowdown (CPU-starved or throttled hosts) stretches every rank's compute and the
transfers alike: it raises the wait with compute *not* even, against this detector's
premise. The job's compute (the step's shortest, which a straggler does not move) is
tracked beside the wait, and the reference wait is scaled by how much it rose: a wait that
grows no faster than compute is the hosts', not the network's. A 2x slower job whose wait
doubled opens nothing; a network 4x slower during it still leaves a 2x rise unexplained.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from statistics import median

from controller.logic.detection.c4d.config import C4DConfig
from controller.logic.detection.c4d.robust import MAD_TO_SIGMA, mad

#: Healthy steps kept as the reference (a few minutes of training at typical step times).
REFERENCE_STEPS = 200


@dataclass(slots=True)
class CommSlowState:
    cfg: C4DConfig
    reference: deque[float] = field(default_factory=lambda: deque(maxlen=REFERENCE_STEPS))
    recent: deque[float] = field(init=False)
    #: The job's compute (each step's shortest) over the same steps as ``reference``/``recent``
    reference_compute: deque[float] = field(default_factory=lambda: deque(maxlen=REFERENCE_STEPS))
    recent_compute: deque[float] = field(init=False)
    #: (consecutive steps, controller time the streak began), or None when not in one
    high_since: tuple[int, float] | None = None
    calm_since: tuple[int, float] | None = None
    open: bool = False
    reference_wait_s: float = 0.0
    recent_wait_s: float = 0.0
    #: Seconds per step of the last rise that the job's compute rise accounts for.
    host_explained_s: float = 0.0

    def __post_init__(self) -> None:
        self.recent = deque(maxlen=self.cfg.comm_slow_window_steps)
        self.recent_compute = deque(maxlen=self.cfg.comm_slow_window_steps)

    def add(
        self,
        wait_s: float,
        step_s: float,
        explained_s: float,
        now_s: float,
        compute_s: float | None = None,
    ) -> str | None:
        """Feed one step's communication time; returns "opened", "resolved" or None.

        ``explained_s``: seconds per step of a rise that stragglers account for.
        ``compute_s``: the job's compute this step (its shortest); None: not tracked."""
        self.recent.append(wait_s)
        if compute_s is not None:
            self.recent_compute.append(compute_s)
        if len(self.reference) < 2 * self.cfg.window_steps:
            self._learn(wait_s, compute_s)
            return None
        ref = median(self.reference)
        rec = median(self.recent)
        self.reference_wait_s, self.recent_wait_s = ref, rec
        sigma = MAD_TO_SIGMA * mad(self.reference, ref)
        stderr = 1.2533 * sigma / math.sqrt(len(self.recent))
        rise = rec - ref
        self.host_explained_s = ref * (self._compute_scale() - 1)
        unexplained = rise - explained_s - self.host_explained_s
        high = (
            unexplained > self.cfg.comm_slow_factor * ref
            and unexplained > self.cfg.comm_slow_min_step_share * step_s
            and unexplained > self.cfg.straggler_z * stderr
        )
        calm_bound = self.cfg.comm_slow_factor / 2 * ref
        # Closing: what stragglers explain is not the network's; the reference, though,
        # learns only from steps calm without any explanation.
        calm = unexplained < calm_bound
        self.high_since = _streak(self.high_since, high, now_s)
        self.calm_since = _streak(self.calm_since, calm, now_s)
        if not self.open and not high and rise < calm_bound:
            self._learn(wait_s, compute_s)
        if not self.open and self._confirmed(self.high_since, now_s):
            self.open = True
            self.calm_since = None
            return "opened"
        if self.open and self._confirmed(self.calm_since, now_s):
            self.open = False
            self.high_since = None
            return "resolved"
        return None

    def _learn(self, wait_s: float, compute_s: float | None) -> None:
        self.reference.append(wait_s)
        if compute_s is not None:
            self.reference_compute.append(compute_s)

    def _compute_scale(self) -> float:
        """How many times longer the job computes now than over the reference (>= 1).

        Only a rise counts: a job computing faster (a smaller batch) leaves its transfers
        as they were, and a lower expectation would read ordinary wait as a slowdown."""
        if len(self.recent_compute) < len(self.recent) or not self.reference_compute:
            return 1.0
        ref = median(self.reference_compute)
        return max(1.0, median(self.recent_compute) / ref) if ref > 0 else 1.0

    def _confirmed(self, streak: tuple[int, float] | None, now_s: float) -> bool:
        return (
            streak is not None
            and streak[0] >= self.cfg.straggler_confirm_steps
            and now_s - streak[1] >= self.cfg.confirm_min_s
        )


def _streak(
    streak: tuple[int, float] | None, holds: bool, now_s: float
) -> tuple[int, float] | None:
    if not holds:
        return None
    return (1, now_s) if streak is None else (streak[0] + 1, streak[1])
