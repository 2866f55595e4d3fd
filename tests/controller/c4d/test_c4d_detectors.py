"""C4D-style job detectors on synthetic record streams with known ground truth."""

from __future__ import annotations

import random

import pytest

from controller.logic.detection.c4d import C4DConfig, FindingKind, JobTrackers
from controller.logic.detection.c4d.probe import localize
from tests.controller.c4d.steps import JOB, node_of, step_records
from trainguard.wire import (
    InflightCollective,
    JobRecords,
    ProbeResult,
    RankEvent,
    StepSummary,
)


def feed(trackers: JobTrackers, steps: list[StepSummary], now: float = 0.0) -> None:
    by_node: dict[str, list[StepSummary]] = {}
    for s in steps:
        by_node.setdefault(node_of(s.rank), []).append(s)
    for node, rows in by_node.items():
        trackers.observe(node, JobRecords(steps=rows), now)


def run_steps(trackers: JobTrackers, first: int, last: int, **kw: object) -> list:  # type: ignore[type-arg]
    found = []
    for step in range(first, last):
        feed(trackers, step_records(step, **kw))  # type: ignore[arg-type]
        found += trackers.evaluate(float(step))
    return found


def test_persistent_straggler_is_named_with_its_slowdown_and_then_clears() -> None:
    trackers = JobTrackers()
    found = run_steps(trackers, 0, 30, world=8, compute={5: 1.2}, jitter=0.05)
    stragglers = [f for f in found if f.kind is FindingKind.STRAGGLER]
    assert [(f.ranks, f.nodes, f.resolved) for f in stragglers] == [((5,), ("node-1",), False)]
    assert 15 <= stragglers[0].evidence.as_json()["slowdown_pct"] <= 25
    assert stragglers[0].evidence.as_json()["gpu_index"] == 1
    # Fixed: as the window rolls over the open incident's reading falls, then it resolves,
    # once, after three whole windows (60 steps) of calm (hysteresis against flapping).
    later = run_steps(trackers, 30, 60, world=8, jitter=0.05)
    assert [f for f in later if not f.refresh] == []
    later += run_steps(trackers, 60, 110, world=8, jitter=0.05)
    news = [(f.kind, f.ranks, f.resolved) for f in later if not f.refresh]
    assert news == [(FindingKind.STRAGGLER, (5,), True)]
    readings = [f.evidence.as_json()["slowdown_pct"] for f in later if f.refresh]
    assert readings == sorted(readings, reverse=True) and readings[-1] < 15


@pytest.mark.parametrize("world", [2, 3, 8])
def test_twenty_percent_jitter_alone_raises_nothing(world: int) -> None:
    trackers = JobTrackers()
    rng = random.Random(world)
    found = []
    for step in range(1500):
        feed(trackers, step_records(step, world, jitter=0.2, rng=rng))
        found += trackers.evaluate(float(step))
    assert found == []


@pytest.mark.parametrize(("slowdown", "jitter"), [(0.1, 0.05), (0.2, 0.2), (0.5, 0.1)])
def test_straggler_is_localized_within_thirty_steps(slowdown: float, jitter: float) -> None:
    trackers = JobTrackers()
    rng = random.Random(3)
    for step in range(30):
        feed(trackers, step_records(step, 8, compute={2: 1 + slowdown}, jitter=jitter, rng=rng))
        found = trackers.evaluate(float(step))
        if found:
            assert [(f.kind, f.ranks) for f in found] == [(FindingKind.STRAGGLER, (2,))]
            return
    pytest.fail(f"a {slowdown:.0%} straggler with {jitter:.0%} jitter went unnoticed")


def test_a_brief_slowdown_does_not_open_a_straggler() -> None:
    trackers = JobTrackers()
    found = run_steps(trackers, 0, 25, world=8)
    found += run_steps(trackers, 25, 29, world=8, compute={2: 1.5})
    found += run_steps(trackers, 29, 60, world=8)
    assert [f for f in found if f.kind is FindingKind.STRAGGLER] == []


def test_two_rank_job_still_finds_its_straggler() -> None:
    trackers = JobTrackers()
    found = run_steps(trackers, 0, 20, world=2, compute={0: 1.3})
    assert [(f.kind, f.ranks) for f in found] == [(FindingKind.STRAGGLER, (0,))]


