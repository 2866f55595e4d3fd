"""A rollback never resumes from a checkpoint the job's retention has deleted.

Found in the NaN end-to-end test under load: NaN at step 14, the rollback restarted the job
with ``TRAINGUARD_RESUME_STEP=10``, but the job had run on and its retention (``keep_last``)
had already deleted step 10. Every rank of the new generation exited ("no committed
checkpoint at or before TRAINGUARD_RESUME_STEP=10 (committed: 20, 30, 40)") and the job
stayed down. Rank 0 now reports each step retention deletes (a ``deleted`` checkpoint
event); pinned here: the rollback takes the newest committed step before the bad one that
is still there, and when retention left none it is refused with a clear outcome and a
critical ``restart_refused`` incident instead of a restart that cannot resume.
"""

from __future__ import annotations

import time
from typing import Any

from controller.logic.detection.incident_evidence import RestartRefusedEvidence
from controller.state import IncidentState
from tests.remediation.test_engine import (
    ENGINE,
    NAN_EVIDENCE,
    Agents,
    committed,
    incidents_of,
    live_test,
    of,
    open_incident,
    recording,
    remediation_over,
)
from tests.waiting import wait_for


def _nan_job(live: Any) -> Agents:
    """Three nodes reporting; job gpt's rank 0 at steps 28..31 (NaN first at step 30)."""
    agents = Agents(live)
    for i in range(3):
        agents.report(f"n{i}")
    agents.steps("n0", "gpt", [(s, time.time() - 40 + s) for s in range(28, 32)])
    return agents


def _restart_rows(live: Any, incident: int) -> list[dict[str, Any]]:
    """``incident``'s decided ``restart_job`` rows (once there is one)."""
    return wait_for(
        lambda: [
            a for a in of(live, incident) if a["kind"] == "restart_job" and a["status"] != "pending"
        ]
    )


def _refused(live: Any) -> list[IncidentState]:
    return incidents_of(live, "restart_refused")


@live_test
def test_rollback_skips_a_checkpoint_retention_deleted(controller_factory: Any) -> None:
    """Committed 10, 20, 30; NaN first at 30 (30 may hold the cause); retention deleted 20
    since. The rollback resumes from 10, the newest clean step that is still there."""
    live = controller_factory()
    agents = _nan_job(live)
    committed(agents, "n0", "gpt", [10, 20, 30])
    committed(agents, "n0", "gpt", [20], kind="deleted")
    actuator = recording(live, nodes=("n0", "n1"), pool=["n0", "n1", "n2"])
    incident = open_incident(
        live, "nonfinite", node="n1", severity="critical", evidence=NAN_EVIDENCE
    )
    restart = _restart_rows(live, incident)[-1]
    assert restart["status"] == "succeeded", restart["outcome"]
    assert restart["params"]["resume_step"] == 10
    assert restart["params"]["rollback"] == {"bad_step": 30}
    assert [p.resume_step for p in actuator.restarts()] == [10]
    assert _refused(live) == []


@live_test
def test_a_step_committed_again_after_its_deletion_counts(controller_factory: Any) -> None:
    """A step deleted by one run and committed again by a later one (after an earlier
    rollback the steps start lower) exists: the deletion is older than the commit."""
    live = controller_factory()
    agents = _nan_job(live)
    committed(agents, "n0", "gpt", [10, 20])
    committed(agents, "n0", "gpt", [10], kind="deleted")
    committed(agents, "n0", "gpt", [10])  # the next run's commit of step 10
    actuator = recording(live, nodes=("n0", "n1"), pool=["n0", "n1", "n2"])
    evidence = NAN_EVIDENCE.model_copy(update={"step": 15})
    incident = open_incident(live, "nonfinite", node="n1", severity="critical", evidence=evidence)
    restart = _restart_rows(live, incident)[-1]
    assert restart["status"] == "succeeded", restart["outcome"]
    assert [p.resume_step for p in actuator.restarts()] == [10]


@live_test
def test_a_rollback_whose_every_clean_checkpoint_was_deleted_is_refused_and_alerted(
    controller_factory: Any,
) -> None:
    """NaN first at step 30; committed 10, 20, 30, 40, 50 and retention (keep 3) deleted 10
    and 20. No clean checkpoint is left: the job is not restarted into a resume that fails
    on every rank. The ``restart_job`` row says which steps retention deleted and that the
    oldest kept (30) already carries the damage; a critical ``restart_refused`` incident
    names the job and the NaN incident. The steps before the rollback (alert, evidence,
    isolation) stand; the remediation fails and nothing else is done to the job."""
    live = controller_factory()
    agents = _nan_job(live)
    committed(agents, "n0", "gpt", [10, 20, 30, 40, 50])
    committed(agents, "n0", "gpt", [10, 20], kind="deleted")
    actuator = recording(live, nodes=("n0", "n1"), pool=["n0", "n1", "n2"])
    incident = open_incident(
        live, "nonfinite", node="n1", severity="critical", evidence=NAN_EVIDENCE
    )
    remediation_over(live, incident)
    rows = of(live, incident)
    kinds = [a["kind"] for a in rows]
    assert kinds[:2] == ["alert", "capture_evidence"] and "isolate_node" in kinds, kinds
    [restart] = [a for a in rows if a["kind"] == "restart_job"]
    assert restart["status"] == "skipped"
    assert restart["params"]["rollback"] == {"bad_step": 30}
    outcome = restart["outcome"]
    assert (
        "no checkpoint before step 30 is left: retention deleted 10, 20; the oldest kept is "
        "30, which already carries the NaN/Inf" in outcome
    ), outcome
    assert actuator.restarts() == [] and actuator.acts() == []
    remediation = next(r for r in live.controller.remediation.remediations if r.job == "gpt")
    assert remediation.state == "failed"
    [alarm] = wait_for(lambda: _refused(live))
    assert alarm.severity == "critical" and alarm.job == "gpt"
    evidence = alarm.evidence
    assert isinstance(evidence, RestartRefusedEvidence)
    assert (evidence.why, evidence.for_incident) == ("checkpoint_deleted", incident)
    assert evidence.for_incident_kind == "nonfinite" and evidence.detail == outcome
    live.wait_ticks(ENGINE)  # nothing more happens to the job
    assert actuator.restarts() == []


@live_test
def test_the_newest_checkpoint_a_restart_names_is_never_a_deleted_one(
    controller_factory: Any,
) -> None:
    """The engine's newest committed step (what a plain restart records as its expected
    resume step) is dropped when retention reports it deleted, instead of naming a step
    that is gone; the next commit names one again."""
    live = controller_factory()
    agents = _nan_job(live)
    committed(agents, "n0", "gpt", [40])
    book = live.controller.remediation.jobs
    wait_for(lambda: "gpt" in book and book["gpt"].checkpoint is not None)
    assert book["gpt"].checkpoint[0] == 40
    committed(agents, "n0", "gpt", [40], kind="deleted")
    wait_for(lambda: book["gpt"].checkpoint is None)
    committed(agents, "n0", "gpt", [20])
    wait_for(lambda: book["gpt"].checkpoint is not None and book["gpt"].checkpoint[0] == 20)
