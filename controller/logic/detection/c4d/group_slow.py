"""A whole peer group slow together: compared with its own recent history, not its peers.

The straggler detector (:mod:`.straggler`) compares a rank with its peers, the ranks doing
the same work. When every member of a peer group slows alike (one pipeline stage per node,
TP8 x PP4 x DP1, and that node throttles), every member's ratio to its peers stays 1: no
straggler, and the shortest wait the slow-communication detector watches does not move
either. Nothing was reported while the job's steps got a third longer (found by the
acceptance probe).

This detector keeps, per peer group of two or more ranks (a group of one is compared with
its own history by the straggler detector already), the group's median compute per step:
a *reference* of healthy steps (the first ``2 * window_steps``, then every step that does
not look slow, up to ``REFERENCE_STEPS``) and a *recent* window of ``window_steps``. Its
*change* is the recent median over the reference median. A group is slow when its change
exceeds the other groups' median change by ``straggler_min_slowdown`` and by
``straggler_z`` standard errors of the two references' per-step noise:

- a job-wide slowdown (a new data shard, a longer sequence phase) moves every group's
  change alike and blames none;
- a stage slower by design is slow from its first step, so its reference is slow too;
- a single spike is one step of twenty and does not move the recent median.

It opens after ``straggler_confirm_steps`` slow steps in a row and ``confirm_min_s`` seconds
(as slow communication does), and resolves after ``straggler_clear_windows`` full windows
of steps back within half the threshold (as a straggler does, so a node flapping between
slow and normal stays one incident). A group with an open or candidate straggler among its
ranks is left to the straggler detector: there, some ranks are slow against their peers.

The finding is a ``straggler`` (scope ``group``): a slow node is a slow node whether one of
its GPUs or all eight run one stage, and the default remediation policy's straggler rule
(alert, then checkpoint, isolate, restart once it persisted and costs enough) applies.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field, replace

from controller.logic.detection.c4d.config import C4DConfig
from controller.logic.detection.c4d.evidence import (
    Comparison,
    Normalization,
    PeerGroupEvidence,
    TimeStats,
)
from controller.logic.detection.c4d.findings import Finding, FindingKind
from controller.logic.detection.c4d.job_evidence import StragglerIncidentEvidence
from controller.logic.detection.c4d.peers import PeerGroups, PeerKey
from controller.logic.detection.c4d.robust import MAD_TO_SIGMA, fmedian, mad
from trainguard.wire import StepSummary

#: Healthy steps a group's reference keeps (as the slow-communication detector's).
REFERENCE_STEPS = 200
#: Steps added to a full reference before its median and noise are computed again (200
#: healthy steps barely move with one more; computing them every step cost a 16k-rank job
#: of 2,048 groups most of its detection time).
REF_RECOMPUTE = 10
#: An open group's incident is refreshed when its slowdown moved by this much, or after
#: this many seconds (the straggler's refresh rule).
REFRESH_MIN_CHANGE = 0.05
REFRESH_S = 60.0


def _stats(values: deque[float] | list[float]) -> TimeStats:
    if not values:
        return TimeStats(median=0.0, spread=0.0, steps=0)
    center = fmedian(values)
    return TimeStats(
        median=round(center, 6), spread=round(mad(values, center), 6), steps=len(values)
    )


@dataclass(slots=True)
class _Group:
    """One peer group's per-step medians: reference (healthy) and recent windows."""

    members: tuple[int, ...]
    recent_n: int
    pp_stage: int | None = None
    #: (compute, wait, step time) medians of the group per step
    ref: deque[tuple[float, float, float]] = field(
        default_factory=lambda: deque(maxlen=REFERENCE_STEPS)
    )
    recent: deque[tuple[float, float, float]] = field(init=False)
    change: float = 1.0
    #: standard error of ``change`` (relative), from the reference's per-step noise
    stderr: float = 0.0
    high: int = 0
    high_since_s: float = 0.0
    calm: int = 0
    calm_since_s: float = 0.0
    open: bool = False
    excess: float = 0.0
    z: float = 0.0
    others_change: float = 1.0
    #: the reference's median compute, its per-step noise (relative sigma), and steps
    #: added to it since they were computed
    ref_compute_s: float = 0.0
    ref_sigma: float = 0.0
    ref_stale: int = 0
    #: (slowdown, controller time) last reported while open
    reported: tuple[float, float] = (0.0, 0.0)

    def __post_init__(self) -> None:
        self.recent = deque(maxlen=self.recent_n)

    def learn_reference(self) -> None:
        """The reference's median compute and per-step noise (relative to it)."""
        self.ref_compute_s = ref = fmedian(p[0] for p in self.ref)
        ratios = [p[0] / ref for p in self.ref] if ref > 0 else [1.0]
        self.ref_sigma = MAD_TO_SIGMA * mad(ratios, 1.0)
        self.ref_stale = 0

    def learned(self, need: int) -> bool:
        return len(self.ref) >= need and len(self.recent) >= self.recent_n