def test_long_compute_without_short_wait_is_not_blamed() -> None:
    """A rank that computes long but also waits long is behind something else (its
    collectives are slow), not a straggler."""
    trackers = JobTrackers()
    found = []
    for step in range(40):
        rows = step_records(step, 8)
        rows[3] = rows[3].model_copy(update={"compute_time_s": 1.4, "collective_wait_s": 0.5})
        feed(trackers, rows)
        found += trackers.evaluate(float(step))
    assert [f for f in found if f.kind is FindingKind.STRAGGLER] == []


def test_wall_clock_skew_between_nodes_cannot_fake_a_straggler() -> None:
    trackers = JobTrackers()
    found = []
    for step in range(40):
        rows = [
            s.model_copy(update={"end_unix_s": 1e9 + step + (3600.0 if s.rank >= 4 else 0.0)})
            for s in step_records(step, 8)
        ]
        feed(trackers, rows)
        found += trackers.evaluate(float(step))
    assert found == []


def test_a_late_summary_still_counts_for_its_step() -> None:
    """The straggler's own summary arrives last; its step waits for it (within grace)."""
    trackers = JobTrackers()
    found = []
    for step in range(25):
        rows = step_records(step, 4, compute={3: 1.25})
        feed(trackers, [r for r in rows if r.rank != 3], float(step))
        found += trackers.evaluate(float(step))
        feed(trackers, [r for r in rows if r.rank == 3], float(step) + 0.5)
        found += trackers.evaluate(float(step) + 0.5)
    assert [(f.kind, f.ranks) for f in found] == [(FindingKind.STRAGGLER, (3,))]


def inflight(
    rank: int,
    *,
    group: str = "world",
    seq: int = 17,
    elapsed: float = 12.0,
    members: list[int] | None = None,
    done: dict[str, int] | None = None,
    op: str = "all_reduce",
) -> InflightCollective:
    return InflightCollective(
        job=JOB,
        rank=rank,
        group=group,
        op=op,
        seq=seq,
        elapsed_s=elapsed,
        group_ranks=members or [],
        last_completed_seq=done or {group: seq - 1},
        step=40,
    )


def test_ranks_that_never_entered_the_stuck_collective_are_the_culprits() -> None:
    trackers = JobTrackers()
    feed(trackers, step_records(0, 8))
    for r in (0, 1, 3, 4, 5, 6, 7):
        trackers.observe(node_of(r), JobRecords(inflight=[inflight(r)]), 100.0)
    found = trackers.evaluate(100.0)
    hangs = [f for f in found if f.kind is FindingKind.HANG]
    assert len(hangs) == 1
    assert hangs[0].ranks == (2,) and hangs[0].nodes == ("node-0",)
    assert (
        hangs[0].evidence.as_json()["seq"] == 17
        and hangs[0].evidence.as_json()["op"] == "all_reduce"
    )
    # Re-reported while still stuck: the same hang is not reported twice.
    for r in (0, 1):
        trackers.observe(node_of(r), JobRecords(inflight=[inflight(r, elapsed=20.0)]), 105.0)
    assert [f for f in trackers.evaluate(105.0) if f.kind is FindingKind.HANG] == []


def test_subgroup_hang_uses_membership_and_progress_in_other_groups() -> None:
    trackers = JobTrackers()
    feed(trackers, step_records(0, 4))
    # Rank 0 waits in tp-group {0,1} call #5; rank 1 is stuck in the dp group instead and
    # says it completed only #4 of the tp group: it never reached #5.
    trackers.observe(
        "node-0",
        JobRecords(
            inflight=[
                inflight(0, group="tp01", seq=5, members=[0, 1], done={"tp01": 4, "dp": 9}),
                inflight(
                    1, group="dp", seq=10, elapsed=11.0, members=[1, 3], done={"tp01": 4, "dp": 9}
                ),
            ]
        ),
        50.0,
    )
    # Rank 1 is absent from tp01 only because it waits in dp for rank 3: a victim. One
    # fault, one incident, naming the origin (stuck nowhere), with the chain as evidence.
    (found,) = trackers.evaluate(50.0)
    assert found.kind is FindingKind.HANG and found.ranks == (3,)
    assert found.evidence.as_json()["group"] == "dp"


