"""Job retention, the rest: a new leader, the actuator and the restart budget forget too.

``test_job_retention.py`` covers the job, its detector windows, ingest's claims and the
engine's books. What the retention work found besides: a new leader read every job and rank
ever stored (its first sweep then dropped the old ones, so an election cost as much as the
whole job history); the Kubernetes actuator kept each job's learned placement, limits and
tp for good; and the restart budget kept an entry for every job ever restarted.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from sqlalchemy.orm import Session

from controller.actuators.kubernetes import KubernetesActuator
from controller.db.models import Action, Incident, Job, Rank
from controller.db.session import make_engine
from controller.logic.remediation.guards import RestartBudget
from controller.logic.remediation.rules import Guards
from tests.actuators.fake_cluster import FakeCluster
from tests.actuators.k8s_testkit import NS, cluster, run
from tests.actuators.test_k8s_placement_states import actuator, gang, launch
from tests.controller.test_job_retention import ALERT_ONLY, job_records, sweep_at
from tests.remediation.test_engine import ENGINE
from tests.remediation.test_engine_resume_record import restart_policy
from tests.waiting import wait_for

__all__ = ["cluster"]

pytestmark = pytest.mark.usefixtures("fast_remediation_engine")

RETENTION_S = 3600.0
#: Jobs heard from within the retention period.
RECENT = ["recent-0", "recent-1", "recent-2"]
#: Quiet for twice the retention period; one named by an open incident, one whose restart a
#: minute ago has not resumed: a new leader must have both.
HELD_BY_INCIDENT, HELD_BY_RESTART = "held-incident", "held-restart"
#: Quiet as long, restarted long ago and resumed since: nothing holds it.
OLD_RESTARTED = "old-restarted"
OLD = [f"old-{i}" for i in range(300)]


def restart_row(job: str, at_unix_s: float, *, resumed: bool) -> Action:
    """A ``restart_job`` row as the restart step and the resume wait leave it."""
    goodput: dict[str, Any] = {
        "ledger_id": "1",
        "kind": "comm_failure",
        "fault_unix_s": at_unix_s - 5,
        "detected_unix_s": at_unix_s - 4,
        "last_step": 10,
        "resume_step": 8,
        "step_s": 0.1,
    }
    if resumed:
        goodput |= {"restart_unix_s": at_unix_s, "resumed_unix_s": at_unix_s + 5}
    params = {"job": job, "generation": 1, "resume_step": 8, "goodput": goodput}
    return Action(
        kind="restart_job",
        target=job,
        trigger=f"incident:{job}",
        params=params,
        status="succeeded",
        outcome="restarted",
        created_unix_s=at_unix_s - 1,
        finished_unix_s=at_unix_s,
    )


def seed_history(db_url: str) -> None:
    """Many long-finished jobs, a few recent ones and the held ones, as rows an earlier
    leader wrote (each job with two ranks)."""
    now = time.time()
    quiet = now - 2 * RETENTION_S
    seen = {name: now - 10 for name in RECENT}
    seen |= {name: quiet for name in [*OLD, HELD_BY_INCIDENT, HELD_BY_RESTART, OLD_RESTARTED]}
    engine = make_engine(db_url)
    try:
        with Session(engine) as session, session.begin():
            for name, last in seen.items():
                session.add(
                    Job(name=name, world_size=2, first_seen_unix_s=last - 60, last_seen_unix_s=last)
                )
            session.flush()
            session.add_all(
                Rank(job_name=name, rank=r, node_name=f"n{r}", last_seen_unix_s=last)
                for name, last in seen.items()
                for r in range(2)
            )
            session.add(
                Incident(
                    kind="hang",
                    severity="critical",
                    state="open",
                    summary="stuck",
                    job_name=HELD_BY_INCIDENT,
                    dedupe_key=f"hang:{HELD_BY_INCIDENT}",
                    opened_unix_s=quiet,
                    updated_unix_s=quiet,
                )
            )
            session.add(restart_row(OLD_RESTARTED, quiet, resumed=True))
            session.add(restart_row(HELD_BY_RESTART, now - 60, resumed=False))
    finally:
        engine.dispose()


def new_leader_on_history(controller_factory: Any, db_url: str, tmp_path: Any) -> Any:
    """A controller that retains jobs for an hour, restarted (a new leader) on
    :func:`seed_history`'s rows, once its engine has ticked twice."""
    policy = restart_policy(tmp_path, resume_timeout_s=600)
    live = controller_factory(job_retention_s=RETENTION_S, policy_file=policy)
    seed_history(db_url)
    live.restart()
    live.wait_ticks(ENGINE, 2)
    return live


