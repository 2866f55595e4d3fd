"""Job retention: a controller that lives for months forgets the jobs that ended.

Every job its ranks report used to stay in memory for good: the cluster state's job, the
job detector's windows, ingest's world-size claims, the remediation engine's book. After
thousands of short jobs the controller held thousands of each. A job not heard from for
``job_retention_s`` now leaves all of them, while its rows stay in the database; a job
that something still needs (an open incident, a restart waiting for its resume, on a new
leader too) is kept, and a job that comes back under the same name starts afresh.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from tests.controller.db_reads import stored, stored_column
from tests.remediation.test_engine import ENGINE, Agents, on_loop, open_incident, recording
from tests.remediation.test_engine_resume_record import restart_policy, restarted
from tests.waiting import wait_for

pytestmark = [
    pytest.mark.parametrize("db_url", ["sqlite"], indirect=True),
    pytest.mark.usefixtures("fast_remediation_engine"),
]

ALERT_ONLY = "rules: [{kind: '*', steps: [alert]}]\n"


def job_records(
    jobs: list[str], *, world: int = 8, started: bool = True, exited: bool = False
) -> dict[str, Any]:
    """Every rank of each job started (or not), stepped three times, and exited (or not)."""
    now = time.time()
    events: list[dict[str, Any]] = []
    steps: list[dict[str, Any]] = []
    for job in jobs:
        for rank in range(world):
            rank_of = {"job": job, "rank": rank}
            if started:
                event = {**rank_of, "kind": "started", "world_size": world, "time_unix_s": now}
                events.append({**event, "local_rank": rank, "gpu_index": rank})
            steps += [
                {
                    **rank_of,
                    "world_size": world,
                    "step": step,
                    "step_time_s": 0.1,
                    "compute_time_s": 0.08,
                    "collective_wait_s": 0.02,
                    "end_unix_s": now - 0.3 + 0.1 * step,
                }
                for step in range(3)
            ]
            if exited:
                events.append({**rank_of, "kind": "exited", "exit_code": 0, "time_unix_s": now})
    return {"rank_events": events, "steps": steps}


def holding(*jobs: str) -> dict[str, set[str]]:
    """What :func:`per_job` says when every structure holds exactly ``jobs``."""
    return {holder: set(jobs) for holder in ("state", "detector", "ingest", "remediation")}


def per_job(live: Any) -> dict[str, set[str]]:
    """The jobs each per-job structure of the controller holds."""
    services = live.controller.services
    return {
        "state": set(services.state.jobs),
        "detector": set(services.jobs.trackers.jobs),
        "ingest": set(services.ingest._world),
        "remediation": set(services.remediation.jobs),
    }


def sweep_at(live: Any, now_unix_s: float) -> list[str]:
    """One retention sweep as the engine's tick runs it, at ``now_unix_s``, on the loop."""

    async def sweep() -> list[str]:
        await asyncio.sleep(0)
        return live.controller.remediation.retention.sweep(now_unix_s)  # type: ignore[no-any-return]

    return on_loop(live, sweep())  # type: ignore[no-any-return]


