"""A whole peer group slow together (:mod:`controller.logic.detection.c4d.group_slow`).

TP8 x PP4 x DP1: each pipeline stage is one node's eight GPUs and its peer group. When
that node slows, every member slows alike: no rank is slow against its peers, and the
shortest wait does not move, so before this detector nothing was reported while the job's
steps got a third longer (found by the acceptance probe).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest

from controller.logic.detection.c4d import Finding, FindingKind, JobTrackers
from controller.logic.detection.c4d.evidence import Normalization
from controller.logic.detection.c4d.job_evidence import StragglerIncidentEvidence
from controller.logic.remediation.rules import Policy
from trainguard.wire import JobRecords, StepSummary

JOB = "pp"
TP, PP = 8, 4
#: Stage 3 computes the loss: 1.2x the others' work by design.
STAGE_WORK = (1.0, 1.0, 1.0, 1.2)
STAGES = {p: list(range(p * TP, (p + 1) * TP)) for p in range(PP)}

#: (step, stage) -> that stage's compute factor in that step
Slowdown = Callable[[int, int], float]


def _node(rank: int) -> str:
    return f"node-s{rank // TP}"


def _step(
    step: int, rng: random.Random, slow: Slowdown, jitter: Callable[[], float]
) -> list[StepSummary]:
    compute = {r: STAGE_WORK[r // TP] * slow(step, r // TP) * jitter() for r in range(TP * PP)}
    top = max(compute.values())
    return [
        StepSummary(
            job=JOB,
            rank=r,
            world_size=TP * PP,
            step=step,
            compute_time_s=c,
            collective_wait_s=top - c + 0.1,
            step_time_s=top + 0.1,
            role=f"pp_stage={r // TP}",
            pp_stage=r // TP,
            group_ranks=STAGES[r // TP],
            gpu_index=r % TP,
        )
        for r, c in compute.items()
    ]


def _run(
    steps: int,
    slow: Slowdown,
    *,
    seed: int = 2,
    jitter: Callable[[random.Random], float] | None = None,
) -> list[tuple[int, Finding]]:
    """Feed ``steps`` steps one controller second apart, each node its own report."""
    rng = random.Random(seed)
    draw = (lambda: jitter(rng)) if jitter else (lambda: 1 + rng.uniform(-0.05, 0.05))
    trackers = JobTrackers()
    found: list[tuple[int, Finding]] = []
    for step in range(steps):
        by_node: dict[str, list[StepSummary]] = {}
        for s in _step(step, rng, slow, draw):
            by_node.setdefault(_node(s.rank), []).append(s)
        for node, rows in by_node.items():
            trackers.observe(node, JobRecords(steps=rows), float(step))
        found += [(step, f) for f in trackers.evaluate(float(step))]
    return found


def _opened(found: list[tuple[int, Finding]]) -> list[tuple[int, Finding]]:
    return [(st, f) for st, f in found if not (f.resolved or f.refresh)]


def test_a_node_running_a_whole_stage_slow_is_named_with_its_ranks_and_node() -> None:
    """Stage 2's node slows 1.3x at step 100 and recovers at step 250: one straggler
    incident (scope ``group``) names the stage's eight ranks and their node, ~30% slower
    than its own recent steps while the other stages did not change, and it resolves."""
    found = _run(400, lambda st, p: 1.3 if p == 2 and 100 <= st < 250 else 1.0)
    opened = _opened(found)
    assert len(opened) == 1
    step, f = opened[0]
    assert 100 < step < 130
    assert f.kind is FindingKind.STRAGGLER
    assert f.ranks == tuple(STAGES[2]) and f.nodes == ("node-s2",)
    assert "pipeline stage 2 (ranks 16..23 on node-s2)" in f.summary
    assert "other stages" in f.summary
    ev = f.evidence
    assert isinstance(ev, StragglerIncidentEvidence)
    assert ev.scope == "group" and ev.normalization is Normalization.OWN_HISTORY
    assert 25 <= ev.slowdown_pct <= 35
    assert ev.others_change_pct is not None and abs(ev.others_change_pct) < 3
    assert ev.peer_group.ranks == STAGES[2]
    resolved = [(st, g) for st, g in found if g.resolved]
    assert [g.key for _, g in resolved] == [f.key]
    assert 250 < resolved[0][0] < 400


def test_the_default_policy_escalates_it_as_a_straggler_on_one_node() -> None:
    """A group on one node is the same situation as a straggler on it: the default
    straggler rule (checkpoint, isolate, restart once it persisted and costs >= 10%)
    matches it, and the incident names that one node (what isolation acts on)."""
    found = _opened(_run(200, lambda st, p: 1.3 if p == 2 and st >= 100 else 1.0))
    ((_, f),) = found
    rule = Policy().rule_for(str(f.kind), f.severity)
    assert rule is not None and rule.kind == "straggler"
    assert isinstance(f.evidence, StragglerIncidentEvidence)
    assert f.evidence.slowdown_pct >= rule.min_cost_pct
    assert len(f.nodes) == 1


def test_every_stage_slowing_together_blames_no_stage() -> None:
    """A job-wide slowdown (a new data shard, longer sequences) moves every stage's own
    history alike: no stage is slow against the others' change."""
    found = _run(400, lambda st, p: 1.3 if st >= 100 else 1.0)
    assert _opened(found) == []