def test_a_rank_hung_before_its_tp_all_reduce_is_named_not_its_waiting_peers() -> None:
    """TP=2 x DP=2: rank 3 hangs before the tp{2,3} all-reduce. Rank 2 waits inside it and
    so never reaches dp{0,2}; ranks 0 and 1 wait in their dp calls. Only rank 3 is named."""
    trackers = JobTrackers()
    feed(trackers, step_records(0, 4))
    done = {"tp01": 8, "tp23": 7, "dp02": 4, "dp13": 4}
    records = [
        inflight(0, group="dp02", seq=5, members=[0, 2], done=done),
        inflight(1, group="dp13", seq=5, members=[1, 3], done=done),
        inflight(2, group="tp23", seq=8, members=[2, 3], done=done),
    ]
    for rec in records:
        trackers.observe(node_of(rec.rank), JobRecords(inflight=[rec]), 30.0)
    hangs = [f for f in trackers.evaluate(30.0) if f.kind is FindingKind.HANG]
    assert [f.ranks for f in hangs] == [(3,)]


def test_all_members_inside_means_a_communication_hang_with_probe_pairs() -> None:
    trackers = JobTrackers()
    feed(trackers, step_records(0, 4))
    for r in range(4):
        trackers.observe(node_of(r), JobRecords(inflight=[inflight(r)]), 10.0)
    (finding,) = trackers.evaluate(10.0)
    assert finding.kind is FindingKind.COMM_HANG
    assert finding.probe_pairs == ((0, 1), (1, 2), (2, 3), (3, 0))
    assert finding.evidence.as_json()["probe"].startswith("deferred")  # the operator is told when


def test_short_stalls_are_not_hangs_and_cleared_hangs_resolve() -> None:
    trackers = JobTrackers(C4DConfig(hang_timeout_s=10.0))
    feed(trackers, step_records(0, 2))
    trackers.observe("node-0", JobRecords(inflight=[inflight(0, elapsed=3.0)]), 1.0)
    assert trackers.evaluate(1.0) == []
    trackers.observe("node-0", JobRecords(inflight=[inflight(0, elapsed=15.0)]), 2.0)
    (opened,) = trackers.evaluate(2.0)
    assert opened.kind is FindingKind.HANG and not opened.resolved
    # Rank 0 completes a later step: its in-flight record is gone, the hang resolves.
    feed(trackers, step_records(41, 2))
    resolved = [f for f in trackers.evaluate(3.0) if f.kind is FindingKind.HANG]
    assert [f.resolved for f in resolved] == [True]


def test_stale_inflight_records_expire() -> None:
    trackers = JobTrackers(C4DConfig(inflight_ttl_s=5.0))
    feed(trackers, step_records(0, 2))
    trackers.observe("node-0", JobRecords(inflight=[inflight(0, elapsed=3.0)]), 0.0)
    assert trackers.evaluate(1.0) == []
    assert trackers.evaluate(10.0) == []
    assert trackers.jobs[JOB].inflight == {}


@pytest.mark.parametrize(
    ("code", "signal", "crash"), [(1, None, True), (None, "SIGKILL", True), (0, None, False)]
)
def test_rank_exit_with_error_is_a_crash(code: int | None, signal: str | None, crash: bool) -> None:
    trackers = JobTrackers()
    ev = RankEvent(
        job=JOB, rank=6, kind="exited", exit_code=code, signal=signal, time_unix_s=1.0, world_size=8
    )
    trackers.observe("node-1", JobRecords(rank_events=[ev]), 0.0)
    found = trackers.evaluate(0.0)
    assert [(f.kind, f.ranks, f.nodes) for f in found] == (
        [(FindingKind.RANK_CRASH, (6,), ("node-1",))] if crash else []
    )


def test_job_wide_wait_rise_with_balanced_compute_is_slow_communication() -> None:
    trackers = JobTrackers()
    found = run_steps(trackers, 0, 50, world=8, comm_s=0.1, jitter=0.05)
    found += run_steps(trackers, 50, 60, world=8, comm_s=0.4, jitter=0.05)
    slow = [f for f in found if f.kind is FindingKind.COMM_SLOW]
    assert len(slow) == 1 and not slow[0].resolved
    assert len(slow[0].probe_pairs) == 8
    assert [f for f in found if f.kind is FindingKind.STRAGGLER] == []
    back = run_steps(trackers, 60, 80, world=8, comm_s=0.1, jitter=0.05)
    assert [(f.kind, f.resolved) for f in back] == [(FindingKind.COMM_SLOW, True)]