def test_ended_jobs_leave_every_per_job_structure_but_not_the_database(  # type: ignore[no-untyped-def]
    controller_factory, ctl_report, db_url, tmp_path
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(ALERT_ONLY)
    live = controller_factory(job_retention_s=1.0, policy_file=policy)
    ended = [f"short-{i}" for i in range(10)]
    live.report(ctl_report("n1", 0, gpus=8, samples=1, job=job_records([*ended, "held"])))
    live.report(ctl_report("n1", 1, gpus=8, samples=1, job=job_records(ended, exited=True)))
    # An open incident names "held": remediation may still need its ranks and nodes.
    incident = open_incident(live, "comm_failure", job="held")

    wait_for(lambda: live.controller.state.jobs.keys() == {"held"})
    assert per_job(live) == holding("held")
    assert live.controller.remediation.retention.forgotten_total == len(ended)
    # The database keeps every job's history; the API lists the jobs in memory.
    names = stored_column(db_url, "SELECT name FROM jobs ORDER BY name")
    assert names == sorted([*ended, "held"])
    assert stored(db_url, "SELECT count(*) FROM ranks") == 8 * (len(ended) + 1)
    assert [j["name"] for j in live.read("/api/v1/jobs")["data"]] == ["held"]

    # Once its incident is resolved, nothing holds it.
    state = live.controller.state.incidents[incident]
    on_loop(live, live.controller.incidents.resolve(state, note="fixed"))
    wait_for(lambda: not live.controller.state.jobs)
    assert per_job(live) == holding()

    # A new leader reads every job back from the database, and forgets them again.
    live.restart()
    live.wait_ticks(ENGINE, 2)
    assert per_job(live) == holding()
    assert stored_column(db_url, "SELECT name FROM jobs ORDER BY name") == names


def test_a_job_that_returns_after_being_forgotten_starts_afresh(  # type: ignore[no-untyped-def]
    controller_factory, ctl_report
) -> None:
    live = controller_factory()
    services = live.controller.services
    retention_s = live.settings.job_retention_s
    live.report(ctl_report("n1", 0, gpus=8, samples=1, job=job_records(["gpt"], exited=True)))
    live.report(ctl_report("n2", 0, gpus=8, samples=1, job=job_records(["live"])))
    old = services.state.jobs["gpt"]
    old_tracker, old_book = services.jobs.trackers.jobs["gpt"], services.remediation.jobs["gpt"]
    assert old.world_size == 8 and len(old.ranks) == 8

    # A day after "gpt" was last heard of: "live" reported since, so it stays.
    assert sweep_at(live, old.last_seen_unix_s + retention_s) == ["gpt"]
    assert per_job(live) == holding("live")

    # The same name again, a new generation on half the ranks: nothing of the old one.
    job = job_records(["gpt"], world=4)
    live.report(ctl_report("n1", 1, gpus=8, samples=1, job=job))
    new = services.state.jobs["gpt"]
    assert new is not old and new.first_seen_unix_s > old.last_seen_unix_s
    assert new.world_size == 4 and sorted(new.ranks) == [0, 1, 2, 3]
    assert {r.state for r in new.ranks.values()} == {"running"}
    detail = live.read("/api/v1/jobs/gpt")
    assert detail["world_size"] == 4 and len(detail["ranks"]) == 4
    assert services.jobs.trackers.jobs["gpt"] is not old_tracker
    assert services.remediation.jobs["gpt"] is not old_book
    assert per_job(live) == holding("gpt", "live")


def test_a_job_awaiting_its_resume_is_kept_also_by_a_new_leader(  # type: ignore[no-untyped-def]
    controller_factory, tmp_path
) -> None:
    live = controller_factory(policy_file=restart_policy(tmp_path, resume_timeout_s=120))
    agents = Agents(live)
    incident, _row = restarted(live, agents, tmp_path)
    state, engine = live.controller.state, live.controller.remediation
    # The incident is over; only the restart's wait for the first step holds the job.
    on_loop(live, live.controller.incidents.resolve(state.incidents[incident], note="restarted"))
    book = engine.jobs["gpt"]
    assert book.awaiting_resume is not None
    far = time.time() + 10 * live.settings.job_retention_s
    assert sweep_at(live, far) == []
    assert "gpt" in state.jobs and engine.jobs["gpt"] is book

    # A new leader that forgets after 1 s, started once the job has been quiet longer:
    # it reads the wait back before its first sweep, so the job stays.
    live.settings = live.settings.model_copy(update={"job_retention_s": 1.0})
    last_seen = state.jobs["gpt"].last_seen_unix_s
    wait_for(lambda: time.time() - last_seen > 1.5)
    live.restart()
    recording(live, nodes=("n0", "n1"), pool=["n0", "n1"])
    live.wait_ticks(ENGINE, 3)
    state, engine = live.controller.state, live.controller.remediation
    assert "gpt" in state.jobs
    assert engine.jobs["gpt"].awaiting_resume is not None

    # The first step of the new generation ends the wait; quiet again, the job goes.
    agents.steps("n0", "gpt", [(1, time.time())])
    wait_for(lambda: engine.jobs.get("gpt") is None or engine.jobs["gpt"].awaiting_resume is None)
    wait_for(lambda: "gpt" not in state.jobs)
    assert per_job(live) == holding()