def test_the_stage_slower_by_design_is_its_own_reference() -> None:
    """Stage 3 computes 1.2x (the loss) from its first step, and a second job's stage 1
    1.5x: slow from the start, their reference is that slowness; nothing is named."""
    assert _opened(_run(400, lambda st, p: 1.0)) == []
    assert _opened(_run(400, lambda st, p: 1.5 if p == 1 else 1.0)) == []


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_heavy_tailed_moe_jitter_names_no_group(seed: int) -> None:
    """MoE-like lognormal per-rank, per-step compute (sigma 0.3, multi-x tails) over 600
    healthy steps: group medians jitter, but no group is named."""
    found = _run(600, lambda st, p: 1.0, seed=seed, jitter=lambda r: math.exp(r.gauss(0, 0.3)))
    assert _opened(found) == []


def test_a_slowdown_during_a_global_phase_is_still_told_apart() -> None:
    """All stages 1.2x from step 80 (a warmup phase), then stage 1's node 1.3x more from
    step 200: only stage 1 is named, against the others' +20%."""
    found = _opened(
        _run(320, lambda st, p: (1.2 if st >= 80 else 1.0) * (1.3 if p == 1 and st >= 200 else 1.0))
    )
    assert [(f.ranks, f.nodes) for _, f in found] == [(tuple(STAGES[1]), ("node-s1",))]
    assert found[0][0] > 200


def test_a_restart_resolves_the_open_group_incident() -> None:
    """The job restarts (its ranks report ``started`` again): the slow group's incident
    ends with the run, as an open straggler's does."""
    found = _run(200, lambda st, p: 1.3 if p == 2 and st >= 100 else 1.0)
    ((_, f),) = _opened(found)
    trackers = JobTrackers()
    rng = random.Random(5)
    for step in range(200):
        rows = _step(step, rng, lambda st, p: 1.3 if p == 2 and st >= 100 else 1.0, lambda: 1.0)
        trackers.observe("n", JobRecords(steps=rows), float(step))
        trackers.evaluate(float(step))
    tracker = trackers.tracker(JOB)
    assert tracker.groups_slow.open_ranks == set(STAGES[2])
    tracker._new_incarnation(300.0)
    ended = trackers.evaluate(300.0)
    assert [(g.key, g.resolved) for g in ended] == [(f.key, True)]


def test_very_heavy_tailed_jitter_names_no_group() -> None:
    """Lognormal sigma 0.8 (a group median that moves +-35% step to step): the group
    detector's standard errors cover both its windows, and its reference learns from
    steps within half the threshold in standard errors, so no group is named (per-rank
    straggler verdicts at this noise are the straggler detector's business)."""
    found = _run(800, lambda st, p: 1.0, seed=3, jitter=lambda r: math.exp(r.gauss(0, 0.8)))
    assert [f.key for _, f in _opened(found) if ":group:" in f.key] == []


def test_a_step_missing_one_summary_keeps_the_group_and_its_incident() -> None:
    """Steps are compared with 90% of the ranks; a rank's missing summary does not make
    its group a new one (which reset the history and lost the open incident)."""
    rng = random.Random(7)
    trackers = JobTrackers()
    found: list[Finding] = []
    for step in range(300):
        rows = _step(
            step, rng, lambda st, p: 1.3 if p == 2 and 100 <= st < 180 else 1.0, lambda: 1.0
        )
        if step % 7 == 0:
            rows = [s for s in rows if s.rank != 17]
        trackers.observe("n", JobRecords(steps=rows), float(step))
        found += trackers.evaluate(float(step) + 13.0)  # the incomplete step's wait is over
    groups = [f for f in found if ":group:" in f.key and not f.refresh]
    assert [(f.ranks, f.resolved) for f in groups] == [
        (tuple(STAGES[2]), False),
        (tuple(STAGES[2]), True),
    ]


def test_the_others_median_leaves_out_exactly_the_group_itself() -> None:
    """The other groups' median comes from one sorted list of every group's change, with
    the group's own value left out once (ties included)."""
    from statistics import median

    from controller.logic.detection.c4d.group_slow import _median_without

    rng = random.Random(3)
    for _ in range(500):
        values = sorted(rng.choice([1.0, 1.1, rng.random()]) for _ in range(rng.randint(2, 9)))
        own = rng.choice(values)
        rest = list(values)
        rest.remove(own)
        assert _median_without(values, own) == pytest.approx(median(rest))