def probe(pairs_gbps: dict[tuple[int, int], float]) -> list[ProbeResult]:
    size = 8 << 20
    return [
        ProbeResult(
            job=JOB,
            probe_id="p1",
            src_rank=a,
            dst_rank=b,
            size_bytes=size,
            duration_s=size * 8 / (g * 1e9),
        )
        for (a, b), g in pairs_gbps.items()
    ]


RING8 = [(i, (i + 1) % 8) for i in range(8)]
NODES8 = {r: node_of(r) for r in range(8)}


def test_probe_blames_the_rank_common_to_slow_pairs() -> None:
    gbps = {p: 100.0 for p in RING8} | {(4, 5): 20.0, (5, 6): 25.0}
    verdict = localize(probe(gbps), NODES8, 0.5)
    assert (verdict.scope, verdict.culprit_ranks, verdict.culprit_nodes) == (
        "rank",
        (5,),
        ("node-1",),
    )


def test_probe_blames_a_node_when_its_ranks_are_slow_in_disjoint_pairs() -> None:
    pairs = [(0, 1), (2, 3), (4, 5), (6, 7)]
    gbps = {p: 100.0 for p in pairs} | {(4, 5): 10.0, (6, 7): 12.0}
    verdict = localize(probe(gbps), NODES8, 0.5)
    assert (verdict.scope, verdict.culprit_nodes) == ("node", ("node-1",))


def test_probe_single_slow_pair_is_a_link_and_healthy_probe_is_nothing() -> None:
    gbps = {p: 100.0 for p in RING8}
    assert localize(probe(gbps), NODES8, 0.5).scope == "none"
    gbps[(3, 4)] = 5.0
    verdict = localize(probe(gbps), NODES8, 0.5)
    assert (verdict.scope, verdict.culprit_ranks) == ("link", (3, 4))


def test_tracker_turns_a_probe_round_into_a_slow_link_finding() -> None:
    trackers = JobTrackers()
    feed(trackers, step_records(0, 8))
    gbps = {p: 100.0 for p in RING8} | {(1, 2): 10.0, (2, 3): 10.0}
    trackers.observe("node-0", JobRecords(probes=probe(gbps)), 0.0)
    finding = trackers.jobs[JOB].finish_probe("p1")
    assert finding is not None and finding.kind is FindingKind.SLOW_LINK
    assert finding.ranks == (2,) and finding.nodes == ("node-0",)


def test_config_refuses_inconsistent_thresholds() -> None:
    with pytest.raises(ValueError, match="straggler_confirm_steps"):
        C4DConfig(straggler_confirm_steps=0)
    with pytest.raises(ValueError, match="window_steps"):
        C4DConfig(window_steps=2)


def exited(rank: int, *, code: int | None = 1, collateral: bool = False) -> RankEvent:
    return RankEvent(
        job=JOB,
        rank=rank,
        kind="exited",
        exit_code=code,
        time_unix_s=1.0,
        world_size=8,
        collective_failed=collateral,
        error="RuntimeError: Connection closed by peer" if collateral else "",
    )


def test_a_crash_cascade_blames_the_rank_that_started_it() -> None:
    trackers = JobTrackers()
    # Peers' collectives fail first (their agents happen to report sooner) ...
    trackers.observe(
        "node-0",
        JobRecords(rank_events=[exited(0, collateral=True), exited(2, collateral=True)]),
        0.0,
    )
    assert trackers.evaluate(1.0) == []
    # ... then the primary crash arrives and absorbs them; later collateral stays quiet.
    trackers.observe("node-1", JobRecords(rank_events=[exited(6, code=7)]), 2.0)
    trackers.observe("node-1", JobRecords(rank_events=[exited(5, collateral=True)]), 3.0)
    found = trackers.evaluate(3.0) + trackers.evaluate(60.0)
    assert [(f.kind, f.ranks) for f in found] == [(FindingKind.RANK_CRASH, (6,))]
    assert found[0].evidence.as_json()["collateral_ranks"] == [0, 2]
    assert found[0].evidence.as_json()["exit_code"] == 7


def test_collective_failures_without_a_primary_crash_are_a_communication_failure() -> None:
    trackers = JobTrackers()
    trackers.observe("node-0", JobRecords(rank_events=[exited(1, collateral=True)]), 0.0)
    trackers.observe("node-1", JobRecords(rank_events=[exited(4, collateral=True)]), 1.0)
    assert trackers.evaluate(5.0) == []
    (finding,) = trackers.evaluate(11.0)
    assert finding.kind is FindingKind.COMM_FAILURE and finding.ranks == (1, 4)
    assert finding.nodes == ("node-0", "node-1")


