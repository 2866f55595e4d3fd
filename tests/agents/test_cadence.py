"""The agent's report cadence: the timer, and the early report for step summaries."""

from __future__ import annotations

import pytest

from agents.cadence import ReportCadence
from agents.errors import AgentConfigError
from agents.settings import load_settings
from trainguard.wire import JobRecords, StepSummary


def steps(rank: int, n: int, job: str = "j") -> JobRecords:
    return JobRecords(
        steps=[
            StepSummary(
                job=job,
                rank=rank,
                world_size=8,
                step=i,
                step_time_s=0.07,
                compute_time_s=0.05,
                collective_wait_s=0.02,
            )
            for i in range(n)
        ]
    )


def cadence(**kw: float) -> ReportCadence:
    base = {"report_interval_s": 5.0, "job_flush_steps": 16, "job_flush_min_interval_s": 1.0}
    return ReportCadence(**{**base, **kw}, last_report_s=100.0)  # type: ignore[arg-type]


def test_without_step_summaries_the_timer_rules() -> None:
    c = cadence()
    assert c.due_s() == 105.0
    c.add(steps(0, 15))  # one short of the early flush
    assert c.due_s() == 105.0


def test_a_rank_with_job_flush_steps_new_summaries_makes_the_report_due_after_the_gap() -> None:
    c = cadence()
    c.add(steps(0, 10))
    c.add(steps(1, 10))  # 20 summaries, but per rank 10: not yet
    assert c.due_s() == 105.0
    c.add(steps(0, 6))
    assert c.most_pending_steps == 16
    assert c.due_s() == 101.0  # never sooner than the gap after the last report
    c.reported(101.2)
    assert c.most_pending_steps == 0 and c.due_s() == pytest.approx(106.2)


def test_other_jobs_count_apart_and_zero_turns_the_early_flush_off() -> None:
    c = cadence()
    c.add(steps(0, 8, job="a"))
    c.add(steps(0, 8, job="b"))
    assert c.due_s() == 105.0
    off = cadence(job_flush_steps=0)
    off.add(steps(0, 1000))
    assert off.due_s() == 105.0


def test_settings_defaults_and_bounds() -> None:
    s = load_settings(controller_url="http://c:1")
    assert (s.job_flush_steps, s.job_flush_min_interval_s) == (8, 1.0)
    with pytest.raises(AgentConfigError, match="job_flush_steps"):
        load_settings(controller_url="http://c:1", job_flush_steps=-1)
