"""Peer groups derived from real process groups: TP groups of two sizes on real gloo ranks.

Six ranks (three simulated nodes) build plain ``new_group`` TP groups, one of 4 ranks and
one of 2 whose ranks compute 35% longer (a larger shard each), with no role declared and
no mesh. The wrapper's summaries must carry the sizes of the groups each rank's collectives
use, and the detector must compare ranks only with ranks in groups of the same size. The
same summaries with the derived role stripped show what that avoids: both ranks of the
smaller group blamed.
"""

from __future__ import annotations

from typing import Any

import pytest

from bench.detect_gloo import run_gloo
from bench.detect_sim import Delivery, replay
from controller.logic.detection.c4d import FindingKind, JobTrackers
from controller.logic.detection.c4d.peers import PeerBasis, PeerKey
from trainguard.wire import JobRecords

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SCENARIO: dict[str, Any] = {
    "name": "gloo-tp-mixed-test",
    "world": 6,
    "tp_groups": [[0, 1, 2, 3], [4, 5]],
    "tp_work": {"2": 1.35},
    "compute_s": 0.02,
    "steps": 70,
}


def test_tp_groups_of_two_sizes_are_told_apart_from_their_process_groups() -> None:
    steps = run_gloo(SCENARIO)
    assert len(steps) == SCENARIO["steps"] and all(len(rows) == 6 for rows in steps)
    roles = {s.rank: s.role for s in steps[-1]}
    assert roles == {0: "pg_sizes=4", 1: "pg_sizes=4", 2: "pg_sizes=4", 3: "pg_sizes=4"} | {
        4: "pg_sizes=2",
        5: "pg_sizes=2",
    }
    assert all(s.group_ranks == [] for s in steps[-1])

    trackers = JobTrackers()
    for i, rows in enumerate(steps):
        trackers.observe("n", JobRecords(steps=rows), float(i))
        assert trackers.evaluate(float(i)) == []
    state = trackers.jobs[SCENARIO["name"]].stragglers
    four, two = PeerKey("pg_sizes=4", ()), PeerKey("pg_sizes=2", ())
    assert {r: state.rank_group[r] for r in range(6)} == {r: four for r in range(4)} | {
        4: two,
        5: two,
    }
    assert four.basis is PeerBasis.PROCESS_GROUPS and "same sizes" in four.why(None)
    assert sorted(state.groups[two].scores) == [4, 5]  # judged, against each other

    # Delivered as agents on 1 s timers would: still nothing. Compared job-wide (the
    # derived role stripped), the two ranks of the smaller group are called stragglers.
    assert replay(steps, 2, Delivery(interval_s=1.0), seed=1).opened == []
    stripped = [[s.model_copy(update={"role": None}) for s in rows] for rows in steps]
    blamed = replay(stripped, 2, Delivery(interval_s=1.0), seed=1).opened
    assert sorted(f.ranks for _, f in blamed if f.kind is FindingKind.STRAGGLER) == [(4,), (5,)]
