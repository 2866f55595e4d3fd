"""NaN/Inf origin and ranks killed from outside: the right rank named, not its victims."""

from __future__ import annotations

from controller.logic.detection.c4d import FindingKind, JobTrackers
from controller.logic.detection.c4d.nonfinite import origins
from trainguard.wire import JobRecords, RankEvent, StepSummary

JOB = "llm-7b"
WORLD = 4


def node_of(rank: int) -> str:
    return f"node-{rank // 2}"


def summary(rank: int, step: int, first_seq: int | None = None, calls: int = 1) -> StepSummary:
    """One rank's step; ``first_seq``: its first reduction with a non-finite input."""
    extra = {}
    if first_seq is not None:
        extra = {
            "nonfinite_inputs": calls,
            "nonfinite_first_op": "all_reduce",
            "nonfinite_first_group": "w0",
            "nonfinite_first_seq": first_seq,
        }
    return StepSummary(
        job=JOB,
        rank=rank,
        world_size=WORLD,
        step=step,
        step_time_s=1.1,
        compute_time_s=1.0,
        collective_wait_s=0.1,
        gpu_index=rank % 2,
        **extra,
    )


def feed(trackers: JobTrackers, rows: list[StepSummary], now: float) -> list:  # type: ignore[type-arg]
    for r in rows:
        trackers.observe(node_of(r.rank), JobRecords(steps=[r]), now)
    return trackers.evaluate(now)


def test_the_rank_whose_input_was_nan_first_is_named_not_the_ranks_it_spread_to() -> None:
    trackers = JobTrackers()
    found = []
    for step in range(10):
        found += feed(trackers, [summary(r, step) for r in range(WORLD)], float(step))
    # Step 10: rank 2 feeds NaN into all_reduce #41; that all_reduce hands NaN to everyone,
    # whose next reduction (#42) then carries it; from step 11 on every rank is NaN at once.
    rows = [summary(r, 10, first_seq=41 if r == 2 else 42) for r in range(WORLD)]
    found += feed(trackers, rows, 10.0)
    for step in range(11, 15):
        found += feed(trackers, [summary(r, step, 4 * step + 1, 2) for r in range(WORLD)], step)
    (finding,) = [f for f in found if not f.refresh]
    # Every later step still carries NaN (the weights are NaN now): counted, refreshed.
    refreshes = [f for f in found if f.refresh]
    assert [f.evidence.as_json()["bad_steps"] for f in refreshes] == [2, 3, 4, 5]
    assert all(f.key == finding.key and f.evidence.as_json()["step"] == 10 for f in refreshes)
    assert refreshes[-1].summary.endswith("NaN/Inf in 5 steps so far")
    assert finding.kind is FindingKind.NONFINITE and not finding.resolved
    assert finding.evidence.as_json()["bad_steps"] == 1
    assert finding.ranks == (2,) and finding.nodes == ("node-1",)
    ev = finding.evidence.as_json()
    assert (ev["step"], ev["op"], ev["group"], ev["seq"]) == (10, "all_reduce", "w0", 41)
    assert ev["nonfinite_ranks"] == [0, 1, 2, 3] and ev["origin_ranks"] == [2]
    assert ev["first_seq_by_rank"] == {"0": 42, "1": 42, "2": 41, "3": 42}
    assert ev["confidence"] == 1.0 and ev["gpu_index"] == 0
    assert "rank(s) [2]" in finding.summary


def test_a_poisoned_rank_among_clean_peers_is_named_and_the_incident_clears() -> None:
    trackers = JobTrackers()
    rows = [summary(r, 0, first_seq=5 if r == 3 else None) for r in range(WORLD)]
    found = feed(trackers, rows, 0.0)
    # the job skipped the bad step (dynamic loss scaling does) and goes on clean
    for step in range(1, 25):
        found += feed(trackers, [summary(r, step) for r in range(WORLD)], float(step))
    assert [(f.kind, f.ranks, f.resolved) for f in found] == [
        (FindingKind.NONFINITE, (3,), False),
        (FindingKind.NONFINITE, (), True),
    ]
    assert found[0].evidence.as_json()["clean_ranks"] == 3


def test_nan_on_every_rank_at_once_names_them_all_with_low_confidence() -> None:
    rows = {r: summary(r, 0, first_seq=7) for r in range(WORLD)}
    assert origins(rows) == (0, 1, 2, 3)
    trackers = JobTrackers()
    (finding,) = feed(trackers, list(rows.values()), 0.0)
    assert finding.ranks == (0, 1, 2, 3) and finding.evidence.as_json()["confidence"] == 0.5
    assert "every rank" in finding.summary


