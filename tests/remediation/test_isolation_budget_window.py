"""The isolation budgets count every node remediation isolated within their window.

``guards.max_isolated_fraction`` (the policy's circuit breaker) and the quarantine budget
say "never isolate more than this share of the known nodes within the window". They used
to count only the nodes isolated *now*, so a fleet whose nodes flap (isolated, released by
an operator or a repair flow, then another one isolated) could be drained far beyond the
share within one window. Pinned here: released isolations made by remediation count until
they leave the window (each node once), an operator's isolation by hand counts only while
it lasts, the count survives a controller restart (it is read from the action rows), and two
isolations racing each other cannot both slip under the limit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from controller.logic.detection.incident_evidence import QuarantineBudgetEvidence
from controller.logic.remediation.guards import circuit_breaker
from controller.logic.remediation.rules import Guards
from tests import http_calls
from tests.remediation.recording import GatedIsolation
from tests.remediation.test_engine import (
    ENGINE,
    fleet,
    incidents_of,
    live_test,
    nodes,
    of,
    open_incident,
    remediation_over,
)
from tests.waiting import wait_for

#: Isolate the culprit of a critical GPU fault, nothing else (no job runs here).
ISOLATE_ONLY = "rules:\n  - {kind: gpu_fault, severity: critical, steps: [isolate]}\n"


def test_released_isolations_within_the_window_still_count() -> None:
    """8 nodes, 25 %: 2 per hour. n1 and n2 were isolated by remediation and released; n3
    is refused, naming the released ones. Re-isolating n1 adds no node (it is counted
    already). An hour after them, n3 is allowed again."""
    g = Guards(max_isolated_fraction=0.25, isolation_window_s=3600.0)
    now: dict[str, float | None] = {f"n{i}": None for i in range(8)}
    history = [("n1", 100.0), ("n2", 200.0)]
    refused = circuit_breaker(
        "n3", isolated_since=now, known_nodes=8, now_unix_s=400, guards=g, history=history
    )
    assert refused == (
        "circuit breaker open: isolating n3 would make 3 of 8 nodes isolated within 3600 s "
        "(limit 25% = 2); counted though not isolated now: n1, n2"
    )
    again = circuit_breaker(
        "n1", isolated_since=now, known_nodes=8, now_unix_s=400, guards=g, history=history
    )
    assert again is None
    later = circuit_breaker(
        "n3", isolated_since=now, known_nodes=8, now_unix_s=3801, guards=g, history=history
    )
    assert later is None


def _release(live: Any, node: str) -> None:
    op = http_calls.client(base_url=live.url, headers=live.headers("operator"), timeout=10)
    assert op.post(f"/api/v1/nodes/{node}/release").status_code == 200


def _fault(live: Any, node: str) -> int:
    incident = open_incident(live, "gpu_fault", job=None, node=node, severity="critical")
    remediation_over(live, incident)
    return incident


def _isolation(live: Any, incident: int) -> tuple[str, str]:
    [row] = [a for a in of(live, incident) if a["kind"] == "isolate_node"]
    return row["status"], row["outcome"]


@pytest.mark.usefixtures("fast_remediation_engine")
def test_a_flapping_fleet_cannot_drain_more_than_the_share_also_after_a_restart(
    controller_factory: Any, tmp_path: Path
) -> None:
    """8 nodes, 25 % per hour: 2. An operator isolates n7 by hand and releases it (not
    remediation's: it no longer counts). Remediation isolates n1, an operator releases it;
    then n2, released too. Before, nothing was isolated any more, so n3, n4 … would each be
    isolated in turn. Now n3 is refused: n1 and n2 still count. The controller restarts
    (a new leader): n4 is refused too, the count read back from the action rows."""
    policy = ISOLATE_ONLY + "guards: {max_isolated_fraction: 0.25}\n"
    live, _agents = fleet(controller_factory, tmp_path, policy, 8, quarantine_budget_share=0.5)
    op = http_calls.client(base_url=live.url, headers=live.headers("operator"), timeout=10)
    assert op.post("/api/v1/nodes/n7/isolate", json={"reason": "fan"}).status_code == 200
    _release(live, "n7")
    for node in ("n1", "n2"):
        incident = _fault(live, node)
        assert _isolation(live, incident) == ("succeeded", f"{node} isolated")
        _release(live, node)
    assert not any(n["isolated_reason"] for n in nodes(live).values())
    refused = _fault(live, "n3")
    assert _isolation(live, refused) == (
        "skipped",
        "circuit breaker open: isolating n3 would make 3 of 8 nodes isolated within 3600 s "
        "(limit 25% = 2); counted though not isolated now: n1, n2",
    )
    assert nodes(live)["n3"]["isolated_reason"] is None
    live.restart()
    live.wait_ticks(ENGINE, 2)
    after = _fault(live, "n4")
    status, outcome = _isolation(live, after)
    assert status == "skipped" and outcome.startswith(
        "circuit breaker open: isolating n4 would make 3 of 8 nodes isolated"
    )
    assert nodes(live)["n4"]["isolated_reason"] is None


@live_test
def test_the_quarantine_budget_counts_released_quarantines_and_still_raises_its_incident(
    controller_factory: Any, tmp_path: Path
) -> None:
    """10 nodes, quarantine budget 10 %: one per hour (the policy's breaker allows 5). n5
    is quarantined and released; n6's fault is refused by the budget (before: n6 was
    quarantined, the fleet drained twice the budget), with the critical
    ``quarantine_budget`` incident for a human."""
    policy = ISOLATE_ONLY + "guards: {max_isolated_fraction: 0.5}\n"
    live, _agents = fleet(controller_factory, tmp_path, policy, 10)
    first = _fault(live, "n5")
    assert _isolation(live, first) == ("succeeded", "n5 isolated")
    _release(live, "n5")
    second = _fault(live, "n6")
    status, outcome = _isolation(live, second)
    assert status == "skipped", outcome
    assert outcome.startswith(
        "quarantine budget spent: quarantining n6 would make 2 of 10 nodes quarantined"
    )
    assert outcome.endswith("; counted though not isolated now: n5")
    assert nodes(live)["n6"]["isolated_reason"] is None
    budget = wait_for(lambda: incidents_of(live, "quarantine_budget"))
    assert len(budget) == 1 and budget[0].severity == "critical"
    evidence = budget[0].evidence
    assert isinstance(evidence, QuarantineBudgetEvidence)
    assert evidence.refused_node == "n6" and evidence.quarantined_in_window == 1


@live_test
def test_two_isolations_at_once_cannot_both_pass_the_breaker(
    controller_factory: Any, tmp_path: Path
) -> None:
    """4 nodes, 25 %: one. n1's isolation is inside the actuator's call when n2's fault
    arrives. Before, n2's check saw no node isolated yet (n1's is recorded only once the
    actuator answers) and both were isolated; now n1's ``pending`` isolation counts."""
    policy = ISOLATE_ONLY + "guards: {max_isolated_fraction: 0.25}\n"
    live, _agents = fleet(controller_factory, tmp_path, policy, 4, quarantine_budget_share=0.5)
    actuator = GatedIsolation(placements={}, pools={})
    live.controller.remediation.actuator = actuator
    try:
        first = open_incident(live, "gpu_fault", job=None, node="n1", severity="critical")
        wait_for(lambda: ("isolate_node", "n1") in actuator.calls)
        second = open_incident(live, "gpu_fault", job=None, node="n2", severity="critical")
        rows = wait_for(lambda: [a for a in of(live, second) if a["kind"] == "isolate_node"])
    finally:
        actuator.gate.set()
    remediation_over(live, first)
    remediation_over(live, second)
    assert [(a["status"], a["outcome"]) for a in rows] == [
        (
            "skipped",
            "circuit breaker open: isolating n2 would make 2 of 4 nodes isolated within "
            "3600 s (limit 25% = 1); counted though not isolated now: n1",
        )
    ]
    assert ("isolate_node", "n2") not in actuator.calls
    assert {n for n, node in nodes(live).items() if node["isolated_reason"]} == {"n1"}


