"""Straggler detection: the rank that computes persistently longer and waits less.

In synchronous training every rank waits at each collective for the slowest one. The slow
rank arrives last, so it waits least, while its peers' wait grows by its extra compute time.
Requiring both signals (long compute *and* short wait) keeps a rank that merely sits behind
a slow link, or a step with data-dependent compute on every rank, from being blamed.

Single steps are noisy (data-dependent work, the OS, the allocator), so ranks are compared
on *windowed* statistics: each step, every rank's compute time is divided by that step's
median (which cancels work that varies for all ranks alike); a rank's score is the median of
those ratios over the last ``window_steps`` steps. A score far above its peers' scores
(median/MAD, robust to the outlier itself) for ``straggler_confirm_steps`` consecutive steps
opens a straggler; a score back within half the slowdown threshold for as many steps clears
it. A 10% straggler stands out after about half a window, while ±20% per-step jitter on a
healthy job averages away.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from statistics import median

from controller.logic.detection.c4d.config import C4DConfig
from controller.logic.detection.c4d.robust import MAD_TO_SIGMA, peer_baselines
from trainguard.wire import StepSummary

#: Weight of one step in the moving estimate of per-step noise (a memory of ~50 steps).
NOISE_ALPHA = 0.02


@dataclass(slots=True)
class StepVerdict:
    """One compared step, with the windowed straggler candidates after it."""

    step: int
    #: Ranks whose windowed score marks them slow after this step (not yet confirmed).
    flagged: set[int]
    #: Pure communication time of the step: the wait of the (nearly) last rank to arrive,
    #: who waits for the transfer alone; compute jitter elsewhere does not move it.
    comm_wait_s: float
    median_compute_s: float
    median_step_s: float


@dataclass(slots=True)
class StragglerState:
    """Per-job windows of compute ratios and wait offsets, with confirmation and hysteresis."""

    cfg: C4DConfig
    compute_ratio: dict[int, deque[float]] = field(default_factory=dict)
    wait_offset: dict[int, deque[float]] = field(default_factory=dict)
    steps_seen: int = 0
    last: StepVerdict | None = None
    scores: dict[int, float] = field(default_factory=dict)
    #: rank -> standard errors its score lies above its peers' (after the last step)
    z: dict[int, float] = field(default_factory=dict)
    #: rank -> (consecutive steps, controller time the streak began)
    slow_since: dict[int, tuple[int, float]] = field(default_factory=dict)
    calm_since: dict[int, tuple[int, float]] = field(default_factory=dict)
    open_ranks: set[int] = field(default_factory=set)
    _step_cost: dict[int, float] = field(default_factory=dict)
    _sigma: float = 0.0
    _noise_steps: int = 0

    def add(self, step: int, rows: dict[int, StepSummary]) -> StepVerdict:
        ranks = sorted(rows)
        compute = [rows[r].compute_time_s for r in ranks]
        wait = [rows[r].collective_wait_s for r in ranks]
        med_c, med_w = median(compute), median(wait)
        med_step = median(rows[r].step_time_s for r in ranks)
        window = self.cfg.window_steps
        peer_compute = peer_baselines(compute)
        for rank, c, w, (peer_c, _) in zip(ranks, compute, wait, peer_compute, strict=True):
            self.compute_ratio.setdefault(rank, deque(maxlen=window)).append(
                c / peer_c if peer_c > 0 else 1.0
            )
            self.wait_offset.setdefault(rank, deque(maxlen=window)).append(
                (w - med_w) / med_step if med_step > 0 else 0.0
            )
        self.steps_seen += 1
        flagged = self._judge(med_c, med_step)
        low = sorted(wait)[int(0.05 * len(wait))]
        self.last = StepVerdict(step, flagged, low, med_c, med_step)
        return self.last

    def _judge(self, med_compute_s: float, med_step_s: float) -> set[int]:
        """Score every rank on its window and return those that look slow now."""
        need = max(2, self.cfg.window_steps // 2)
        ranks = [r for r, q in self.compute_ratio.items() if len(q) >= need]
        if self.steps_seen < need or len(ranks) < 2:
            return set()
        scores = [median(self.compute_ratio[r]) for r in ranks]
        stderr = max(self._score_stderr(ranks, scores), self.cfg.straggler_scale_floor)
        flagged: set[int] = set()
        self.scores = dict(zip(ranks, scores, strict=True))
        for rank, score in self.scores.items():
            waits_less = median(self.wait_offset[rank]) < 0
            slow_enough = score > 1 + self.cfg.straggler_min_slowdown
            self.z[rank] = (score - 1) / stderr
            if slow_enough and self.z[rank] > self.cfg.straggler_z and waits_less:
                flagged.add(rank)
            if med_step_s > 0:
                self._step_cost[rank] = max(0.0, (score - 1) * med_compute_s / med_step_s)
        return flagged

    def _score_stderr(self, ranks: list[int], scores: list[float]) -> float:
        """Standard error of a windowed score under the no-straggler hypothesis.

        A rank's per-step ratio already holds both its own noise and its peers' median's,
        and one rank's ratios are independent across steps, so the median of ``n`` of them
        has a standard error of about 1.2533 * sigma / sqrt(n). Sigma is the typical
        deviation of a step's ratio from its rank's score, tracked as a slow moving average
        over steps: estimated from one window alone it shrinks exactly when a rank's ratios
        cluster by chance, which is also when its score looks extreme. The larger of the
        two estimates is used.
        """
        pairs = list(zip(ranks, scores, strict=True))
        latest = [abs(self.compute_ratio[r][-1] - score) for r, score in pairs]
        self._noise_steps += 1
        # A plain mean until the average has ~1/alpha steps behind it, then a moving one.
        weight = max(NOISE_ALPHA, 1 / self._noise_steps)
        self._sigma += weight * (MAD_TO_SIGMA * median(latest) - self._sigma)
        window = [abs(x - score) for r, score in pairs for x in self.compute_ratio[r]]
        sigma = max(self._sigma, MAD_TO_SIGMA * median(window))
        n = min(len(self.compute_ratio[r]) for r in ranks)
        return 1.2533 * sigma / math.sqrt(n)

    def transitions(self, now_s: float) -> tuple[set[int], set[int]]:
        """Ranks confirmed slow now, and open ranks confirmed recovered now.

        Confirmation takes ``straggler_confirm_steps`` steps in a row *and*
        ``confirm_min_s`` seconds on the controller's clock, so a few seconds of contention
        cannot open an incident however short the steps are.
        """
        flagged = self.last.flagged if self.last else set()
        opened: set[int] = set()
        cleared: set[int] = set()
        for rank in list(self.scores):
            if rank not in self.open_ranks:
                if self._persisted(self.slow_since, rank, rank in flagged, now_s):
                    opened.add(rank)
                continue
            calm = self.scores[rank] < 1 + self.cfg.straggler_min_slowdown / 2
            if self._persisted(self.calm_since, rank, calm, now_s):
                cleared.add(rank)
        self.open_ranks = (self.open_ranks | opened) - cleared
        for rank in opened | cleared:
            self.slow_since.pop(rank, None)
            self.calm_since.pop(rank, None)
        return opened, cleared

    def _persisted(
        self, since: dict[int, tuple[int, float]], rank: int, holds: bool, now_s: float
    ) -> bool:
        if not holds:
            since.pop(rank, None)
            return False
        steps, start_s = since.get(rank, (0, now_s))
        since[rank] = (steps + 1, start_s)
        return (
            steps + 1 >= self.cfg.straggler_confirm_steps
            and now_s - start_s >= self.cfg.confirm_min_s
        )

    def slowdown(self, rank: int) -> float:
        """How much longer the rank computes than its peers (its score minus one)."""
        return self.scores.get(rank, 1.0) - 1

    def confidence(self, rank: int) -> float:
        """0.5 at the detection threshold, 1.0 at twice the threshold or beyond."""
        return round(min(1.0, self.z.get(rank, 0.0) / (2 * self.cfg.straggler_z)), 2)

    def step_cost(self, rank: int) -> float:
        """Share of each step the job loses waiting for this rank."""
        return self._step_cost.get(rank, 0.0)
