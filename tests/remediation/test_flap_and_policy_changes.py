"""A node that flaps after a restart that never resumed, and policy changes while a
remediation runs (found by the remediation acceptance probe, second round: F2, F3, F4).

* F2: the job's newest restart moved it off the flapping node; the new generation never
  reported, so the old generation's rank on that node stayed ``running`` in the state.
  Each later ``node_lost`` incident about the node restarted the job again, onto the same
  placement, until the rate limit stopped it.
* F3: turning on ``dry_run`` or turning the engine off (``enabled: false``) did not reach a
  remediation already running: it still isolated and restarted for real.
* F4: ``PUT {"dry_run": true}`` replaced the whole policy with the built-in defaults;
  ``PATCH`` changes only the fields given.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from controller.actuators.base import NodeView
from tests import http_calls
from tests.remediation.recording import RecordingActuator
from tests.remediation.test_engine import (
    ENGINE,
    Agents,
    actions,
    committed,
    nodes,
    of,
    policy_file,
    recording,
    remediation_over,
)
from tests.waiting import wait_for

pytestmark = [
    pytest.mark.parametrize("db_url", ["sqlite"], indirect=True),
    pytest.mark.usefixtures("fast_remediation_engine"),
]

NAMES = [f"n{i}" for i in range(6)]


def start_job(live: Any, agents: Agents, actuator: RecordingActuator) -> None:
    """Ranks 0 and 1 of ``gpt`` start on the nodes the actuator placed it on."""
    for rank, node in enumerate(actuator.placements["gpt"].nodes):
        event = {"job": "gpt", "rank": rank, "kind": "started", "time_unix_s": time.time()}
        agents.report(node, job={"rank_events": [event]})


def others_report(agents: Agents, node: str) -> None:
    """Every node but ``node`` reports once: the rest of the fleet stays alive. (Three
    nodes silent for half of ``node_lost_after_s`` read as the controller's own partition,
    and every ``node_lost`` is held: a loaded machine's pause in the test is enough.)"""
    for name in NAMES:
        if name != node:
            agents.report(name)


def node_lost(live: Any, agents: Agents, node: str, known: set[int]) -> int:
    """Keep every node but ``node`` reporting until a new ``node_lost`` incident about it
    (not in ``known``) is open; returns its id."""

    def opened() -> int | None:
        others_report(agents, node)
        for incident in live.controller.state.incidents.values():
            if incident.kind == "node_lost" and incident.node == node and incident.id not in known:
                return int(incident.id)
        return None

    found = wait_for(opened)
    assert isinstance(found, int)
    return found


@pytest.mark.parametrize("failover", [False, True], ids=["same-leader", "new-leader"])
def test_a_flapping_node_does_not_restart_a_job_the_newest_restart_moved_off_it(  # type: ignore[no-untyped-def]
    controller_factory, tmp_path, failover
) -> None:
    policy = (
        "rules:\n  - {kind: node_lost, steps: [isolate, restart]}\n"
        "  - {kind: '*', steps: [alert]}\n"
        "guards: {max_isolated_fraction: 0.5, settle_s: 0, resume_timeout_s: 1}\n"
    )
    live = controller_factory(
        policy_file=policy_file(tmp_path, policy),
        quarantine_budget_share=0.5,
        node_lost_after_s=1.0,
    )
    agents = Agents(live)
    for name in NAMES:
        agents.report(name)
    actuator = recording(live, nodes=("n0", "n1"), pool=["n0", "n1", "n2", "n3"])
    actuator.views["n1"] = NodeView(ready=False)  # the platform agrees: n1 is lost
    start_job(live, agents, actuator)
    first = node_lost(live, agents, "n1", set())
    remediation_over(live, first, meanwhile=lambda: others_report(agents, "n1"))
    [moved] = actuator.restarts()
    assert "n1" not in moved.nodes
    # The new generation never reports: the restart's wait times out and its row says so.
    restart_row = wait_for(
        lambda: [
            a
            for a in of(live, first)
            if a["kind"] == "restart_job" and "resume_failed" in a["params"]
        ]
    )
    ranks = live.controller.state.jobs["gpt"].ranks
    assert {r.node for r in ranks.values() if r.state == "running"} == {"n0", "n1"}  # stale
    if failover:  # a new leader reads where the newest restart put the job from its row
        live.restart()
        live.controller.remediation.actuator = actuator
        live.wait_ticks(ENGINE, 2)
    # n1 comes back (its incident resolves), then goes silent again: a new incident.
    agents.report("n1")
    wait_for(lambda: first not in live.controller.state.incidents)
    second = node_lost(live, agents, "n1", {first})
    remediation_over(live, second, meanwhile=lambda: others_report(agents, "n1"))
    live.wait_ticks(ENGINE, 2)
    assert actuator.restarts() == [moved], "the job was restarted again for a node it left"
    skipped = [a for a in of(live, second) if a["kind"] == "restart_job"]
    assert [(a["status"], a["target"]) for a in skipped] == [("skipped", "gpt")], skipped
    outcome = skipped[0]["outcome"]
    assert f"job gpt already moved off n1 by restart {restart_row[0]['id']}" in outcome
    assert f"(generation {moved.generation})" in outcome
    assert "has not resumed: see its resume_failed" in outcome


POLICY = (
    "rules:\n  - {kind: gpu_fault, severity: critical, steps: [checkpoint, isolate, restart]}\n"
    "  - {kind: '*', steps: [alert]}\n"
    "guards: {max_isolated_fraction: 0.5, settle_s: 0, checkpoint_timeout_s: 60}\n"
)


def midflight(controller_factory: Any, tmp_path: Any, change: dict[str, Any]) -> Any:
    """Start a remediation (XID 79 on n1 of job gpt), PATCH ``change`` while its checkpoint
    step waits, then let the checkpoint commit: returns (live, actuator, incident)."""
    live = controller_factory(
        policy_file=policy_file(tmp_path, POLICY), quarantine_budget_share=0.5
    )
    agents = Agents(live)
    for name in NAMES:
        agents.report(name)
    actuator = recording(live, nodes=("n0", "n1"), pool=["n0", "n1", "n2", "n3"])
    start_job(live, agents, actuator)
    agents.report("n1", xid=79)
    asked = wait_for(
        lambda: [a for a in actions(live) if a["kind"] == "checkpoint" and a["status"] == "pending"]
    )
    incident = int(asked[0]["trigger"].removeprefix("incident:"))
    op = http_calls.client(base_url=live.url, headers=live.headers("operator"), timeout=10)
    changed = op.patch("/api/v1/remediation/policy", json=change)
    assert changed.status_code == 200, changed.text
    committed(agents, "n0", "gpt", [100])  # the checkpoint step ends; the next one runs
    remediation_over(live, incident)
    return live, actuator, incident


def test_dry_run_turned_on_reaches_a_remediation_already_running(  # type: ignore[no-untyped-def]
    controller_factory, tmp_path
) -> None:
    live, actuator, incident = midflight(controller_factory, tmp_path, {"dry_run": True})
    rows = [(a["kind"], a["status"]) for a in of(live, incident)]
    assert rows == [
        ("checkpoint", "succeeded"),
        ("isolate_node", "dry_run"),
        ("restart_job", "dry_run"),
    ], rows
    assert actuator.acts() == []
    assert nodes(live)["n1"]["isolated_reason"] is None
    [rem] = [r for r in live.controller.remediation.remediations if r.incident_id == incident]
    assert rem.dry_run and rem.state == "done"


def test_disabling_the_engine_stops_a_remediation_already_running(  # type: ignore[no-untyped-def]
    controller_factory, tmp_path
) -> None:
    live, actuator, incident = midflight(controller_factory, tmp_path, {"enabled": False})
    rows = of(live, incident)
    assert [(a["kind"], a["status"]) for a in rows] == [
        ("checkpoint", "succeeded"),
        ("isolate_node", "skipped"),
        ("restart_job", "skipped"),
    ], rows
    for row in rows[1:]:
        assert row["outcome"].startswith("remediation disabled by policy change at "), row
    assert [a["target"] for a in rows[1:]] == ["n1", "gpt"]
    assert actuator.acts() == []
    assert nodes(live)["n1"]["isolated_reason"] is None
    [rem] = [r for r in live.controller.remediation.remediations if r.incident_id == incident]
    assert rem.state == "done" and rem.outcome.startswith("remediation disabled by policy")


def test_patch_changes_only_the_fields_given_and_put_replaces_the_whole_policy(  # type: ignore[no-untyped-def]
    controller_factory, tmp_path
) -> None:
    live = controller_factory(
        policy_file=policy_file(
            tmp_path,
            "rules:\n  - {kind: gpu_fault, steps: [isolate]}\n"
            "guards: {max_isolated_fraction: 0.5, max_restarts_per_job: 1}\n",
        )
    )
    op = http_calls.client(base_url=live.url, headers=live.headers("operator"), timeout=10)
    viewer = http_calls.client(base_url=live.url, headers=live.headers("viewer"), timeout=10)
    before = viewer.get("/api/v1/remediation").json()["policy"]
    patched = op.patch("/api/v1/remediation/policy", json={"dry_run": True})
    assert patched.status_code == 200, patched.text
    after = viewer.get("/api/v1/remediation").json()["policy"]
    assert after == before | {"dry_run": True} == patched.json()
    assert [r["kind"] for r in after["rules"]] == ["gpu_fault"]
    assert after["guards"]["max_restarts_per_job"] == 1
    # A top-level field given replaces that field whole; the result is validated strictly.
    typo = op.patch("/api/v1/remediation/policy", json={"dry_rn": True})
    assert typo.status_code == 422 and "dry_rn" in typo.json()["detail"], typo.text
    bad = op.patch("/api/v1/remediation/policy", json={"rules": [{"kind": "hang", "steps": ["n"]}]})
    assert bad.status_code == 422 and "rules.0.steps.0" in bad.json()["detail"], bad.text
    not_object = op.patch("/api/v1/remediation/policy", json=[1])
    assert not_object.status_code == 422, not_object.text
    assert viewer.patch("/api/v1/remediation/policy", json={}).status_code == 403
    assert viewer.get("/api/v1/remediation").json()["policy"] == after  # nothing refused applied
    audit = [a for a in actions(live) if a["kind"] == "set_policy"]
    assert [a["outcome"] for a in audit] == ["policy changed: dry_run"]
    # PUT is a full replacement, as documented: what it leaves out takes the defaults.
    put = op.put("/api/v1/remediation/policy", json={"dry_run": False})
    assert put.status_code == 200, put.text
    assert put.json()["guards"]["max_restarts_per_job"] != 1
    assert len(put.json()["rules"]) > 1
