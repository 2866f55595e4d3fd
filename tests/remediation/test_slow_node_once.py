"""One slow node, eight incidents: the remediation engine acts on the node once.

The straggler detector judges each rank against its peers, so a whole slow 8-GPU node (TP
inside the node, DP across nodes) opens one straggler incident per rank, all within
seconds (:mod:`controller.logic.detection.c4d.node_mates`). The engine must checkpoint,
isolate and restart once, and the other seven incidents, which that restart covered (it
left their node), must be absorbed and resolved, not each run its own checkpoint, isolate
and restart once the job has resumed. Found by probing the live engine: each of the seven
did, one after another, long after the job had left the node.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from controller.actuators.base import JobPolicy, Placement
from tests import http_calls
from tests.remediation.recording import RecordingActuator
from tests.remediation.test_engine import (
    ENGINE,
    Agents,
    absorbed,
    actions,
    of,
    on_loop,
    open_incident,
    policy_file,
    shown_state,
    straggler_evidence,
)
from tests.waiting import wait_for

pytestmark = [
    pytest.mark.parametrize("db_url", ["sqlite"], indirect=True),
    pytest.mark.usefixtures("fast_remediation_engine"),
]

RULES = [
    {"kind": "straggler", "steps": ["alert", "checkpoint", "isolate", "restart"]},
    {"kind": "*", "steps": ["alert"]},
]
RANKS_PER_NODE = 8


def policy(*, dry_run: bool = False, **guards: Any) -> dict[str, Any]:
    return {"dry_run": dry_run, "rules": RULES, "guards": {"settle_s": 0, **guards}}


def enable(live: Any, body: dict[str, Any]) -> None:
    """Turn the engine on: every incident has arrived first, as eight do within seconds."""
    op = http_calls.client(base_url=live.url, headers=live.headers("operator"), timeout=10)
    assert op.put("/api/v1/remediation/policy", json=body).status_code == 200


def slow_node(live: Any, node: str, first_rank: int) -> list[int]:
    """One straggler incident per rank of ``node`` (8 GPUs), as the detector opens them."""
    ids = []
    for local in range(RANKS_PER_NODE):
        rank = first_rank + local
        evidence = straggler_evidence(30.0).model_copy(
            update={"rank": rank, "gpu_index": local, "node": node, "nodes": [node]}
        )
        ids.append(open_incident(live, "straggler", node=node, evidence=evidence))
    return ids


def start(controller_factory: Any, tmp_path: Path, nodes: int, pool: list[str]) -> Any:
    """``nodes`` nodes reporting; job ``gpt`` (TP 8 inside a node, DP 2) on n0 and n1."""
    live = controller_factory(
        policy_file=policy_file(tmp_path, "enabled: false\n"), quarantine_budget_share=0.5
    )
    agents = Agents(live)
    for i in range(nodes):
        agents.report(f"n{i}")
    actuator = RecordingActuator(
        placements={
            "gpt": Placement(job="gpt", nodes=("n0", "n1"), ranks_per_node=8, tp=8),
        },
        pools={"gpt": pool},
    )
    live.controller.remediation.actuator = actuator
    return live, agents, actuator


def acting(rows: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """The rows that do something (alerts aside): (kind, status, target)."""
    return [(a["kind"], a["status"], a["target"]) for a in rows if a["kind"] != "alert"]


def resumed(live: Any, agents: Agents, node: str) -> None:
    """The new generation steps (rank 0 on ``node``): the restart's wait is over."""
    jobs = live.controller.remediation.jobs
    wait_for(lambda: "gpt" in jobs and jobs["gpt"].awaiting_resume is not None)
    book = jobs["gpt"]
    started = book.awaiting_resume.restarted_unix_s
    agents.steps(node, "gpt", [(100, started + 1.0)])
    wait_for(lambda: book.awaiting_resume is None and book.running is None)


