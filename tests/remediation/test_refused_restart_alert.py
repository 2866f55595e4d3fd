"""A restart the policy asked for and that did not happen is an alert of its own.

When the restart rate limit or the actuator refuses a restart, the job stays as the fault
left it (down, hung, slow). That used to be one ``restart_job`` row and nothing else: no
incident, so nothing paged anyone. Pinned here: a critical ``restart_refused`` incident
names the job, why the restart was refused and the incident it was for; it is bumped (one
per job, refreshed to the newest refusal), not duplicated, while refusals repeat; the job's
next successful restart resolves it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from controller.actuators.base import Placement
from controller.logic.detection.incident_evidence import RestartRefusedEvidence
from controller.services.remediation.steps import isolate as isolate_step
from controller.state import IncidentState
from tests.remediation.test_engine import (
    ENGINE,
    incidents_of,
    live_test,
    of,
    open_incident,
    policy_file,
    recording,
    remediation_over,
)
from tests.remediation.test_engine_actuator_errors import FlakyActuator
from tests.waiting import wait_for


def refused(live: Any) -> list[IncidentState]:
    """The open ``restart_refused`` incidents."""
    return incidents_of(live, "restart_refused")


@live_test
def test_a_restart_refused_by_the_rate_limit_raises_one_critical_incident_bumped_on_repeat(
    controller_factory: Any, tmp_path: Path
) -> None:
    """One restart per hour. The first comm_failure restarts gpt; the second is refused by
    the rate limit: a critical ``restart_refused`` incident for gpt says so and names the
    second incident. A third refusal bumps that incident (count 2, evidence now the
    third's); no second one is opened. The default ``*`` rule alerts it."""
    path = policy_file(
        tmp_path,
        "rules: [{kind: comm_failure, steps: [restart]}, {kind: '*', steps: [alert]}]\n"
        "guards: {max_restarts_per_job: 1, settle_s: 0, resume_timeout_s: 1}\n",
    )
    live = controller_factory(policy_file=path)
    actuator = recording(live, nodes=("n0", "n1"), pool=["n0", "n1"])
    first = open_incident(live, "comm_failure")
    remediation_over(live, first)
    wait_for(lambda: live.controller.remediation.jobs["gpt"].awaiting_resume is None)
    assert refused(live) == []  # a restart that happened raises nothing
    second = open_incident(live, "comm_failure")
    remediation_over(live, second)
    [row] = of(live, second)
    assert row["status"] == "skipped" and row["outcome"].startswith("rate limit:")
    [incident] = wait_for(lambda: refused(live))
    assert incident.severity == "critical" and incident.job == "gpt" and incident.count == 1
    assert incident.summary.startswith(
        f"job gpt not restarted for incident {second} (comm_failure), rate_limit: rate limit:"
    )
    evidence = incident.evidence
    assert isinstance(evidence, RestartRefusedEvidence)
    assert (evidence.job, evidence.why, evidence.for_incident) == ("gpt", "rate_limit", second)
    assert evidence.for_incident_kind == "comm_failure" and evidence.detail == row["outcome"]
    # Through the policy like any incident: the catch-all rule alerts it.
    alert = wait_for(lambda: of(live, incident.id))
    assert [(a["kind"], a["params"]["severity"]) for a in alert] == [("alert", "critical")]
    third = open_incident(live, "comm_failure")
    remediation_over(live, third)
    wait_for(lambda: incident.count == 2)
    assert [i.id for i in refused(live)] == [incident.id]
    assert isinstance(incident.evidence, RestartRefusedEvidence)
    assert incident.evidence.for_incident == third
    live.wait_ticks(ENGINE, 2)
    assert len(actuator.restarts()) == 1
    assert [a["kind"] for a in of(live, incident.id)] == ["alert"]  # alerted once


@live_test
def test_a_restart_the_actuator_refuses_raises_the_incident_and_a_later_restart_resolves_it(
    controller_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The actuator fails gpt's restart for good (3 retryable errors): the
    ``restart_refused`` incident says ``actuator`` with its error. Once the actuator works
    again, the next incident's restart goes through and resolves it."""
    monkeypatch.setattr(isolate_step, "ACTUATOR_BACKOFF_S", (0.05, 0.1))
    path = policy_file(
        tmp_path,
        "rules: [{kind: comm_failure, steps: [restart]}]\n"
        "guards: {settle_s: 0, resume_timeout_s: 1}\n",
    )
    live = controller_factory(policy_file=path)
    actuator = FlakyActuator(
        placements={"gpt": Placement(job="gpt", nodes=("n0", "n1"), ranks_per_node=2)},
        pools={"gpt": ["n0", "n1"]},
    )
    actuator.fail = {"restart_job": (3, True)}
    live.controller.remediation.actuator = actuator
    first = open_incident(live, "comm_failure")
    remediation_over(live, first)
    [row] = of(live, first)
    assert row["status"] == "failed" and row["outcome"].startswith("gave up after 3 attempts")
    [incident] = wait_for(lambda: refused(live))
    evidence = incident.evidence
    assert isinstance(evidence, RestartRefusedEvidence)
    assert (evidence.why, evidence.for_incident, evidence.detail) == (
        "actuator",
        first,
        row["outcome"],
    )
    assert incident.severity == "critical" and incident.job == "gpt"
    second = open_incident(live, "comm_failure")
    remediation_over(live, second)
    assert [a["status"] for a in of(live, second)] == ["succeeded"]
    wait_for(lambda: refused(live) == [])
    assert incident.state == "resolved"
    assert isinstance(incident.evidence, RestartRefusedEvidence)
    assert (incident.evidence.resolution or "").startswith("job gpt restarted by remediation")
