"""The operator actions the dashboard added to the API: restart a job by hand, approve an
action the policy left in dry run. Live controllers (SQLite) with the remediation engine's
real steps; the actuator is the recording one (tests/remediation/recording.py), the
engine's boundary with state, so what was restarted where can be checked.
"""

from __future__ import annotations

from typing import Any

import httpx

from controller.actuators.base import Placement
from tests import http_calls
from tests.remediation.recording import RecordingActuator
from tests.remediation.test_engine import Agents
from tests.waiting import wait_for


def _actions(live: Any) -> list[dict[str, Any]]:
    r = http_calls.get(f"{live.url}/api/v1/actions?limit=500", headers=live.headers("viewer"))
    assert r.status_code == 200, r.text
    return list(r.json()["data"])


def _post(live: Any, path: str, role: str = "operator", body: Any = None) -> httpx.Response:
    return http_calls.post(
        f"{live.url}/api/v1{path}", json=body or {}, headers=live.headers(role), timeout=10
    )


def _gpt_on(live: Any, nodes: tuple[str, ...], pool: list[str]) -> RecordingActuator:
    actuator = RecordingActuator(
        placements={"gpt": Placement(job="gpt", nodes=nodes, ranks_per_node=1)},
        pools={"gpt": pool},
    )
    live.controller.remediation.actuator = actuator
    return actuator


def test_an_operator_restarts_a_job_through_the_actuator(controller_factory) -> None:  # type: ignore[no-untyped-def]
    live = controller_factory()
    agents = Agents(live)
    for node in ("n0", "n1", "n2"):
        agents.report(node)
    agents.steps("n0", "gpt", [(1, 1.0)])
    wait_for(lambda: "gpt" in live.controller.state.jobs)
    body = {"reason": "loss spike, try again"}

    assert _post(live, "/jobs/gpt/restart", "viewer", body).status_code == 403
    assert _post(live, "/jobs/gpt/restart", "agent", body).status_code == 403
    no_actuator = _post(live, "/jobs/gpt/restart", body=body)
    assert no_actuator.status_code == 409 and "no actuator" in no_actuator.json()["detail"]
    assert _post(live, "/jobs/gpt/restart", body={"reason": ""}).status_code == 422
    assert _post(live, "/jobs/nope/restart", body=body).status_code == 404

    actuator = _gpt_on(live, ("n0", "n1"), ["n0", "n1", "n2"])
    r = _post(live, "/jobs/gpt/restart", body=body)
    assert r.status_code == 200, r.text
    done = r.json()
    assert done["generation"] == 1 and done["action"]
    [placement] = actuator.restarts()
    assert placement.job == "gpt" and placement.generation == 1
    row = next(a for a in _actions(live) if a["id"] == done["action"])
    assert row["kind"] == "restart_job" and row["status"] == "succeeded"
    assert row["trigger"] == "operator:test-operator" and row["target"] == "gpt"
    assert row["outcome"].startswith("by hand: loss spike, try again; same_size: world 2")
    # The job now waits for its first step of the new generation: no second restart.
    again = _post(live, "/jobs/gpt/restart", body=body)
    assert again.status_code == 409 and "in progress" in again.json()["detail"]
    assert len(actuator.restarts()) == 1