@dataclass(slots=True)
class GroupSlowState:
    """Per-job state of the group-slow detector; :meth:`add` once per compared step."""

    job: str
    cfg: C4DConfig
    groups: dict[PeerKey, _Group] = field(default_factory=dict)

    def add(
        self,
        rows: dict[int, StepSummary],
        peers: PeerGroups,
        straggling: set[int],
        rank_node: dict[int, str],
        now_s: float,
    ) -> list[Finding]:
        """Feed one compared step; return the findings it opens, refreshes or resolves.

        ``straggling``: ranks flagged or open as stragglers (their groups are left to the
        straggler detector while they are)."""
        by_key: dict[PeerKey, list[StepSummary]] = {}
        for s in rows.values():
            key = peers.group(s.rank)
            if key is not None and not peers.alone(key):
                by_key.setdefault(key, []).append(s)
        # Gone: no longer a group of two or more (a regrouping, a restart's other layout).
        # A group merely absent from this step (its node's report late, under
        # ``min_step_coverage``) keeps its history: rebuilt, it would learn a slowdown
        # in progress as its reference.
        for key in [k for k, g in self.groups.items() if not g.open and peers.size.get(k, 0) < 2]:
            del self.groups[key]
        need = 2 * self.cfg.window_steps
        for key, members in by_key.items():
            if len(members) < 2:
                continue
            g = self.groups.get(key)
            if g is None:
                ranks = tuple(sorted(s.rank for s in members))
                g = self.groups[key] = _Group(ranks, self.cfg.window_steps)
            elif len(members) > len(g.members) or (
                len(members) == len(g.members) and g.members[0] != min(s.rank for s in members)
            ):
                # A step may lack a rank's summary (``min_step_coverage``): that is no new
                # group, and must not reset its history (or lose an open incident).
                g.members = tuple(sorted(s.rank for s in members))
            g.pp_stage = members[0].pp_stage
            point = (
                fmedian(s.compute_time_s for s in members),
                fmedian(s.collective_wait_s for s in members),
                fmedian(s.step_time_s for s in members),
            )
            g.recent.append(point)
            if len(g.ref) < need:
                g.ref.append(point)
            if g.ref_stale >= REF_RECOMPUTE or len(g.ref) < need:
                g.learn_reference()
            ref_c = g.ref_compute_s
            g.change = fmedian(p[0] for p in g.recent) / ref_c if ref_c > 0 else 1.0
            # Both medians are estimates: the recent window's and the reference's.
            spread = math.sqrt(1 / len(g.recent) + 1 / len(g.ref))
            g.stderr = 1.2533 * g.ref_sigma * spread
        live = [(k, g) for k, g in self.groups.items() if k in by_key and g.learned(need)]
        if len(live) < 2:
            return []  # the job is one group: nothing tells its slowdown from the job's
        # The others' median for every group from one sorted list (a job of 2,048 TP
        # groups would otherwise pay 2,048 squared per step).
        changes = sorted(g.change for _, g in live)
        errors = sorted(g.stderr for _, g in live)
        out: list[Finding] = []
        for key, g in live:
            g.others_change = _median_without(changes, g.change)
            other_se = _median_without(errors, g.stderr)
            stderr = max(math.hypot(g.stderr, other_se), self.cfg.straggler_scale_floor)
            g.excess = g.change / g.others_change - 1 if g.others_change > 0 else 0.0
            g.z = g.excess / stderr
            blamed = any(r in straggling for r in g.members)
            high = (
                not blamed
                and g.excess > self.cfg.straggler_min_slowdown
                and g.z > self.cfg.straggler_z
            )
            calm = g.excess < self.cfg.straggler_min_slowdown / 2
            # The reference learns from steps within half the threshold *in standard
            # errors* too: in a noisy job, learning only from steps that look faster than
            # half the slowdown threshold biased it low, and a healthy group then read slow.
            settled = calm or g.z < self.cfg.straggler_z / 2
            if not g.open and not high and settled and len(g.ref) >= need:
                g.ref.append(g.recent[-1])
                g.ref_stale += 1
            out.extend(self._hold(key, g, high, calm, rows, rank_node, now_s))
        return out

    def _hold(
        self,
        key: PeerKey,
        g: _Group,
        high: bool,
        calm: bool,
        rows: dict[int, StepSummary],
        rank_node: dict[int, str],
        now_s: float,
    ) -> list[Finding]:
        """Open after confirm steps and seconds of slow steps; resolve after whole calm
        windows; refresh an open one when its slowdown moved or a while passed."""
        cfg = self.cfg
        g.high, g.high_since_s = (
            (g.high + 1, g.high_since_s if g.high else now_s) if high else (0, 0.0)
        )
        g.calm, g.calm_since_s = (
            (g.calm + 1, g.calm_since_s if g.calm else now_s) if calm else (0, 0.0)
        )
        if not g.open:
            if (
                g.high >= cfg.straggler_confirm_steps
                and now_s - g.high_since_s >= cfg.confirm_min_s
            ):
                g.open = True
                g.reported = (g.excess, now_s)
                return [self._finding(key, g, rows, rank_node)]
            return []
        clear = cfg.straggler_clear_windows * cfg.window_steps
        if g.calm >= clear and now_s - g.calm_since_s >= cfg.confirm_min_s:
            g.open = False
            return [self._finding(key, g, rows, rank_node, resolved=True)]
        last, last_s = g.reported
        if abs(g.excess - last) >= REFRESH_MIN_CHANGE or now_s - last_s >= REFRESH_S:
            g.reported = (g.excess, now_s)
            f = self._finding(key, g, rows, rank_node)
            return [replace(f, refresh=True)]
        return []

    def resolve_all(self, rank_node: dict[int, str]) -> list[Finding]:
        """The job restarted: every open group incident ends with the run."""
        out = [
            self._finding(k, g, {}, rank_node, resolved=True)
            for k, g in self.groups.items()
            if g.open
        ]
        self.groups.clear()
        return out

    @property
    def open_ranks(self) -> set[int]:
        return {r for g in self.groups.values() if g.open for r in g.members}

    def _finding(
        self,
        key: PeerKey,
        g: _Group,
        rows: dict[int, StepSummary],
        rank_node: dict[int, str],
        *,
        resolved: bool = False,
    ) -> Finding:
        nodes = tuple(sorted({rank_node.get(r, "?") for r in g.members}))
        what = (
            f"pipeline stage {g.pp_stage}"
            if g.pp_stage is not None
            else f"peer group {key.label()}"
        )
        where = f"ranks {_span(g.members)} on {', '.join(nodes)}"
        if resolved:
            summary = f"{what} ({where}) of job {self.job} computes as its reference steps again"
        else:
            others = g.others_change - 1
            kinds = "stages" if g.pp_stage is not None else "groups"
            summary = (
                f"{what} ({where}) of job {self.job} computes {g.excess:.0%} longer than its "
                f"own recent steps while the other {kinds} changed by {others:+.0%}"
            )
        step_s = fmedian(p[2] for p in g.recent) if g.recent else 0.0
        compute_s = fmedian(p[0] for p in g.recent) if g.recent else 0.0
        cost = max(0.0, g.excess / (1 + g.excess) * compute_s / step_s) if step_s > 0 else 0.0
        if not resolved:
            summary += f", costing ~{cost:.0%} of each step"
        ev = StragglerIncidentEvidence(
            rank=g.members[0],
            node=nodes[0] if len(nodes) == 1 else ",".join(nodes),
            gpu_index=None,
            slowdown_pct=round(100 * g.excess, 1),
            step_cost_pct=round(100 * cost, 1),
            score=round(1 + g.excess, 4),
            z=round(g.z, 2),
            confidence=round(min(1.0, max(0.0, g.z) / (2 * self.cfg.straggler_z)), 2),
            window_steps=len(g.recent),
            peer_group=PeerGroupEvidence(
                label=key.label(),
                basis=key.basis,
                role=key.role or None,
                ranks=list(g.members),
                why=key.why(g.pp_stage),
            ),
            normalization=Normalization.OWN_HISTORY,
            compute_s=_compare(g, 0),
            collective_wait_s=_compare(g, 1),
            step_time_s=_compare(g, 2),
            bytes_moved=None,
            flagged_steps=g.high,
            of_steps=g.high,
            flaps=0,
            at_step=max((s.step for s in rows.values()), default=None),
            verdict=(
                f"the whole group slowed together (no rank is slow against its peers): its "
                f"median compute over the last {len(g.recent)} steps is {g.change:.3f} times "
                f"its median over {len(g.ref)} earlier healthy steps, the other groups' "
                f"{g.others_change:.3f} times theirs; {g.z:.1f} standard errors apart"
            ),
            scope="group",
            others_change_pct=round(100 * (g.others_change - 1), 1),
        )
        return Finding(
            kind=FindingKind.STRAGGLER,
            job=self.job,
            severity="warning",
            summary=summary,
            key=f"straggler:{self.job}:group:{key.label()}",
            ranks=g.members,
            nodes=nodes,
            evidence=ev,
            resolved=resolved,
        )


def _median_without(values: list[float], own: float) -> float:
    """Median of sorted ``values`` with one occurrence of ``own`` left out (two or more)."""
    skip = bisect_left(values, own)
    m = len(values) - 1

    def at(i: int) -> float:
        return values[i if i < skip else i + 1]

    return at(m // 2) if m % 2 else (at(m // 2 - 1) + at(m // 2)) / 2


def _compare(g: _Group, column: int) -> Comparison:
    """The group's recent per-step medians beside its reference steps'."""
    return Comparison(
        culprit=_stats([p[column] for p in g.recent]),
        peers=_stats([p[column] for p in g.ref]),
    )


def _span(members: tuple[int, ...]) -> str:
    """``16..23`` for a contiguous run, the list otherwise (shortened past 16)."""
    if len(members) > 2 and members[-1] - members[0] == len(members) - 1:
        return f"{members[0]}..{members[-1]}"
    if len(members) > 16:
        return ", ".join(map(str, members[:8])) + f", ... ({len(members)} ranks)"
    return ", ".join(map(str, members))