def test_a_hung_rank_stuck_in_two_groups_is_one_incident() -> None:
    trackers = JobTrackers()
    feed(trackers, step_records(0, 4))
    # Rank 2 hangs in compute: ranks 0,1,3 wait in the world group, rank 3 also in {2,3}.
    recs = [inflight(r, members=[0, 1, 2, 3]) for r in (0, 1, 3)]
    recs.append(inflight(3, group="pp23", seq=8, members=[2, 3], done={"pp23": 7}))
    trackers.observe("node-0", JobRecords(inflight=recs), 5.0)
    (finding,) = trackers.evaluate(5.0)
    assert finding.kind is FindingKind.HANG and finding.ranks == (2,)
    assert len(finding.evidence.as_json()["stuck_calls"]) == 2
    assert finding.evidence.as_json()["confidence"] == 1.0


def test_a_hang_explained_by_a_crash_is_not_a_second_incident() -> None:
    trackers = JobTrackers()
    feed(trackers, step_records(0, 4))
    trackers.observe("node-0", JobRecords(rank_events=[exited(1, code=9)]), 0.0)
    recs = [inflight(r, members=[0, 1, 2, 3]) for r in (0, 2, 3)]
    trackers.observe("node-0", JobRecords(inflight=recs), 20.0)
    found = trackers.evaluate(20.0)
    assert [(f.kind, f.ranks) for f in found] == [(FindingKind.RANK_CRASH, (1,))]
    assert found[0].evidence.as_json()["confidence"] == 1.0


def started(rank: int, world: int) -> RankEvent:
    return RankEvent(job=JOB, rank=rank, kind="started", time_unix_s=1.0, world_size=world)


def test_a_restarted_job_is_judged_afresh_on_its_new_layout() -> None:
    """Resumed from a checkpoint on fewer ranks: repeated step numbers still count, the
    old run's straggler resolves, and a straggler of the new run is found again."""
    trackers = JobTrackers()
    found = run_steps(trackers, 0, 40, world=8, compute={5: 1.3}, jitter=0.05)
    assert [(f.ranks, f.resolved) for f in found] == [((5,), False)]
    # The job restarts with 6 ranks from the step-20 checkpoint; each rank's "started"
    # rides in the same batch as its first new steps.
    for step in range(20, 60):
        rows = step_records(step, 6, compute={1: 1.3}, jitter=0.05)
        events = [started(r, 6) for r in range(6)] if step == 20 else []
        trackers.observe("node-x", JobRecords(steps=rows, rank_events=events), float(step))
        found += trackers.evaluate(100.0 + step)
    assert [(f.kind, f.ranks, f.resolved) for f in found[1:]] == [
        (FindingKind.STRAGGLER, (5,), True),
        (FindingKind.STRAGGLER, (1,), False),
    ]
    assert trackers.jobs[JOB].world_size == 6


def test_a_restart_whose_started_events_never_arrived_is_seen_in_the_world_size() -> None:
    """The job restarts on 8 of its 16 ranks and its ``started`` events are lost (an agent
    restarted with them unsent): the summaries' new world size starts a new run, so its
    steps are compared (not dropped for lacking ranks that are gone), the old run's late
    summaries do not restart it again, and a hang blames none of the departed ranks."""
    trackers = JobTrackers()
    found = run_steps(trackers, 0, 40, world=16, jitter=0.05)
    for step in range(40, 120):
        rows = step_records(step, 8, compute={2: 1.3}, jitter=0.05)
        if step == 45:  # a node's backlog from the old run, a few seconds late
            rows += step_records(39, 16)[12:]
        feed(trackers, rows, float(step))
        found += trackers.evaluate(float(step))
    assert [(f.kind, f.ranks) for f in found if not f.refresh] == [(FindingKind.STRAGGLER, (2,))]
    tracker = trackers.jobs[JOB]
    assert (tracker.world_size, tracker.incarnation, tracker.last_compared_step) == (8, 1, 119)
    for r in range(8):
        trackers.observe(node_of(r), JobRecords(inflight=[inflight(r, seq=50)]), 130.0)
    hangs = [f for f in trackers.evaluate(130.0) if f.kind is not FindingKind.STRAGGLER]
    assert [(f.kind, f.ranks) for f in hangs] == [(FindingKind.COMM_HANG, tuple(range(8)))]


