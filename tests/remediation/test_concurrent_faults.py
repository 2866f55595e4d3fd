"""Faults that arrive together: one restart for all of them, every bad node still isolated.

Two fatal faults on two nodes of one job within a second open two incidents. The first
one's restart already leaves out both nodes (the planner skips every unhealthy node); the
second incident must still isolate its node, but a second restart onto the same placement
would only stop and resume the job once more. Found by probing the live engine.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests import http_calls
from tests.remediation.test_engine import Agents, of, open_incident, policy_file, recording
from tests.waiting import wait_for

pytestmark = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)

POLICY: dict[str, Any] = {
    "rules": [
        {"kind": "gpu_fault", "severity": "critical", "steps": ["isolate", "restart"]},
        {"kind": "comm_failure", "steps": ["restart"]},
    ],
    "guards": {"settle_s": 0, "resume_timeout_s": 1, "max_isolated_fraction": 0.5},
}


def start(controller_factory: Any, tmp_path: Path) -> Any:
    """A controller whose engine is off until :func:`enable`: the faults all arrive first."""
    return controller_factory(
        policy_file=policy_file(tmp_path, "enabled: false\n"), quarantine_budget_share=0.5
    )


def enable(live: Any) -> None:
    op = http_calls.client(base_url=live.url, headers=live.headers("operator"), timeout=10)
    assert op.put("/api/v1/remediation/policy", json=POLICY).status_code == 200


def settled(live: Any, incident: int) -> list[tuple[str, str, str]]:
    """The incident's action rows once its restart step has run and none is pending."""

    def rows() -> list[dict[str, Any]]:
        found = of(live, incident)
        done = any(a["kind"] == "restart_job" for a in found)
        return found if done and all(a["status"] != "pending" for a in found) else []

    return [(a["kind"], a["status"], a["target"]) for a in wait_for(rows, timeout_s=30)]


def test_two_fatal_faults_on_one_job_restart_it_once_and_isolate_both(  # type: ignore[no-untyped-def]
    controller_factory, tmp_path: Path
) -> None:
    live = start(controller_factory, tmp_path)
    agents = Agents(live)
    for i in range(5):
        agents.report(f"n{i}")
    actuator = recording(live, nodes=("n0", "n1", "n2"), pool=[f"n{i}" for i in range(5)])
    for rank, node in enumerate(("n0", "n1", "n2")):  # job gpt runs a rank on each node
        started = {"job": "gpt", "rank": rank, "kind": "started", "time_unix_s": time.time()}
        agents.report(node, job={"rank_events": [started]})
    agents.report("n1", xid=79)
    agents.report("n2", xid=79)
    incidents = wait_for(
        lambda: (
            [
                (i.node, i.id)
                for i in live.controller.state.incidents.values()
                if i.kind == "gpu_fault"
            ]
            if sum(i.kind == "gpu_fault" for i in live.controller.state.incidents.values()) == 2
            else []
        ),
        timeout_s=20,
    )
    enable(live)
    rows = {node: settled(live, incident) for node, incident in incidents}
    # One restart, already without both faulty nodes; each node isolated by its incident.
    assert [p.nodes for p in actuator.restarts()] == [("n0", "n3", "n4")]
    assert {node: r[0] for node, r in rows.items()} == {
        n: ("isolate_node", "succeeded", n) for n in ("n1", "n2")
    }
    assert sorted(r[1][1] for r in rows.values()) == ["skipped", "succeeded"]
    assert all(len(r) == 2 for r in rows.values())
    skipped = next(
        a
        for _, incident in incidents
        for a in of(live, incident)
        if a["kind"] == "restart_job" and a["status"] == "skipped"
    )
    assert skipped["outcome"].startswith("job gpt already restarted without n")


def test_an_incident_of_the_job_opened_before_a_restart_ends_with_that_run(  # type: ignore[no-untyped-def]
    controller_factory, tmp_path: Path
) -> None:
    """Two communication failures of the same run: the restart for one ends that run, so
    the other needs no restart of its own."""
    live = start(controller_factory, tmp_path)
    actuator = recording(live, nodes=("n0", "n1"), pool=["n0", "n1"])
    first, second = open_incident(live, "comm_failure"), open_incident(live, "comm_failure")
    enable(live)
    rows = sorted(settled(live, first) + settled(live, second))
    assert rows == [("restart_job", "skipped", "gpt"), ("restart_job", "succeeded", "gpt")]
    assert len(actuator.restarts()) == 1