@live_test
def test_the_circuit_breaker_holding_an_isolation_back_raises_the_budget_incident(
    controller_factory: Any, tmp_path: Path
) -> None:
    """8 nodes, the breaker allows 2 (the quarantine budget 4): n3's isolation is refused
    by the breaker, and a human hears of it through the critical ``quarantine_budget``
    incident (``budget: circuit_breaker``); before, the refusal was a skipped row only."""
    policy = ISOLATE_ONLY + "guards: {max_isolated_fraction: 0.25}\n"
    live, _agents = fleet(controller_factory, tmp_path, policy, 8, quarantine_budget_share=0.5)
    for node in ("n1", "n2"):
        assert _isolation(live, _fault(live, node))[0] == "succeeded"
    status, outcome = _isolation(live, _fault(live, "n3"))
    assert status == "skipped" and outcome.startswith("circuit breaker open: isolating n3")
    (budget,) = wait_for(lambda: incidents_of(live, "quarantine_budget"))
    evidence = budget.evidence
    assert isinstance(evidence, QuarantineBudgetEvidence)
    assert evidence.budget == "circuit_breaker" and evidence.refused_node == "n3"
    assert (evidence.quarantined_in_window, evidence.limit, evidence.fleet) == (2, 2, 8)
    assert budget.severity == "critical" and budget.summary == outcome
