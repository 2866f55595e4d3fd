"""A restart with the same world size whose ``started`` events were lost, told from a
spool's resend of old steps by the wall-clock end times the summaries carry."""

from __future__ import annotations

from controller.logic.detection.c4d import FindingKind, JobTrackers
from controller.logic.detection.c4d.restart import RunClock
from tests.controller.c4d.steps import JOB, node_of, step_records
from trainguard.wire import JobRecords, StepSummary

WORLD = 8
T0 = 1_700_000_000.0


def timed(step: int, start_unix_s: float, **kw: object) -> list[StepSummary]:
    """A step's summaries as the job-side recorder sends them: with their end time (a run
    that began at ``start_unix_s``, one step per second)."""
    rows = step_records(step, WORLD, jitter=0.05, **kw)  # type: ignore[arg-type]
    return [s.model_copy(update={"end_unix_s": start_unix_s + step}) for s in rows]


def feed(trackers: JobTrackers, rows: list[StepSummary], now: float) -> list:  # type: ignore[type-arg]
    for s in rows:
        trackers.observe(node_of(s.rank), JobRecords(steps=[s]), now)
    return trackers.evaluate(now)


def first_run(trackers: JobTrackers) -> list:  # type: ignore[type-arg]
    found = []
    for step in range(200):
        found += feed(trackers, timed(step, T0, compute={5: 1.3}), float(step))
    assert [(f.kind, f.ranks) for f in found if not f.refresh] == [(FindingKind.STRAGGLER, (5,))]
    return found


def test_a_same_size_restart_without_started_events_is_judged_afresh() -> None:
    trackers = JobTrackers()
    first_run(trackers)
    # Restarted from step 0 (a lost checkpoint) 60 s later, same world size, no "started"
    # events; rank 2 is slow now. A node's backlog of the old run arrives late as well.
    found = []
    for step in range(80):
        rows = timed(step, T0 + 260.0, compute={2: 1.3})
        if step == 5:
            rows += timed(199, T0, compute={5: 1.3})[4:]
        found += feed(trackers, rows, 260.0 + step)
    assert [(f.kind, f.ranks, f.resolved) for f in found if not f.refresh] == [
        (FindingKind.STRAGGLER, (5,), True),
        (FindingKind.STRAGGLER, (2,), False),
    ]
    tracker = trackers.jobs[JOB]
    assert tracker.incarnation == 1 and tracker.stragglers.open_ranks == {2}
    assert tracker.last_compared_step == 79  # the old run's step 199 did not get in


def test_a_spool_resending_old_steps_is_not_a_restart() -> None:
    trackers = JobTrackers()
    first_run(trackers)
    # Every agent resends steps 150..199 (their original end times), then the job goes on.
    found = []
    for step in range(150, 200):
        found += feed(trackers, timed(step, T0, compute={5: 1.3}), 200.0)
    for step in range(200, 220):
        found += feed(trackers, timed(step, T0, compute={5: 1.3}), float(step))
    tracker = trackers.jobs[JOB]
    assert tracker.incarnation == 0 and tracker.stragglers.open_ranks == {5}
    assert not [f for f in found if f.resolved]


def test_one_rank_going_back_is_not_a_restart_and_no_end_time_never_counts() -> None:
    clock = RunClock()
    rows = timed(100, T0)
    for s in rows:
        clock.record(s)
    back = [s.model_copy(update={"step": 3, "end_unix_s": T0 + 500}) for s in rows]
    assert clock.went_back(back[0], 100) and not clock.restarted(WORLD)
    # Without an end time (older job-side code) a restart cannot be told from a resend.
    assert not clock.went_back(back[1].model_copy(update={"end_unix_s": None}), 100)
    # Within the clock margin of its highest step: not a new process.
    assert not clock.went_back(back[2].model_copy(update={"end_unix_s": T0 + 100.5}), 100)
    for s in back[1:4]:
        assert clock.went_back(s, 100)
    assert not clock.restarted(WORLD)  # 4 of 8: not more than half
    assert clock.went_back(back[4], 100) and clock.restarted(WORLD)
