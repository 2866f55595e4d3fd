"""A compared step without a whole peer group's summaries (its node's report came late:
steps are compared once ``min_step_coverage`` of the ranks reported) keeps the group's
history (found in review of 1d71307: the group was dropped and rebuilt, its new reference
learned the slowdown in progress, and a 1.5x stage was never named)."""

from __future__ import annotations

import random

from controller.logic.detection.c4d.config import C4DConfig
from controller.logic.detection.c4d.group_slow import GroupSlowState
from controller.logic.detection.c4d.peers import PeerGroups
from trainguard.wire import StepSummary

RANKS = 40
PER_STAGE = 2


def _rows(step: int, rng: random.Random, skip: int | None) -> dict[int, StepSummary]:
    out = {}
    for r in range(RANKS):
        stage = r // PER_STAGE
        if stage == skip:
            continue
        slow = 1.5 if stage == 1 and step >= 60 else 1.0
        out[r] = StepSummary(
            job="j", rank=r, world_size=RANKS, step=step,
            compute_time_s=slow * (1 + rng.uniform(-0.05, 0.05)),
            collective_wait_s=0.1, step_time_s=1.7, role=f"pp_stage={stage}",
            pp_stage=stage, group_ranks=[g for g in range(RANKS) if g // PER_STAGE == stage],
        )  # fmt: skip
    return out


def _opened(drop_at: int | None) -> list[int]:
    rng = random.Random(1)
    peers, state = PeerGroups(), GroupSlowState("j", C4DConfig())
    opened = []
    for step in range(200):
        rows = _rows(step, rng, skip=1 if step == drop_at else None)
        peers.update(list(rows.values()), step)
        for finding in state.add(rows, peers, set(), dict.fromkeys(range(RANKS), "n"), step):
            if not finding.refresh and not finding.resolved:
                opened.append(step)
    return opened


def test_a_step_without_the_slow_group_does_not_hide_it() -> None:
    assert _opened(drop_at=None)  # the stage is named without a late report ...
    assert _opened(drop_at=62)  # ... and with one step that lacks all its ranks