def test_a_growing_straggler_refreshes_its_open_incident() -> None:
    """Opened at ~12%, the rank slows to ~45%: the incident's reading follows (the policy's
    cost threshold and the operator read it), as a refresh of the same key, not a new one."""
    trackers = JobTrackers()
    found = run_steps(trackers, 0, 30, world=8, compute={5: 1.12}, jitter=0.02)
    (opened,) = [f for f in found if f.kind is FindingKind.STRAGGLER]
    assert not opened.refresh and 8 <= opened.evidence.as_json()["slowdown_pct"] <= 16
    later = run_steps(trackers, 30, 60, world=8, compute={5: 1.45}, jitter=0.02)
    assert later and all(f.refresh and f.key == opened.key for f in later), later
    assert 40 <= later[-1].evidence.as_json()["slowdown_pct"] <= 50
    assert (
        f"computes {later[-1].evidence.as_json()['slowdown_pct']:.0f}% longer" in later[-1].summary
    )
    # Steady now: nothing more until a minute has passed on the controller's clock.
    assert run_steps(trackers, 60, 80, world=8, compute={5: 1.45}, jitter=0.02) == []
    again = run_steps(trackers, 80, 150, world=8, compute={5: 1.45}, jitter=0.02)
    assert again and all(f.refresh for f in again)


def test_an_open_straggler_explains_a_job_wide_wait_rise() -> None:
    """Where ranks are coupled beyond one collective (pipeline stages), a straggler's delay
    reaches every rank's wait, its own included: it stops looking like a candidate (it no
    longer waits less than its peers) while still slow. The rise is its doing, not a slow
    link, so no ``comm_slow`` opens while it stays open."""
    trackers = JobTrackers()
    found = run_steps(trackers, 0, 50, world=8, jitter=0.05)
    found += run_steps(trackers, 50, 80, world=8, compute={5: 1.4}, jitter=0.05)
    assert [(f.kind, f.ranks) for f in found if not f.refresh] == [(FindingKind.STRAGGLER, (5,))]
    for step in range(80, 110):
        rows = step_records(step, 8, compute={5: 1.4}, jitter=0.05)
        wait = 0.1 + max(r.compute_time_s for r in rows) - rows[5].compute_time_s + 0.3
        feed(trackers, [r.model_copy(update={"collective_wait_s": wait}) for r in rows])
        found += trackers.evaluate(float(step))
    assert [f.kind for f in found if not f.refresh] == [FindingKind.STRAGGLER]


def test_a_mild_straggler_does_not_hide_a_network_slowdown_larger_than_its_delay() -> None:
    """A straggler accounts for a wait rise only up to its own extra time per step: rank 2
    computing 7% longer (~70 ms of a 1 s step) cannot explain the job's communication time
    going from 100 ms to 400 ms per step."""
    trackers = JobTrackers()
    found = run_steps(trackers, 0, 80, world=16, compute={2: 1.07}, jitter=0.02)
    assert [(f.kind, f.ranks) for f in found if not f.refresh] == [(FindingKind.STRAGGLER, (2,))]
    found = run_steps(trackers, 80, 120, world=16, compute={2: 1.07}, jitter=0.02, comm_s=0.4)
    (slow,) = [f for f in found if f.kind is FindingKind.COMM_SLOW]
    assert not slow.resolved and len(slow.ranks) == 16
    explained = slow.evidence.as_json()["straggler_explained_s"]
    assert 0.07 <= explained < 0.2
    assert "straggler(s) account for" in slow.summary


def test_half_of_a_group_slow_together_is_named_with_an_understated_slowdown() -> None:
    """What docs/detection.md ("Blind spots") says of half of a 64-rank group 30% slow
    together: the median lies between the halves, and each slow rank is named with its
    slowdown measured against that midpoint, understated."""
    trackers = JobTrackers()
    compute = {r: 1.3 for r in range(32)}
    found = run_steps(trackers, 0, 60, world=64, compute=compute, jitter=0.05)
    opened = [f for f in found if f.kind is FindingKind.STRAGGLER and not f.refresh]
    assert sorted(f.ranks[0] for f in opened) == list(range(32))
    assert all(8 <= f.evidence.as_json()["slowdown_pct"] <= 20 for f in opened)
