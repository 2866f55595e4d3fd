"""The wait after a restart in the action log and across a controller restart.

A restart leaves its job awaiting resume: the first step of the new generation ends the
wait, no step within ``guards.resume_timeout_s`` fails it. Both ends are written on the
restart's action row, so the action log (and a new leader) tells a recovery from a restart
that never came back; and a new leader restores a wait that its predecessor left open, so
what the restart itself causes (peers of stopped ranks timing out) is still absorbed, not
answered with a second restart, and the timeout still fires.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.remediation.test_engine import (
    ENGINE,
    Agents,
    actions,
    of,
    open_incident,
    policy_file,
    recording,
)
from tests.waiting import wait_for

pytestmark = [
    pytest.mark.parametrize("db_url", ["sqlite"], indirect=True),
    pytest.mark.usefixtures("fast_remediation_engine"),
]


def restart_policy(tmp_path: Path, *, resume_timeout_s: float, settle_s: float = 30) -> Path:
    return policy_file(
        tmp_path,
        "rules: [{kind: comm_failure, steps: [restart]}]\n"
        f"guards: {{settle_s: {settle_s}, resume_timeout_s: {resume_timeout_s}}}\n",
    )


def restarted(live: Any, agents: Agents, tmp_path: Path) -> tuple[int, dict[str, Any]]:
    """Job ``gpt`` stepped, then a comm_failure restarted it: the incident and the row."""
    recording(live, nodes=("n0", "n1"), pool=["n0", "n1"])
    now = time.time()
    agents.steps("n0", "gpt", [(s, now - 6 + s) for s in range(1, 6)])
    incident = open_incident(live, "comm_failure")
    row = wait_for(
        lambda: [
            a for a in of(live, incident) if a["kind"] == "restart_job" and a["status"] != "pending"
        ]
    )[0]
    assert row["status"] == "succeeded", row
    return incident, row


def restart_row(live: Any, action_id: int) -> dict[str, Any]:
    return next(a for a in actions(live) if a["id"] == action_id)


def test_a_job_that_does_not_resume_is_recorded_on_its_restart_row(  # type: ignore[no-untyped-def]
    controller_factory, tmp_path
) -> None:
    live = controller_factory(policy_file=restart_policy(tmp_path, resume_timeout_s=1))
    _incident, row = restarted(live, Agents(live), tmp_path)
    failed = wait_for(
        lambda: "resume_failed" in (r := restart_row(live, row["id"]))["params"] and r
    )
    # The restart took effect (it counts against the rate limit and goodput): its status
    # stays; what followed it is in its parameters and outcome.
    assert failed["status"] == "succeeded"
    assert failed["params"]["resume_failed"] == "did not resume within 1 s"
    assert failed["outcome"] == f"{row['outcome']}; did not resume within 1 s"
    assert "resumed_unix_s" not in failed["params"]["goodput"]
    rems = live.controller.remediation.remediations
    assert [r.state for r in rems] == ["failed"]
    # A new leader reads the failure back and waits for nothing.
    live.restart()
    live.wait_ticks(ENGINE, 2)
    assert live.controller.remediation.jobs["gpt"].awaiting_resume is None
    assert restart_row(live, row["id"]) == failed


def test_an_incident_the_restart_caused_is_absorbed_after_a_controller_restart(  # type: ignore[no-untyped-def]
    controller_factory, tmp_path
) -> None:
    live = controller_factory(policy_file=restart_policy(tmp_path, resume_timeout_s=120))
    agents = Agents(live)
    _first, row = restarted(live, agents, tmp_path)
    live.restart()
    actuator = recording(live, nodes=("n0", "n1"), pool=["n0", "n1"])
    live.wait_ticks(ENGINE, 2)  # the new engine has read back what the old one did
    book = live.controller.remediation.jobs["gpt"]
    assert book.awaiting_resume is not None and book.awaiting_resume.restart_action == row["id"]
    assert book.last_restart_unix_s == pytest.approx(row["finished_unix_s"])
    # Peers of the ranks the restart stopped time out: a consequence, not a new fault.
    consequence = open_incident(live, "comm_failure")
    wait_for(lambda: consequence not in live.controller.state.incidents)
    live.wait_ticks(ENGINE, 3)
    assert of(live, consequence) == []
    assert actuator.restarts() == []
    assert [a["id"] for a in actions(live) if a["kind"] == "restart_job"] == [row["id"]]
    # The first step of the new generation ends the restored wait and is recorded.
    agents.steps("n0", "gpt", [(1, time.time())])
    resumed = wait_for(
        lambda: "resumed_unix_s" in (r := restart_row(live, row["id"]))["params"]["goodput"] and r
    )
    assert resumed["params"]["resumed_step"] == 1
    assert book.awaiting_resume is None and book.resumed_unix_s is not None


def test_the_resume_timeout_fires_after_a_controller_restart(  # type: ignore[no-untyped-def]
    controller_factory, tmp_path
) -> None:
    live = controller_factory(policy_file=restart_policy(tmp_path, resume_timeout_s=4))
    _incident, row = restarted(live, Agents(live), tmp_path)
    live.restart()
    failed = wait_for(
        lambda: "resume_failed" in (r := restart_row(live, row["id"]))["params"] and r
    )
    assert failed["status"] == "succeeded"
    assert failed["outcome"].endswith("; did not resume within 4 s")
    assert [r.state for r in live.controller.remediation.remediations] == ["failed"]
