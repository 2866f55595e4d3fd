"""Findings of the detection acceptance probe (plain data through ``JobTrackers``).

- A rank slow only in the job's first steps (checkpoint load, compile warm-up) opened a
  straggler: its half-filled window's median moved after 6 slow steps of 10. A window not
  yet full is now padded with neutral ratios, so the rule the docs state (a slowdown must
  cover more than half of a 20-step window) holds from the first step.
- A rank slow on fewer than half its steps (2x on 1 step in 3: a third of the job's time)
  was never named: the window median ignores it. The sporadic rule names it, and stays
  silent on skewed noise (1% of steps 5x slower, a single 50x step).
- The peer-group cache's fingerprint (role, length, first, middle, last) kept a stale group
  when a member in between changed.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from controller.logic.detection.c4d import Finding, FindingKind, JobTrackers
from controller.logic.detection.c4d.evidence import StragglerEvidence
from controller.logic.detection.c4d.peers import PeerIndex
from trainguard.wire import JobRecords, StepSummary

WORLD = 16


def _rows(step: int, compute: dict[int, float]) -> list[StepSummary]:
    top = max(compute.values())
    return [
        StepSummary(
            job="j",
            rank=r,
            world_size=WORLD,
            step=step,
            step_time_s=top + 0.1,
            compute_time_s=c,
            collective_wait_s=top - c + 0.1,
        )
        for r, c in compute.items()
    ]


def _drive(
    steps: int, factor: Callable[[int, int, random.Random], float], seed: int = 0
) -> list[tuple[int, Finding]]:
    """``steps`` steps of a 16-rank data-parallel job, each rank's compute 1 s times
    ``factor(rank, step, rng)``, fed and evaluated one step at a time."""
    rng = random.Random(seed)
    trackers = JobTrackers()
    found: list[tuple[int, Finding]] = []
    for step in range(steps):
        compute = {r: factor(r, step, rng) for r in range(WORLD)}
        trackers.observe("n0", JobRecords(steps=_rows(step, compute)), float(step))
        found += [(step, f) for f in trackers.evaluate(float(step))]
    return found


def _opened(found: list[tuple[int, Finding]]) -> list[tuple[int, tuple[int, ...]]]:
    return [
        (step, f.ranks)
        for step, f in found
        if f.kind is FindingKind.STRAGGLER and not (f.resolved or f.refresh)
    ]


def _noise(rng: random.Random) -> float:
    return 1 + rng.gauss(0, 0.01)


def test_a_warm_up_burst_in_the_first_steps_opens_nothing() -> None:
    for burst in (6, 8, 9):
        found = _drive(120, lambda r, s, g, n=burst: (2.0 if r == 0 and s < n else 1.0) * _noise(g))
        assert _opened(found) == [], burst


def test_a_rank_slow_from_its_first_step_is_still_named_early() -> None:
    """Padding costs at most a step or two: 10 slow steps of 10 already fill half the
    window (before the fix: named after step 10 for all three; after: 10, 10, 11)."""
    for slow, by in ((2.0, 11), (1.2, 11), (1.1, 12)):
        found = _drive(60, lambda r, s, g, x=slow: (x if r == 0 else 1.0) * _noise(g))
        opened = _opened(found)
        assert opened and opened[0][1] == (0,), slow
        assert opened[0][0] <= by, (slow, opened)


def test_a_rank_slow_on_one_step_in_three_is_named_with_its_cost() -> None:
    found = _drive(150, lambda r, s, g: (2.0 if r == 3 and s % 3 == 0 else 1.0) * _noise(g))
    opened = [(step, f) for step, f in found if f.kind is FindingKind.STRAGGLER and not f.refresh]
    assert [(f.ranks, f.resolved) for _, f in opened] == [((3,), False)]
    step, finding = opened[0]
    assert step <= 45  # two windows of evidence, then 3 of 5 flagged steps
    ev = StragglerEvidence.model_validate(finding.evidence)
    assert 0.25 <= ev.step_cost_pct / 100 <= 0.4
    assert ev.verdict.startswith("slow on ")


def test_a_rank_slow_on_one_step_in_five_at_3x_is_named() -> None:
    found = _drive(150, lambda r, s, g: (3.0 if r == 7 and s % 5 == 0 else 1.0) * _noise(g))
    assert [ranks for _, ranks in _opened(found)] == [(7,)]


def test_skewed_noise_and_a_single_huge_step_open_nothing() -> None:
    """The sporadic rule's own false-positive check: lognormal noise with 1% of steps 5x
    slower on every rank, and one 50x step on one rank."""
    found = _drive(600, lambda r, s, g: g.lognormvariate(0, 0.05) * (5 if g.random() < 0.01 else 1))
    found += _drive(200, lambda r, s, g: (50.0 if r == 5 and s == 100 else 1.0) * _noise(g))
    assert _opened(found) == []


def test_a_changed_member_between_first_middle_and_last_gives_a_new_peer_key() -> None:
    index = PeerIndex()

    def summary(group: list[int]) -> StepSummary:
        return StepSummary(
            job="j",
            rank=0,
            world_size=WORLD,
            step=1,
            step_time_s=1.0,
            compute_time_s=1.0,
            collective_wait_s=0.0,
            group_ranks=group,
        )

    assert index.key(summary([0, 4, 8, 12])).members == (0, 4, 8, 12)
    assert index.key(summary([0, 5, 8, 12])).members == (0, 5, 8, 12)
    assert index.key(summary([0, 5, 8, 12])).members == (0, 5, 8, 12)