def test_a_new_leader_loads_only_the_retained_and_the_held_jobs(  # type: ignore[no-untyped-def]
    controller_factory, db_url, tmp_path
) -> None:
    live = new_leader_on_history(controller_factory, db_url, tmp_path)
    state, engine = live.controller.state, live.controller.remediation

    assert set(state.jobs) == {*RECENT, HELD_BY_INCIDENT, HELD_BY_RESTART}
    assert all(sorted(job.ranks) == [0, 1] for job in state.jobs.values())
    # Never loaded, so never swept: the old jobs did not pass through memory at all.
    assert engine.retention.forgotten_total == 0
    # The held ones are what the engine needs: the restart's wait was restored.
    assert engine.jobs[HELD_BY_RESTART].awaiting_resume is not None
    assert len(state.incidents) == 1


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_restart_budget_keeps_only_restarts_inside_its_window(  # type: ignore[no-untyped-def]
    controller_factory, db_url, tmp_path
) -> None:
    live = new_leader_on_history(controller_factory, db_url, tmp_path)
    budget = live.controller.remediation.ctx.restarts
    # The new leader counted both stored restarts; the one two hours old left the window
    # (an hour), so its job has no entry left, the recent one still counts.
    assert budget.count(HELD_BY_RESTART) == 1
    assert budget.count(OLD_RESTARTED) == 0
    assert set(budget._times) == {HELD_BY_RESTART}

    # Asking about a job whose restarts all left the window drops its entry as well.
    guards, alone = Guards(max_restarts_per_job=1, restart_window_s=60), RestartBudget()
    alone.record("gpt", 1000.0)
    assert alone.refuse("gpt", 1030.0, guards) is not None
    assert alone.refuse("gpt", 1061.0, guards) is None
    assert "gpt" not in alone._times
    assert alone.refuse("never-restarted", 1061.0, guards) is None
    assert not alone._times


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_forgotten_job_leaves_the_kubernetes_actuator(  # type: ignore[no-untyped-def]
    controller_factory, ctl_report, cluster: FakeCluster, tmp_path
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(ALERT_ONLY)
    live = controller_factory(policy_file=policy)
    launch(cluster)  # JobSet "llm": a pod on gpu-a and one on gpu-b, two ranks each
    act: KubernetesActuator = actuator(cluster)
    live.controller.remediation.actuator = act

    # The ranks say where they run, through ingest, as instrumented ranks do.
    for seq, pod in enumerate(gang(cluster)):
        node, first = pod["spec"]["nodeName"], 2 * seq
        records = job_records(["llm"], world=4)
        records["rank_events"] = [
            {
                **e,
                "rank": first + local,
                "local_rank": local,
                "pod": pod["metadata"]["name"],
                "namespace": NS,
            }
            for local, e in enumerate(records["rank_events"][:2])
        ]
        records["steps"] = [s for s in records["steps"] if s["rank"] in (first, first + 1)]
        live.report(ctl_report(node, 0, gpus=2, samples=1, job=records))
    wait_for(lambda: (found := act.book.layout("llm")) is not None and found.complete)
    placement = run(act.current_placement("llm"))
    assert placement is not None and placement.nodes == ("gpu-a", "gpu-b")
    run(act.candidate_nodes("llm"))
    assert act.limits("llm") is not None and "llm" in act._tp

    job = live.controller.state.jobs["llm"]
    assert sweep_at(live, job.last_seen_unix_s + live.settings.job_retention_s) == ["llm"]
    assert act.book.layout("llm") is None
    assert act.limits("llm") is None and "llm" not in act._tp
