"""Two slow nodes of one job found together: both isolated, and the job restarts once.

Stragglers on n0 and n1 (eight incidents each, as the detector opens them for two slow
8-GPU nodes) were remediated one node at a time: the first restart kept n1 (not isolated
yet), and n1's first incident then stopped and restarted the whole job a second time. The
remediation of the first incident now isolates every slow node of the job known at its
isolate step, so one restart leaves both out (``steps/batch.py``); the companions are
absorbed as covered once the job resumes. A budget that allows one isolation says so and
does not restart onto the same nodes again; a job's dry run records one plan naming both.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pytest

from controller.actuators.base import JobPolicy
from tests.remediation.recording import RecordingActuator
from tests.remediation.test_engine import ENGINE, absorbed, actions, on_loop, shown_state
from tests.remediation.test_slow_node_once import (
    RANKS_PER_NODE,
    acting,
    enable,
    policy,
    resumed,
    slow_node,
    start,
)
from tests.waiting import wait_for

pytestmark = [
    pytest.mark.parametrize("db_url", ["sqlite"], indirect=True),
    pytest.mark.usefixtures("fast_remediation_engine"),
]

POOL = ["n0", "n1", "n2", "n3"]


def two_slow_nodes(
    controller_factory: Any, tmp_path: Path, *, dry_run: bool = False
) -> tuple[Any, Any, RecordingActuator, list[int], list[int]]:
    """A live controller with job ``gpt`` on n0 and n1 of :data:`POOL` (6 nodes known) and
    a slow node's straggler incidents open on each; ``dry_run``: the job's own policy is
    a dry run from the start. Returns the controller, its agents, the recording actuator
    and each node's incident ids (oldest first)."""
    live, agents, actuator = start(controller_factory, tmp_path, 6, POOL)
    if dry_run:
        actuator.policies["gpt"] = JobPolicy(dry_run=True)
    on_n0 = slow_node(live, "n0", 0)
    on_n1 = slow_node(live, "n1", RANKS_PER_NODE)
    return live, agents, actuator, on_n0, on_n1


def all_resolved(live: Any, incidents: list[int]) -> None:
    """Wait until each of ``incidents`` is resolved (absorbed by the one restart)."""
    for incident in incidents:
        wait_for(partial(resolved, live, incident))


def resolved(live: Any, incident: int) -> bool:
    return shown_state(live, incident) == "resolved"


def rows_of(live: Any, incidents: list[int]) -> list[tuple[str, str, str]]:
    triggers = {f"incident:{i}" for i in incidents}
    return acting([a for a in actions(live) if a["trigger"] in triggers])


def test_two_slow_nodes_isolate_both_and_restart_once(  # type: ignore[no-untyped-def]
    controller_factory, tmp_path: Path
) -> None:
    live, agents, actuator, on_n0, on_n1 = two_slow_nodes(controller_factory, tmp_path)
    enable(live, policy(max_isolated_fraction=0.5))
    resumed(live, agents, "n2")
    all_resolved(live, on_n0[1:] + on_n1)
    live.wait_ticks(ENGINE, 3)  # every incident looked at again: nothing more is done
    engine = live.controller.remediation
    assert all(absorbed(live, i) for i in on_n0[1:] + on_n1)  # by the one restart
    assert rows_of(live, on_n0 + on_n1) == [
        ("checkpoint", "skipped", "gpt"),
        ("isolate_node", "succeeded", "n0"),
        ("isolate_node", "succeeded", "n1"),
        ("restart_job", "succeeded", "gpt"),
    ]
    assert [p.nodes for p in actuator.restarts()] == [("n2", "n3")]
    assert [a for m, a in actuator.acts() if m == "isolate_node"] == ["n0", "n1"]
    assert engine.ctx.restarts.count("gpt") == 1
    (rem,) = [r for r in engine.remediations if r.incident_id == on_n0[0]]
    assert rem.batch == ["n1"]
    # n1's row names the incident it answers, under the trigger of the one remediation.
    (row,) = [a for a in actions(live) if a["kind"] == "isolate_node" and a["target"] == "n1"]
    assert row["trigger"] == f"incident:{on_n0[0]}" and row["params"]["incident"] == on_n1[0]


def test_a_budget_for_one_isolation_restarts_once_and_says_so(  # type: ignore[no-untyped-def]
    controller_factory, tmp_path: Path
) -> None:
    """The circuit breaker allows one isolation (0.2 of 6 nodes): n1 stays in the job, its
    refusal is recorded, and n1's incidents do not restart the job onto the same nodes."""
    live, agents, actuator, on_n0, on_n1 = two_slow_nodes(controller_factory, tmp_path)
    enable(live, policy(max_isolated_fraction=0.2))
    resumed(live, agents, "n2")
    all_resolved(live, on_n0[1:])
    live.wait_ticks(ENGINE, 3)
    rows = rows_of(live, on_n0 + on_n1)
    assert rows == [
        ("checkpoint", "skipped", "gpt"),
        ("isolate_node", "succeeded", "n0"),
        ("isolate_node", "skipped", "n1"),
        ("restart_job", "succeeded", "gpt"),
    ], rows
    refusal = [a for a in actions(live) if a["kind"] == "isolate_node" and a["target"] == "n1"]
    assert "circuit breaker" in refusal[0]["outcome"], refusal
    assert [p.nodes for p in actuator.restarts()] == [("n2", "n1")]
    engine = live.controller.remediation
    assert all(engine.decided[i] == "batched, isolation refused" for i in on_n1)
    assert not any(resolved(live, i) for i in on_n1)  # left for a human
    assert any(i.kind == "quarantine_budget" for i in live.controller.state.incidents.values())


def test_a_job_dry_run_plans_both_nodes_once(  # type: ignore[no-untyped-def]
    controller_factory, tmp_path: Path
) -> None:
    """One approval row naming n0 and n1; approved, it isolates both and restarts once."""
    live, agents, actuator, on_n0, on_n1 = two_slow_nodes(
        controller_factory, tmp_path, dry_run=True
    )
    enable(live, policy(max_isolated_fraction=0.5))
    triggers = {f"incident:{i}" for i in on_n0 + on_n1}

    def plans() -> list[dict[str, Any]]:
        return [a for a in actions(live) if a["kind"] == "approval" and a["trigger"] in triggers]

    (plan,) = wait_for(plans)
    engine = live.controller.remediation
    wait_for(lambda: all(r.state != "running" for r in engine.remediations))
    live.wait_ticks(ENGINE, 3)  # n1's incidents were looked at again: no plan of their own
    assert len(plans()) == 1 and actuator.acts() == []
    assert plan["params"]["nodes"] == ["n0", "n1"], plan
    would = [a["outcome"] for a in actions(live) if a["status"] == "dry_run"]
    assert "would isolate n0" in would and "would isolate n1" in would, would
    # The would-be restart plans without both, as the approved one will.
    assert any(w.startswith("would restart: same_size") and "on n2, n3" in w for w in would)
    on_loop(live, engine.approve(plan["id"], "alice"))
    resumed(live, agents, "n2")
    all_resolved(live, on_n0[1:] + on_n1)
    live.wait_ticks(ENGINE, 2)
    assert len(plans()) == 1 and [p.nodes for p in actuator.restarts()] == [("n2", "n3")]
    assert [a for m, a in actuator.acts() if m == "isolate_node"] == ["n0", "n1"]