def test_an_operator_approves_what_the_policy_left_in_dry_run(controller_factory) -> None:  # type: ignore[no-untyped-def]
    live = controller_factory(policy_dry_run=True)
    agents = Agents(live)
    for node in ("n0", "n1", "n2", "n3"):
        agents.report(node)
    actuator = _gpt_on(live, ("n0", "n1"), ["n0", "n1", "n2", "n3"])
    agents.steps("n0", "gpt", [(1, 1.0)])
    wait_for(lambda: "gpt" in live.controller.state.jobs)
    agents.report("n0", xid=79)  # a fatal XID under gpt's rank 0: checkpoint, isolate, restart
    rows = wait_for(
        lambda: (
            {
                a["kind"]: a
                for a in _actions(live)
                if a["status"] == "dry_run" and a["kind"] in ("isolate_node", "restart_job")
            }
            if len([a for a in _actions(live) if a["status"] == "dry_run" and a["kind"] != "alert"])
            >= 3
            else None
        )
    )
    isolate, restart = rows["isolate_node"], rows["restart_job"]
    assert live.controller.state.nodes["n0"].isolated_reason is None
    assert actuator.restarts() == []

    # A viewer cannot; nothing changes.
    assert _post(live, f"/actions/{isolate['id']}/approve", "viewer").status_code == 403
    # What cannot be approved says why.
    checkpoint = next(a for a in _actions(live) if a["kind"] == "checkpoint")
    refused = _post(live, f"/actions/{checkpoint['id']}/approve")
    assert refused.status_code == 409 and "cannot be approved" in refused.json()["detail"]
    assert _post(live, "/actions/999999/approve").status_code == 404

    r = _post(live, f"/actions/{isolate['id']}/approve")
    assert r.status_code == 200, r.text
    assert live.controller.state.nodes["n0"].isolated_reason == (
        f"approved dry run #{isolate['id']} by test-operator"
    )
    assert ("isolate_node", "n0") in actuator.calls
    twice = _post(live, f"/actions/{isolate['id']}/approve")
    assert twice.status_code == 409 and "approved already" in twice.json()["detail"]

    r = _post(live, f"/actions/{restart['id']}/approve")
    assert r.status_code == 200, r.text
    [placement] = actuator.restarts()
    assert "n0" not in placement.nodes  # the approved isolation holds for the restart
    by_id = {a["id"]: a for a in _actions(live)}
    carried = by_id[r.json()["carried_out"]]
    assert carried["kind"] == "restart_job" and carried["status"] == "succeeded"
    approvals = [a for a in by_id.values() if a["kind"] == "approve_action"]
    assert sorted(a["target"] for a in approvals) == sorted(
        [f"action:{isolate['id']}", f"action:{restart['id']}"]
    )
    assert all(a["trigger"] == "operator:test-operator" for a in approvals)
    # A row that is not a dry run is refused.
    not_dry = _post(live, f"/actions/{carried['id']}/approve")
    assert not_dry.status_code == 409 and "not a dry run" in not_dry.json()["detail"]


def test_a_plan_a_jobs_own_policy_held_back_is_approved_as_a_whole(controller_factory) -> None:  # type: ignore[no-untyped-def]
    """An ``approval`` row (the job's ``trainguard.io/policy`` asked for a dry run) goes to
    ``RemediationEngine.approve``; its step rows are approved with it, not one by one."""
    from controller.actuators.base import JobPolicy
    from tests.remediation.test_engine import open_incident

    live = controller_factory()
    agents = Agents(live)
    for node in ("n0", "n1", "n2", "n3"):
        agents.report(node)
    actuator = _gpt_on(live, ("n0", "n1"), ["n0", "n1", "n2", "n3"])
    actuator.policies["gpt"] = JobPolicy(dry_run=True)
    open_incident(live, "gpu_fault", node="n1", severity="critical")
    plan = wait_for(lambda: [a for a in _actions(live) if a["kind"] == "approval"])[0]
    step = next(a for a in _actions(live) if a["kind"] == "isolate_node")
    assert step["status"] == "dry_run"

    assert _post(live, f"/actions/{plan['id']}/approve", "viewer").status_code == 403
    one = _post(live, f"/actions/{step['id']}/approve")
    assert one.status_code == 409 and f"approve action {plan['id']}" in one.json()["detail"]
    r = _post(live, f"/actions/{plan['id']}/approve")
    assert r.status_code == 200, r.text
    assert r.json()["remediation"]["approved_by"] == "test-operator"
    wait_for(lambda: ("isolate_node", "n1") in actuator.calls)
    again = _post(live, f"/actions/{plan['id']}/approve")
    assert again.status_code == 409 and "already approved" in again.json()["detail"]
