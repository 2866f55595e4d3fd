"""Straggler detection: the rank that computes persistently longer than its peers, waiting less.

In synchronous training every rank waits at each collective for the slowest one. The slow
rank arrives last, so it waits least, while its peers' wait grows by its extra compute time.
Requiring both signals (long compute *and* short wait) keeps a rank that merely sits behind
a slow link, or a step with data-dependent compute on every rank, from being blamed.

Ranks are compared only with their *peers* (:mod:`.peers`): ranks reporting the same role
and peer group. A pipeline's last stage computing the loss, or an MoE expert receiving twice
the tokens, is not slow, it does other work. Where peers move different collective volumes
(uneven all-to-all), a rank's compute is compared with what its peers' compute predicts for
the bytes it moved (a robust slope of compute over bytes, learned over steps).

Single steps are noisy and heavy-tailed (the OS, the allocator, a multi-x spike now and
then), so ranks are compared on *windowed* robust statistics: each step, every rank's
compute time is divided by its peers' median (or byte-predicted) compute in that step; its
score is the median of those ratios over the last ``window_steps`` steps, and its spread is
the groups' pooled MAD. A spike is one ratio of twenty and does not move the median. A
window not yet full is padded with neutral ratios, so a warm-up burst does not either. A
rank slow on fewer than half its steps, at a real cost to the job, is caught by a second,
bounded rule (:meth:`PeerWindows._judge_sporadic`).

Hysteresis, counted in steps (the data is per step; the controller's clock would measure
the agents' report batching instead): a straggler opens when flagged in
``straggler_confirm_steps`` of the last ``straggler_confirm_of_steps`` compared steps, and
resolves only after ``straggler_clear_windows`` full windows of calm steps. A node flapping
between slow and normal stays one open incident, with each return to slow counted as a flap.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from controller.logic.detection.c4d import cost as costs
from controller.logic.detection.c4d.config import C4DConfig
from controller.logic.detection.c4d.evidence import (
    Comparison,
    Normalization,
    PeerGroupEvidence,
    StragglerEvidence,
)
from controller.logic.detection.c4d.peers import PeerGroups, PeerKey
from controller.logic.detection.c4d.robust import (
    MAD_TO_SIGMA,
    fmedian,
    log_ratio,
    mad,
    peer_centers,
    time_stats,
    window_of,
    window_stderr,
)
from controller.logic.detection.c4d.sporadic import (
    SPORADIC_CAP,
    SPORADIC_LONG,
    SPORADIC_MIN_COST,
    SPORADIC_MIN_STEPS,
    SPORADIC_STEP_SLOWDOWN,
    LongSlowSteps,
)
from trainguard.wire import StepSummary

#: A rank informs the compute-per-byte slope only if its bytes differ from the group median
#: by this fraction (smaller differences make the slope all noise).
SLOPE_MIN_BYTES_DIFF = 0.05
#: Per-step slope estimates kept; their median is the slope used.
SLOPE_STEPS = 64
#: Steps a rank alone in its peer group is watched before its own history becomes its
#: reference (three windows: long enough that a spike or a slow phase does not set it).
HISTORY_REF_STEPS = 60


@dataclass(slots=True)
class StepVerdict:
    """One compared step, with the windowed straggler candidates after it."""

    step: int
    #: Ranks whose windowed score marks them slow after this step (not yet confirmed).
    flagged: set[int]
    #: Pure communication time of the step: the shortest wait, that of the last rank to
    #: arrive, who waits for the transfer alone; compute jitter or a multi-x spike
    #: elsewhere does not move it (a quantile above the minimum would: with two slow ranks,
    #: or one spike, the second-shortest wait holds the gap between them).
    comm_wait_s: float
    #: The job's compute: the step's shortest, which a straggler (only ever longer) does
    #: not move, and a host-wide slowdown raises with every rank's.
    job_compute_s: float
    median_step_s: float


@dataclass(slots=True)
class PeerWindows:
    """One peer group's windows: per-rank ratios and raw times, scores after each step."""

    key: PeerKey
    cfg: C4DConfig
    ratio: dict[int, deque[float]] = field(default_factory=dict)
    #: The same ratios' natural logs, which the window score is taken on (see :meth:`_judge`).
    log_ratios: dict[int, deque[float]] = field(default_factory=dict)
    wait_offset: dict[int, deque[float]] = field(default_factory=dict)
    compute_s: dict[int, deque[float]] = field(default_factory=dict)
    wait_s: dict[int, deque[float]] = field(default_factory=dict)
    step_s: dict[int, deque[float]] = field(default_factory=dict)
    bytes_moved: dict[int, deque[float]] = field(default_factory=dict)
    slopes: deque[float] = field(default_factory=lambda: deque(maxlen=SLOPE_STEPS))
    normalized: bool = False
    pp_stage: int | None = None
    steps_seen: int = 0
    scores: dict[int, float] = field(default_factory=dict)
    #: rank -> standard errors its score lies above its peers' (after the last step)
    z: dict[int, float] = field(default_factory=dict)
    flagged: set[int] = field(default_factory=set)
    #: rank -> its step cost as the sporadic rule reads it (else :meth:`cost` computes it)
    step_cost: dict[int, float] = field(default_factory=dict)
    #: rank -> the compute it takes when healthy, and the seconds the job waited for it,
    #: per step (:mod:`.cost`): read only for the ranks that matter (:meth:`cost`)
    healthy_s: dict[int, deque[float]] = field(default_factory=dict)
    held: dict[int, deque[float]] = field(default_factory=dict)
    #: rank -> its log score plus ``straggler_z`` standard errors (the noise margin)
    _reach: dict[int, float] = field(default_factory=dict)
    #: rank -> consecutive steps it met the sporadic rule; its slow steps of the window
    sporadic_run: dict[int, int] = field(default_factory=dict)
    sporadic: dict[int, tuple[int, int]] = field(default_factory=dict)
    #: Each rank's slow steps over ``SPORADIC_LONG`` windows (:mod:`.sporadic`).
    slow_long: LongSlowSteps = field(default_factory=lambda: LongSlowSteps(0))
    _present: set[int] = field(default_factory=set)
    _sigma: float = 0.0
    _noise_steps: int = 0
    #: A group of one rank (a pipeline stage without a data-parallel replica, a role one
    #: rank declares): it has no peer, so it is compared with its own history instead.
    alone: bool = False
    #: ``alone`` only: (compute over the rest of the job's median compute, wait offset from
    #: the rest of the job's median wait per step time, compute, wait, step time) over its
    #: first ``HISTORY_REF_STEPS`` steps; their medians are the reference once learned.
    history: list[tuple[float, float, float, float, float]] = field(default_factory=list)
    reference: tuple[float, float] | None = None

    def forget(self, rank: int) -> None:
        """The rank now reports another role: its windows here no longer apply."""
        for store in (
            self.ratio,
            self.log_ratios,
            self.wait_offset,
            self.compute_s,
            self.wait_s,
            self.step_s,
            self.bytes_moved,
            self.scores,
            self.z,
            self.step_cost,
            self.healthy_s,
            self.held,
            self.sporadic_run,
            self.sporadic,
        ):
            store.pop(rank, None)
        self.flagged.discard(rank)
        self.slow_long.forget(rank)

    def add(
        self,
        rows: list[StepSummary],
        waits: costs.LeastWaits,
        rest: tuple[float, float] | None = None,
    ) -> None:
        """One step of the group's members. ``waits``: the job's least waits this step (for
        :mod:`.cost`); ``rest``: the other ranks' median compute and median wait in this
        step (used by a group of one, compared with its history)."""
        if self.alone:
            if rest is not None:
                self._add_alone(rows[0], waits, *rest)
            return
        compute = [s.compute_time_s for s in rows]
        wait = [s.collective_wait_s for s in rows]
        med_w = fmedian(wait)
        med_step = fmedian(s.step_time_s for s in rows)
        expected = self._expected(rows, compute)
        n = self.cfg.window_steps
        self.pp_stage = rows[0].pp_stage
        for s, c, w, e in zip(rows, compute, wait, expected, strict=True):
            r = s.rank
            self._append_ratio(r, c / e if e > 0 else 1.0)
            window_of(self.wait_offset, r, n).append(
                (w - med_w) / med_step if med_step > 0 else 0.0
            )
            window_of(self.compute_s, r, n).append(c)
            window_of(self.wait_s, r, n).append(w)
            window_of(self.step_s, r, n).append(s.step_time_s)
            window_of(self.bytes_moved, r, n).append(float(s.collective_bytes))
            window_of(self.healthy_s, r, n).append(e)
            window_of(self.held, r, n).append(costs.held_s(c, e, w, waits.other_than(r)))
        self.steps_seen += 1
        self._present = {s.rank for s in rows}
        self._judge()

    def _add_alone(
        self, s: StepSummary, waits: costs.LeastWaits, rest_compute_s: float, rest_wait_s: float
    ) -> None:
        """A rank with no peer: its compute relative to the rest of the job (which cancels
        work that varies for the whole job alike) against the same ratio over its first
        ``HISTORY_REF_STEPS`` steps. A rank slow from its first step is not found."""
        step_s = s.step_time_s
        if rest_compute_s <= 0 or step_s <= 0:
            return
        rel = s.compute_time_s / rest_compute_s
        offset = (s.collective_wait_s - rest_wait_s) / step_s
        if self.reference is None:
            self.history.append((rel, offset, s.compute_time_s, s.collective_wait_s, step_s))
            if len(self.history) >= HISTORY_REF_STEPS:
                ref = fmedian(h[0] for h in self.history)
                self.reference = (ref, fmedian(h[1] for h in self.history))
                # Its own per-step noise over the reference steps seeds the noise estimate.
                logs = [log_ratio(h[0] / ref) for h in self.history] if ref > 0 else [0.0]
                self._sigma = MAD_TO_SIGMA * mad(logs, 0.0)
                self._noise_steps = len(logs)
            return
        ref_rel, ref_offset = self.reference
        n, r = self.cfg.window_steps, s.rank
        self._append_ratio(r, rel / ref_rel if ref_rel > 0 else 1.0)
        window_of(self.wait_offset, r, n).append(offset - ref_offset)
        window_of(self.compute_s, r, n).append(s.compute_time_s)
        window_of(self.wait_s, r, n).append(s.collective_wait_s)
        window_of(self.step_s, r, n).append(step_s)
        window_of(self.bytes_moved, r, n).append(float(s.collective_bytes))
        healthy = rest_compute_s * ref_rel  # its compute at its reference share of the job's
        window_of(self.healthy_s, r, n).append(healthy)
        held = costs.held_s(s.compute_time_s, healthy, s.collective_wait_s, waits.other_than(r))
        window_of(self.held, r, n).append(held)
        self.pp_stage = s.pp_stage
        self.steps_seen += 1
        self._judge()

    def _append_ratio(self, rank: int, ratio: float) -> None:
        n = self.cfg.window_steps
        window_of(self.ratio, rank, n).append(ratio)
        window_of(self.log_ratios, rank, n).append(log_ratio(ratio))

    def _expected(self, rows: list[StepSummary], compute: list[float]) -> list[float]:
        """Each rank's compute as its peers' predict it: their median, or, where peers
        moved different volumes, their median shifted along the compute-per-byte slope."""
        peer_c = peer_centers(compute)
        nbytes = [float(s.collective_bytes) for s in rows]
        lo, hi = min(nbytes), max(nbytes)
        self.normalized = lo > 0 and hi > (1 + self.cfg.bytes_skew) * lo
        if not self.normalized:
            return peer_c
        med_c, med_b = fmedian(compute), fmedian(nbytes)
        step_slopes = [
            (c - med_c) / (b - med_b)
            for c, b in zip(compute, nbytes, strict=True)
            if abs(b - med_b) > SLOPE_MIN_BYTES_DIFF * med_b
        ]
        if step_slopes:  # more bytes never means less work: a negative slope is noise
            self.slopes.append(max(0.0, fmedian(step_slopes)))
        slope = fmedian(self.slopes) if self.slopes else 0.0
        peer_b = peer_centers(nbytes)
        return [
            max(pc + slope * (b - pb), 0.25 * pc)
            for pc, b, pb in zip(peer_c, nbytes, peer_b, strict=True)
        ]

    def _judge(self) -> None:
        """Score every rank on its window and mark those that look slow now."""
        n = self.cfg.window_steps
        need = max(2, n // 2)
        ranks = [r for r, q in self.ratio.items() if len(q) >= need]
        self.flagged = set()
        if self.steps_seen < need or len(ranks) < (1 if self.alone else 2):
            return
        # A window not yet full (the job's or a restart's first steps) is padded with
        # neutral ratios: the median then moves only once slow steps fill more than half of
        # a *full* window, so a warm-up burst (checkpoint load, compile) on one rank opens
        # nothing, as the same burst mid-run does not (found by the acceptance probe).
        #
        # Scored on log-ratios: step times are multiplicative and right-skewed (MoE routing,
        # data-dependent kernels), so linear ratios have a long upper tail that a symmetric
        # MAD underrates, and "5 standard errors" behaved like ~4 (healthy 64-rank jobs
        # with lognormal(0.35) compute opened stragglers at +47..64%, z 5.5..7.2: found by
        # the acceptance probe). In logs that noise is symmetric, and the median commutes
        # with the log, so the score itself (its exponential) is the same median ratio.
        logs = [
            fmedian([*self.log_ratios[r], *[0.0] * (n - len(self.log_ratios[r]))]) for r in ranks
        ]
        stderr = max(self._score_stderr(ranks, logs), self.cfg.straggler_scale_floor)
        self.scores = {r: math.exp(x) for r, x in zip(ranks, logs, strict=True)}
        margin = self.cfg.straggler_z * stderr
        self._reach = {r: x + margin for r, x in zip(ranks, logs, strict=True)}
        self.step_cost.clear()
        for rank, log_score in zip(ranks, logs, strict=True):
            score = self.scores[rank]
            waits_less = fmedian(self.wait_offset[rank]) < 0
            slow_enough = score > 1 + self.cfg.straggler_min_slowdown
            self.z[rank] = log_score / stderr
            if slow_enough and self.z[rank] > self.cfg.straggler_z and waits_less:
                self.flagged.add(rank)
        if not self.alone:
            self._judge_sporadic(ranks)

    def _judge_sporadic(self, ranks: list[int]) -> None:
        """Flag a rank slow on *fewer* than half its steps (a data loader or GC stall every
        few steps) whose slow steps still cost the job ``SPORADIC_MIN_COST`` of its time:
        the window median cannot see it. A step counts as slow when its ratio is beyond
        ``SPORADIC_STEP_SLOWDOWN`` and ``straggler_z`` noise sigmas and the rank waited less
        than its peers' median in it; the rank needs ``SPORADIC_MIN_STEPS`` such steps in a
        full window, their excess (capped at ``SPORADIC_CAP``, so one 50x step counts as
        3x) costing the job that share, on every step for a whole window (so over two).
        Or the same over ``SPORADIC_LONG`` windows, where the count must also stand out
        from the peers' own rate of slow steps (:class:`.sporadic.LongSlowSteps`)."""
        n, cfg = self.cfg.window_steps, self.cfg
        limit = max(1 + SPORADIC_STEP_SLOWDOWN, math.exp(cfg.straggler_z * self._sigma))
        if self.slow_long.span != SPORADIC_LONG * n:
            self.slow_long = LongSlowSteps(SPORADIC_LONG * n)
        for rank in ranks:
            if rank in self._present:
                x, o = self.ratio[rank][-1], self.wait_offset[rank][-1]
                self.slow_long.record(rank, min(x - 1, SPORADIC_CAP) if x > limit and o < 0 else 0)
        for rank in ranks:
            ratios, offsets = self.ratio[rank], self.wait_offset[rank]
            slow = [x for x, o in zip(ratios, offsets, strict=True) if x > limit and o < 0]
            hit = len(ratios) >= n and len(slow) >= SPORADIC_MIN_STEPS
            long = self.slow_long.count.get(rank, 0) >= SPORADIC_MIN_STEPS
            excess = cost = share = 0.0
            if (hit or long) and rank not in self.flagged:  # the medians only when they matter
                med_step = fmedian(self.step_s[rank])
                share = fmedian(self.compute_s[rank]) / med_step if med_step > 0 else 0.0
                excess = sum(min(x - 1, SPORADIC_CAP) for x in slow) / n
                cost = excess * share
            count = (len(slow), n)
            if long and (not hit or cost < SPORADIC_MIN_COST) and rank not in self.flagged:
                found = self.slow_long.judge(
                    rank, ranks, SPORADIC_MIN_STEPS, SPORADIC_MIN_COST, share, self.flagged
                )
                if found is not None:
                    hit, (excess, cost, count) = True, found
            if not hit or cost < SPORADIC_MIN_COST or rank in self.flagged:
                self.sporadic_run.pop(rank, None)
                self.sporadic.pop(rank, None)
                continue
            self.sporadic_run[rank] = held = self.sporadic_run.get(rank, 0) + 1
            self.sporadic[rank] = count
            if held >= n:  # the mean excess is the slowdown reported (and cleared on)
                self.flagged.add(rank)
                self.scores[rank] = 1 + excess
                self.step_cost[rank] = cost
                self.z[rank] = max(self.z[rank], cfg.straggler_z)

    def cost(self, rank: int) -> float:
        """Share of each step the job waits for ``rank`` (:func:`.cost.window_cost`), or the
        sporadic rule's reading where it has one."""
        if rank in self.step_cost or rank not in self.scores:
            return self.step_cost.get(rank, 0.0)
        return costs.window_cost(self.held[rank], self.step_s[rank], self.cfg.window_steps)

    def extra(self, rank: int) -> float:
        """Seconds per step ``rank`` may add to its peers' waits (:func:`.cost.extra_time`)."""
        reach = self._reach.get(rank)
        if reach is None or rank not in self.scores:
            return 0.0
        return costs.extra_time(reach, self.healthy_s[rank])

    def _score_stderr(self, ranks: list[int], scores: list[float]) -> float:
        """Standard error of a windowed (log) score (:func:`.robust.window_stderr`)."""
        self._noise_steps += 1
        windows = [self.log_ratios[r] for r in ranks]
        stderr, self._sigma = window_stderr(windows, scores, self._sigma, self._noise_steps)
        return stderr

    def compare(self, rank: int, store: dict[int, deque[float]], column: int) -> Comparison:
        """The rank's window of ``store`` next to its peers' windows, pooled (a rank alone:
        next to its own reference steps, ``history`` column ``column``)."""
        if self.alone:
            peers = [h[column] for h in self.history]
        else:
            peers = [x for r, q in store.items() if r != rank and r in self.scores for x in q]
        return Comparison(culprit=time_stats(list(store.get(rank, ()))), peers=time_stats(peers))


@dataclass(slots=True)
class _Hold:
    """Per-rank hysteresis: k-of-n to open, whole calm windows to close, flaps between."""

    recent: deque[bool]
    calm_steps: int = 0
    flaps: int = 0
    #: Open and calm for ``straggler_confirm_steps`` steps: the next slow step is a flap.
    normal_phase: bool = False


@dataclass(slots=True)
class StragglerState:
    """Per-job straggler state: peer groups' windows, and confirmation with hysteresis."""

    cfg: C4DConfig
    #: Who is compared with whom, judged by who reports each key (:class:`PeerGroups`).
    peers: PeerGroups = field(default_factory=PeerGroups)
    groups: dict[PeerKey, PeerWindows] = field(default_factory=dict)
    steps_seen: int = 0
    last: StepVerdict | None = None
    holds: dict[int, _Hold] = field(default_factory=dict)
    open_ranks: set[int] = field(default_factory=set)
    #: Ranks scored in the last step (in a group with a peer and a full enough window).
    _scored: list[int] = field(default_factory=list)

    def add(self, step: int, rows: dict[int, StepSummary]) -> StepVerdict:
        for rank, old in self.peers.update(list(rows.values()), self.steps_seen):
            if old in self.groups:
                self.groups[old].forget(rank)
        by_group: dict[PeerKey, list[StepSummary]] = {}
        for s in rows.values():
            key = self.peers.group(s.rank)
            if key is not None:  # None: its report disagrees with its peers' (settling)
                by_group.setdefault(key, []).append(s)
        flagged: set[int] = set()
        scored: list[int] = []
        suspects = self.open_ranks | (self.last.flagged if self.last else set())
        waits = costs.least_waits(rows, suspects)
        for key, members in by_group.items():
            alone = self.peers.alone(key)
            if len(members) < 2 and not alone:
                continue  # no peer reported this step: nothing to compare with
            group = self.groups.get(key)
            if group is None or group.alone != alone:
                group = self.groups[key] = PeerWindows(key, self.cfg, alone=alone)
            group.add(members, waits, costs.rest_of_job(rows, members[0].rank) if alone else None)
            flagged |= group.flagged
            scored += [s.rank for s in members if s.rank in group.scores]
        self._scored = scored
        self.steps_seen += 1
        self.last = StepVerdict(
            step,
            flagged,
            min(s.collective_wait_s for s in rows.values()),
            min(s.compute_time_s for s in rows.values()),
            fmedian(s.step_time_s for s in rows.values()),
        )
        return self.last

    def transitions(self) -> tuple[set[int], set[int]]:
        """Ranks confirmed slow now, and open ranks confirmed recovered now.

        Counted in compared steps only, never on the controller's clock: summaries arrive
        in batches (one agent report carries ~70 steps of a 70 ms job), so a rule in
        seconds would measure the agents' report timers rather than the rank, and would
        need as many more steps as a report interval holds before it could open.
        """
        cfg = self.cfg
        flagged = self.last.flagged if self.last else set()
        opened: set[int] = set()
        cleared: set[int] = set()
        clear_steps = cfg.straggler_clear_windows * cfg.window_steps
        for rank in self._scored:
            hold = self.holds.get(rank)
            if hold is None:
                hold = self.holds[rank] = _Hold(deque(maxlen=cfg.straggler_confirm_of_steps))
            slow = rank in flagged
            hold.recent.append(slow)
            if rank not in self.open_ranks:
                if sum(hold.recent) >= cfg.straggler_confirm_steps:
                    opened.add(rank)
                    hold.calm_steps, hold.flaps, hold.normal_phase = 0, 0, False
                continue
            if not slow and self.score(rank) < 1 + cfg.straggler_min_slowdown / 2:
                hold.calm_steps += 1
                hold.normal_phase |= hold.calm_steps >= cfg.straggler_confirm_steps
                if hold.calm_steps >= clear_steps:
                    cleared.add(rank)
                    hold.recent.clear()
                continue
            hold.calm_steps = 0
            if slow and hold.normal_phase:
                hold.flaps += 1
                hold.normal_phase = False
        self.open_ranks = (self.open_ranks | opened) - cleared
        return opened, cleared

    # ------------------------------------------------------------------ readings

    @property
    def rank_group(self) -> dict[int, PeerKey]:
        """rank -> the key it is compared under."""
        return self.peers.assigned

    def group_of(self, rank: int) -> PeerWindows | None:
        key = self.rank_group.get(rank)
        return self.groups.get(key) if key is not None else None

    def score(self, rank: int) -> float:
        group = self.group_of(rank)
        return group.scores.get(rank, 1.0) if group else 1.0

    def slowdown(self, rank: int) -> float:
        """How much longer the rank computes than its peers (its score minus one)."""
        return self.score(rank) - 1

    def confidence(self, rank: int) -> float:
        """0.5 at the detection threshold, 1.0 at twice the threshold or beyond."""
        group = self.group_of(rank)
        z = group.z.get(rank, 0.0) if group else 0.0
        return round(min(1.0, max(0.0, z) / (2 * self.cfg.straggler_z)), 2)

    def step_cost(self, rank: int) -> float:
        """Share of each step the job loses waiting for this rank."""
        group = self.group_of(rank)
        return group.cost(rank) if group else 0.0

    def explained_wait_s(self, ranks: set[int]) -> float:
        """How much of a rise in the job's communication time (its shortest wait) the
        stragglers ``ranks`` can account for, in seconds per step (:func:`.cost.explained`)."""
        groups = [(r, g) for r in ranks if (g := self.group_of(r)) is not None]
        return costs.explained((g.key, g.extra(r)) for r, g in groups)

    def flaps(self, rank: int) -> int:
        hold = self.holds.get(rank)
        return hold.flaps if hold else 0

    def evidence(self, rank: int, node: str, gpu_index: int | None) -> StragglerEvidence:
        """The verdict on ``rank`` with the numbers behind it, for the incident."""
        group = self.group_of(rank)
        hold = self.holds.get(rank)
        key = self.rank_group.get(rank)
        if group is None or key is None:  # never scored (a restart resolving an old rank)
            group = PeerWindows(key or PeerKey("", ()), self.cfg)
        members = sorted(group.scores)
        slowdown = self.slowdown(rank)
        if group.alone:
            norm = Normalization.OWN_HISTORY
        else:
            norm = Normalization.BYTES if group.normalized else Normalization.PEER_MEDIAN
        against = "byte-predicted compute" if group.normalized else "median compute"
        why = group.key.why(group.pp_stage)
        reported = self.peers.reported.get(rank)
        if reported is not None and reported != key:
            why += (
                f"; its own report ({reported.label()}) disagrees with its peers', so it is "
                "compared with the ranks whose reports list it"
            )
        verdict = (
            f"windowed median of its compute over its {len(members) - 1} peers' "
            f"{against} is {self.score(rank):.3f} ({slowdown:+.0%}), "
        )
        if group.alone:
            why += (
                "; it is the group's only rank, so it is compared with its own history: "
                f"its compute relative to the rest of the job over its first "
                f"{len(group.history)} compared steps"
            )
            verdict = (
                "alone in its peer group: windowed median of its compute relative to the "
                "rest of the job is "
                f"{self.score(rank):.3f} times its own over its first {len(group.history)} "
                f"steps ({slowdown:+.0%}), "
            )
        tail = f"{group.z.get(rank, 0.0):.1f} standard errors above 1, and it waits less in "
        tail += "collectives than " + ("it did then" if group.alone else "they do")
        if rank in group.sporadic and group.sporadic_run.get(rank, 0) >= self.cfg.window_steps:
            slow, of = group.sporadic[rank]
            verdict = (
                f"slow on {slow} of its last {of} steps (fewer than half: its windowed "
                f"median stays near its {len(members) - 1} peers'); its mean compute "
                f"excess over them is {slowdown:+.0%} (each step's capped at 3x), "
            )
            tail = "and it waits less in collectives than they do on those steps"
        return StragglerEvidence(
            rank=rank,
            node=node,
            gpu_index=gpu_index,
            slowdown_pct=round(100 * slowdown, 1),
            step_cost_pct=round(100 * self.step_cost(rank), 1),
            score=round(self.score(rank), 4),
            z=round(group.z.get(rank, 0.0), 2),
            confidence=self.confidence(rank),
            window_steps=len(group.ratio.get(rank, ())),
            peer_group=PeerGroupEvidence(
                label=(key or PeerKey("", ())).label(),
                basis=group.key.basis,
                role=group.key.role or None,
                ranks=members,
                why=why,
            ),
            normalization=norm,
            compute_s=group.compare(rank, group.compute_s, 2),
            collective_wait_s=group.compare(rank, group.wait_s, 3),
            step_time_s=group.compare(rank, group.step_s, 4),
            bytes_moved=(
                group.compare(rank, group.bytes_moved, 2)
                if group.normalized and not group.alone
                else None
            ),
            flagged_steps=sum(hold.recent) if hold else 0,
            of_steps=len(hold.recent) if hold else 0,
            flaps=hold.flaps if hold else 0,
            at_step=self.last.step if self.last else None,
            verdict=verdict + tail,
        )