def exited(rank: int, *, collateral: bool = False, vanished: bool = False) -> RankEvent:
    return RankEvent(
        job=JOB,
        rank=rank,
        kind="exited",
        exit_code=1 if collateral else None,
        time_unix_s=1.0,
        world_size=WORLD,
        collective_failed=collateral,
        disconnected=vanished,
        error="RuntimeError: Connection closed by peer" if collateral else "",
    )


def test_a_rank_killed_from_outside_is_the_crash_and_its_survivors_collateral() -> None:
    trackers = JobTrackers()
    # The survivors' collectives fail at once and their exits arrive first ...
    trackers.observe(
        "node-0",
        JobRecords(rank_events=[exited(0, collateral=True), exited(1, collateral=True)]),
        0.0,
    )
    trackers.observe("node-1", JobRecords(rank_events=[exited(3, collateral=True)]), 0.5)
    assert trackers.evaluate(1.0) == []
    # ... then rank 2's agent reports it vanished (no exit record; cause unknown) ...
    trackers.observe("node-1", JobRecords(rank_events=[exited(2, vanished=True)]), 2.5)
    found = trackers.evaluate(3.0) + trackers.evaluate(60.0)
    assert [(f.kind, f.ranks, f.nodes) for f in found] == [
        (FindingKind.RANK_CRASH, (2,), ("node-1",))
    ]
    ev = found[0].evidence.as_json()
    assert ev["disconnected"] is True and ev["collateral_ranks"] == [0, 1, 3]
    assert ev["exit_code"] is None and ev["signal"] is None
    assert "vanished" in found[0].summary


def test_without_the_vanished_report_the_survivors_would_be_blamed() -> None:
    """The audit's failure: survivors named as a communication failure."""
    trackers = JobTrackers()
    trackers.observe(
        "node-0",
        JobRecords(rank_events=[exited(0, collateral=True), exited(1, collateral=True)]),
        0.0,
    )
    (finding,) = trackers.evaluate(11.0)
    assert finding.kind is FindingKind.COMM_FAILURE and finding.ranks == (0, 1)


def test_ranks_vanishing_after_the_first_are_folded_into_it() -> None:
    trackers = JobTrackers()
    # rank 1 is OOM-killed; its launcher then kills the node's other rank
    trackers.observe("node-0", JobRecords(rank_events=[exited(1, vanished=True)]), 0.0)
    trackers.observe("node-0", JobRecords(rank_events=[exited(0, vanished=True)]), 1.0)
    trackers.observe("node-1", JobRecords(rank_events=[exited(3, collateral=True)]), 1.5)
    found = trackers.evaluate(2.0) + trackers.evaluate(60.0)
    assert [(f.kind, f.ranks) for f in found] == [(FindingKind.RANK_CRASH, (1,))]


def test_a_clean_exit_is_still_no_crash() -> None:
    trackers = JobTrackers()
    ev = RankEvent(job=JOB, rank=0, kind="exited", time_unix_s=1.0, world_size=WORLD)
    trackers.observe("node-0", JobRecords(rank_events=[ev]), 0.0)
    assert trackers.evaluate(30.0) == []


def test_a_later_step_arriving_first_does_not_hide_the_origin() -> None:
    """Nodes report on their own schedules: step 11 (NaN everywhere) may arrive before step
    10 (NaN from rank 1 only); comparing steps in order would drop step 10 as late."""
    trackers = JobTrackers()
    found = []
    for step in range(10):
        found += feed(trackers, [summary(r, step) for r in range(WORLD)], float(step))
    found += feed(trackers, [summary(r, 11, first_seq=45, calls=2) for r in range(WORLD)], 11.0)
    found += feed(trackers, [summary(r, 12, first_seq=49, calls=2) for r in range(WORLD)], 12.0)
    assert found == []  # step 10 is missing: an earlier NaN may still turn up
    rows = [summary(r, 10, first_seq=42 if r == 1 else None) for r in range(WORLD)]
    found += feed(trackers, rows, 13.0)
    (finding,) = found
    assert finding.ranks == (1,) and finding.evidence.as_json()["step"] == 10