def test_one_slow_node_is_isolated_checkpointed_and_restarted_once(  # type: ignore[no-untyped-def]
    controller_factory, tmp_path: Path
) -> None:
    live, agents, actuator = start(controller_factory, tmp_path, 4, ["n0", "n1", "n2"])
    incidents = slow_node(live, "n1", RANKS_PER_NODE)
    enable(live, policy())
    first, rest = incidents[0], incidents[1:]
    wait_for(lambda: any(a["kind"] == "restart_job" for a in of(live, first)))
    resumed(live, agents, "n2")
    # The seven others: the restart left their node, so they are its, and resolved.
    for incident in rest:
        wait_for(lambda incident=incident: shown_state(live, incident) == "resolved")
        assert absorbed(live, incident)
    shown = http_calls.get(
        f"{live.url}/api/v1/incidents/{rest[-1]}", headers=live.headers("viewer"), timeout=10
    ).json()
    assert f"(incident {first}), whose restart moved the job off n1" in str(shown["evidence"])
    live.wait_ticks(ENGINE, 2)
    rows = [a for a in actions(live) if a["trigger"] in {f"incident:{i}" for i in incidents}]
    # One set of rows (the checkpoint is skipped: no rank of this test takes requests).
    assert acting(rows) == [
        ("checkpoint", "skipped", "gpt"),
        ("isolate_node", "succeeded", "n1"),
        ("restart_job", "succeeded", "gpt"),
    ], acting(rows)
    assert [p.nodes for p in actuator.restarts()] == [("n0", "n2")]
    assert [a for m, a in actuator.acts() if m == "isolate_node"] == ["n1"]
    assert live.controller.remediation.ctx.restarts.count("gpt") == 1


def test_a_slow_node_under_a_job_dry_run_is_one_plan_to_approve(  # type: ignore[no-untyped-def]
    controller_factory, tmp_path: Path
) -> None:
    """The job asks for a dry run: one approval row for the node, not one per rank; the
    approved plan's restart then covers the seven others."""
    live, agents, actuator = start(controller_factory, tmp_path, 4, ["n0", "n1", "n2"])
    actuator.policies["gpt"] = JobPolicy(dry_run=True)
    incidents = slow_node(live, "n1", RANKS_PER_NODE)
    enable(live, policy())
    triggers = {f"incident:{i}" for i in incidents}

    def plans() -> list[dict[str, Any]]:
        return [a for a in actions(live) if a["kind"] == "approval" and a["trigger"] in triggers]

    (plan,) = wait_for(plans)
    engine = live.controller.remediation
    wait_for(lambda: all(r.state != "running" for r in engine.remediations))
    live.wait_ticks(ENGINE, 3)  # the seven others were looked at again, more than once
    assert len(plans()) == 1 and actuator.acts() == []
    assert [a["kind"] for a in actions(live) if a["status"] == "dry_run"].count("approval") == 1
    on_loop(live, engine.approve(plan["id"], "alice"))
    resumed(live, agents, "n2")
    for incident in incidents[1:]:
        wait_for(lambda incident=incident: shown_state(live, incident) == "resolved")
    live.wait_ticks(ENGINE, 2)
    assert len(plans()) == 1 and [p.nodes for p in actuator.restarts()] == [("n0", "n2")]
    assert [a for m, a in actuator.acts() if m == "isolate_node"] == ["n1"]


def test_under_the_controllers_dry_run_a_slow_node_is_planned_once(  # type: ignore[no-untyped-def]
    controller_factory, tmp_path: Path
) -> None:
    """The controller's dry run: one would-be remediation for the node; once the policy is
    live, the node is acted on (once) although the first incident was decided in dry run."""
    live, agents, actuator = start(controller_factory, tmp_path, 4, ["n0", "n1", "n2"])
    incidents = slow_node(live, "n1", RANKS_PER_NODE)
    enable(live, policy(dry_run=True))
    triggers = {f"incident:{i}" for i in incidents}

    def would_isolate() -> list[dict[str, Any]]:
        rows = actions(live)
        return [a for a in rows if a["kind"] == "isolate_node" and a["trigger"] in triggers]

    wait_for(would_isolate)
    engine = live.controller.remediation
    wait_for(lambda: all(r.state != "running" for r in engine.remediations))
    live.wait_ticks(ENGINE, 3)
    assert [a["status"] for a in would_isolate()] == ["dry_run"] and actuator.acts() == []
    enable(live, policy())
    wait_for(lambda: any(a["status"] == "succeeded" for a in would_isolate()))
    resumed(live, agents, "n2")
    live.wait_ticks(ENGINE, 2)
    assert [a["status"] for a in would_isolate()] == ["dry_run", "succeeded"]
    assert [p.nodes for p in actuator.restarts()] == [("n0", "n2")]


# Two slow nodes of one job at once (both isolated, one restart): test_two_slow_nodes.py.