def test_a_step_that_never_completes_is_judged_after_the_grace() -> None:
    trackers = JobTrackers()
    for step in range(3):
        feed(trackers, [summary(r, step) for r in range(WORLD)], float(step))
    # rank 3's summary of step 3 never arrives (its node went quiet)
    assert (
        feed(trackers, [summary(r, 3, first_seq=13 if r == 0 else None) for r in range(3)], 3.0)
        == []
    )
    (finding,) = trackers.evaluate(3.0 + 10.0)
    assert finding.ranks == (0,) and finding.evidence.as_json()["clean_ranks"] == 2


def test_every_rank_vanishing_together_is_a_stop_from_outside_not_a_crash() -> None:
    """The actuator's restart (SIGTERM) or an operator killing the whole job."""
    trackers = JobTrackers()
    feed(trackers, [summary(r, 0) for r in range(WORLD)], 0.0)
    for r in range(WORLD):
        trackers.observe(node_of(r), JobRecords(rank_events=[exited(r, vanished=True)]), 1.0)
    assert trackers.evaluate(2.0) == [] and trackers.evaluate(30.0) == []


def test_a_lone_vanished_rank_whose_peers_hang_is_still_a_crash() -> None:
    """NCCL peers do not fail, they wait: no collateral exit ever comes."""
    trackers = JobTrackers()
    feed(trackers, [summary(r, 0) for r in range(WORLD)], 0.0)
    trackers.observe("node-1", JobRecords(rank_events=[exited(3, vanished=True)]), 1.0)
    assert trackers.evaluate(5.0) == []  # the job may be stopping as a whole: wait
    (finding,) = trackers.evaluate(11.5)
    assert finding.kind is FindingKind.RANK_CRASH and finding.ranks == (3,)
    assert finding.evidence.as_json()["collateral_ranks"] == []


def test_a_resent_summary_does_not_make_a_step_look_complete_before_the_origin_reports() -> None:
    trackers = JobTrackers()
    found = []
    for step in range(10):
        found += feed(trackers, [summary(r, step) for r in range(WORLD)], 0.0)
    # Step 10: rank 1 fed NaN into #5, but its summary is late; ranks 0, 2, 3 report step 10
    # clean and rank 0's summary comes twice (a spool resend): three ranks, four summaries.
    found += feed(trackers, [summary(r, 10) for r in (0, 2, 3, 0)], 1.0)
    # Step 11: NaN everywhere (the reduction spread it).
    found += feed(trackers, [summary(r, 11, first_seq=9) for r in range(WORLD)], 1.5)
    assert not [f for f in found if f.kind is FindingKind.NONFINITE]  # step 10 still incomplete
    found += feed(trackers, [summary(1, 10, first_seq=5)], 2.0)
    (finding,) = [f for f in found if f.kind is FindingKind.NONFINITE]
    assert finding.ranks == (1,) and finding.evidence.as_json()["step"] == 10
    assert finding.evidence.as_json()["confidence"] == 1.0


def test_first_nan_calls_in_groups_that_cannot_be_ordered_lower_confidence_and_name_each() -> None:
    # DP2 x PP2: rank 0 (stage 0) makes a NaN and sends it to rank 2 (stage 1) by a pipeline
    # send, which is not checked; each feeds it into its own stage's data-parallel
    # all-reduce (#50 of dp_s0 and #50 of dp_s1). Which came first cannot be told.
    def poisoned(rank: int) -> StepSummary:
        return summary(rank, 0, first_seq=50).model_copy(
            update={"nonfinite_first_group": f"dp_s{rank // 2}"}
        )

    rows = [poisoned(r) if r in (0, 2) else summary(r, 0) for r in range(WORLD)]
    (finding,) = feed(JobTrackers(), rows, 0.0)
    assert finding.ranks == (0, 2)
    ev = finding.evidence.as_json()
    assert ev["confidence"] == 0.5
    assert ev["origin_group_by_rank"] == {"0": "dp_s0", "2": "dp_s1"}
    assert "all_reduce #50 of group dp_s0" in finding.summary
    assert "all_reduce #50 of group dp_s1" in finding.summary
    assert "cannot be ordered" in finding.summary
    # One group only: its lowest call is unambiguous (and the new field is not set).
    (single,) = feed(JobTrackers(), [summary(r, 0, 5 if r == 1 else None) for r in range(4)], 0)
    assert single.evidence.as_json()["confidence"] == 1.0
    assert "origin_group_by_rank" not in single.evidence.as_json()
