"""Fault patterns over time: what an operator sees when faults overlap, flap or fade.

The other remediation tests pin single mechanisms (a planner rule, a guard, one step's
error handling, a failover). This module sweeps *timelines*: a second fault while the
first one's remediation is still inside a step, the spare failing right after it was
chosen, shrinking until the job's elastic minimum, a flapping node against the isolation
budget, two jobs on one failing node, a straggler that goes away before its persistence
window ends, a restart the actuator refuses for good. Each test states the outcome an
operator relies on (one restart, never below the minimum, a refusal that says why,
nothing done at all) rather than how the engine gets there.

The pure planner and guards are driven with plain data where the timeline is a sequence
of plans; the live controller (``controller_factory`` with a recording actuator) only
where the engine's sequencing of concurrent remediations is the point. Patterns already
pinned elsewhere are not repeated: a fault on the replacement node before the job resumed
(``test_engine_replacement.py``), two faults together before the engine looks
(``test_concurrent_faults.py``), leader failover mid-remediation (``test_failover.py``),
a NaN with no clean checkpoint (``test_engine.py``), retried actuator errors
(``test_engine_actuator_errors.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from controller.actuators.base import Placement
from controller.logic.remediation.guards import circuit_breaker
from controller.logic.remediation.planner import plan_restart
from controller.logic.remediation.rules import Guards
from controller.services.remediation.steps import isolate as isolate_step
from tests import http_calls
from tests.remediation.recording import GatedIsolation, RecordingActuator
from tests.remediation.test_engine import (
    ENGINE,
    actions,
    fleet,
    live_test,
    nodes,
    of,
    on_loop,
    open_incident,
    ranks_started,
    recording,
    remediation_over,
    straggler_evidence,
    two_jobs_on_n1,
)
from tests.remediation.test_engine_actuator_errors import FlakyActuator
from tests.waiting import wait_for


def job(nodes: str, *, rpn: int = 1, generation: int = 0) -> Placement:
    return Placement(
        job="gpt", nodes=tuple(nodes.split()), ranks_per_node=rpn, tp=1, generation=generation
    )


# --------------------------------------------------------------------- planner timelines


def test_the_spare_failing_right_after_it_was_chosen_never_brings_back_the_culprit() -> None:
    """b fails: the spare s takes its slot. s fails before the job resumed: the next plan
    starts from generation 1 (where the actuator put the job) and leaves out both, so with
    no spare left the job shrinks; it never goes back to b."""
    first = plan_restart(job("a b c"), ["a", "b", "c", "s"], {"b"})
    assert first.kind == "same_size" and first.replaced == {"b": "s"}
    assert first.placement is not None and first.placement.nodes == ("a", "s", "c")
    second = plan_restart(first.placement, ["a", "b", "c", "s"], {"b", "s"})
    assert second.kind == "shrink" and second.placement is not None
    assert second.placement.nodes == ("a", "c") and second.placement.generation == 2
    assert second.dropped == ["s"]


def test_shrinking_stops_at_the_elastic_minimum_and_the_refusal_names_it() -> None:
    """No spares, min_dp 3: the first loss shrinks 4 -> 3 nodes, the second is refused
    (not 2 nodes, below the minimum) with a reason an operator can act on."""
    pool = ["a", "b", "c", "d"]
    first = plan_restart(job("a b c d"), pool, {"b"}, min_dp=3)
    assert first.kind == "shrink" and first.placement is not None
    assert first.placement.dp == 3
    second = plan_restart(first.placement, pool, {"b", "c"}, min_dp=3)
    assert second.kind == "refused" and second.placement is None
    assert second.reason == (
        "job 'gpt' needs at least 3 healthy nodes (min_dp=3, tp=1, 1 ranks per node); "
        "2 available: a, d"
    )


def test_a_shrink_that_must_divide_the_batch_skips_sizes_but_not_the_minimum() -> None:
    """4 nodes, batch 8, min_dp 2: losing c cannot run dp 3 (8 % 3), so it runs dp 2 and
    d, healthy, leaves the job. d is then the spare when a fails (same size again); when b
    fails too, dp 1 < min_dp: refused, not shrunk."""
    pool = ["a", "b", "c", "d"]
    first = plan_restart(job("a b c d"), pool, {"c"}, min_dp=2, dp_must_divide=8)
    assert first.kind == "shrink" and first.placement is not None
    assert first.placement.nodes == ("a", "b") and first.dropped == ["c", "d"]
    second = plan_restart(first.placement, pool, {"c", "a"}, min_dp=2, dp_must_divide=8)
    assert second.kind == "same_size" and second.replaced == {"a": "d"}
    assert second.placement is not None
    third = plan_restart(second.placement, pool, {"c", "a", "b"}, min_dp=2, dp_must_divide=8)
    assert third.kind == "refused" and third.placement is None
    assert third.reason.startswith("job 'gpt' needs at least 2 healthy nodes")
    assert third.reason.endswith("1 available: d")


# --------------------------------------------------------------------- guard timelines


NODES8: list[str] = [f"n{i}" for i in range(1, 9)]


def test_a_flapping_node_against_the_isolation_budget() -> None:
    """8 nodes, 25 % within an hour: 2 isolations. n1 flaps (isolated, released, faulty
    again): the released isolation no longer counts, so it may be isolated again. Once 2
    nodes are isolated within the window a third is refused with the numbers; an isolation
    older than the window does not count."""
    g = Guards(max_isolated_fraction=0.25, isolation_window_s=3600.0)
    # t=0 n1 isolated; t=100 released by an operator; t=200 faulty again.
    assert (
        circuit_breaker(
            "n1", isolated_since=dict.fromkeys(NODES8), known_nodes=8, now_unix_s=200, guards=g
        )
        is None
    )
    since = {**dict.fromkeys(NODES8), "n1": 200.0, "n2": 300.0}  # n1 again, then n2
    refused = circuit_breaker("n3", isolated_since=since, known_nodes=8, now_unix_s=400, guards=g)
    assert refused == (
        "circuit breaker open: isolating n3 would make 3 of 8 nodes isolated within 3600 s "
        "(limit 25% = 2)"
    )
    later = circuit_breaker("n3", isolated_since=since, known_nodes=8, now_unix_s=3801, guards=g)
    assert later is None  # n1's isolation left the window


# --------------------------------------------------------------------- live timelines

POLICY = (
    "rules:\n"
    "  - {kind: gpu_fault, severity: critical, steps: [checkpoint, isolate, restart]}\n"
    "  - {kind: '*', steps: [alert]}\n"
    "guards: {max_isolated_fraction: 0.5, checkpoint_timeout_s: 2, settle_s: 0,\n"
    "         resume_timeout_s: 1}\n"
)


def incident_on(live: Any, node: str, kind: str = "gpu_fault") -> int:
    return int(
        wait_for(
            lambda: next(
                (
                    i.id
                    for i in live.controller.state.incidents.values()
                    if i.node == node and i.kind == kind
                ),
                None,
            )
        )
    )


@live_test
@pytest.mark.parametrize("during", ["checkpoint", "isolate"])
def test_a_second_fault_while_the_first_remediation_runs_restarts_the_job_once(  # type: ignore[no-untyped-def]
    controller_factory, tmp_path: Path, during: str
) -> None:
    """gpt runs on n0 n1 n2. An XID on n1 starts checkpoint, isolate, restart; an XID on n2
    arrives while that remediation waits for its protective checkpoint (which times out) or
    sits in the actuator's isolate call. The job is restarted once, without both nodes;
    the second incident isolates n2 and says the job already restarted without it."""
    live, agents = fleet(controller_factory, tmp_path, POLICY, 6, quarantine_budget_share=0.5)
    actuator = GatedIsolation(
        placements={"gpt": job("n0 n1 n2", rpn=2)}, pools={"gpt": [f"n{i}" for i in range(6)]}
    )
    if during == "checkpoint":
        actuator.gate.set()
    live.controller.remediation.actuator = actuator
    ranks_started(agents, "gpt", ("n0", "n1", "n2"))
    agents.report("n1", xid=79)
    first = incident_on(live, "n1")
    if during == "checkpoint":
        wait_for(lambda: [a for a in of(live, first) if a["kind"] == "checkpoint"])
    else:
        wait_for(lambda: ("isolate_node", "n1") in actuator.acts())
    agents.report("n2", xid=79)
    second = incident_on(live, "n2")
    rows = of(live, first)
    if during == "checkpoint":  # the second fault did arrive inside the checkpoint's wait
        assert [(a["kind"], a["status"]) for a in rows] == [("checkpoint", "pending")], rows
    else:
        assert [a["kind"] for a in rows][-1] == "isolate_node", rows
    actuator.gate.set()
    remediation_over(live, first)
    remediation_over(live, second)
    live.wait_ticks(ENGINE, 2)
    assert [p.nodes for p in actuator.restarts()] == [("n0", "n3", "n4")]
    assert {n for n, node in nodes(live).items() if node["isolated_reason"]} == {"n1", "n2"}
    restart = [a for a in of(live, second) if a["kind"] == "restart_job"]
    assert [a["status"] for a in restart] == ["skipped"], restart
    assert restart[0]["outcome"].startswith("job gpt already restarted without n2")


@live_test
def test_two_jobs_on_one_failing_node_are_each_restarted_once(  # type: ignore[no-untyped-def]
    controller_factory, tmp_path: Path
) -> None:
    live, agents, actuator = two_jobs_on_n1(
        controller_factory, tmp_path, "isolate, restart", RecordingActuator
    )
    agents.report("n1", xid=79)
    incident = incident_on(live, "n1")
    remediation_over(live, incident)
    live.wait_ticks(ENGINE, 2)
    restarts = sorted((p.job, p.nodes, p.generation) for p in actuator.restarts())
    assert restarts == [("ja", ("n0", "n3"), 1), ("jb", ("n4", "n2"), 1)]
    assert [a for a in actuator.acts() if a[0] == "isolate_node"] == [("isolate_node", "n1")]
    rows = sorted(
        (a["target"], a["status"]) for a in of(live, incident) if a["kind"] == "restart_job"
    )
    assert rows == [("ja", "succeeded"), ("jb", "succeeded")]


@live_test
def test_a_straggler_gone_before_its_persistence_window_ends_is_only_alerted(  # type: ignore[no-untyped-def]
    controller_factory, tmp_path: Path
) -> None:
    policy = (
        "rules:\n"
        "  - {kind: straggler, steps: [alert, checkpoint, isolate, restart], after_s: 60,\n"
        "     min_cost_pct: 10}\n"
        "  - {kind: '*', steps: [alert]}\n"
    )
    live, _agents = fleet(controller_factory, tmp_path, policy, 3)
    actuator = recording(live, nodes=("n0", "n1"), pool=["n0", "n1", "n2"])
    incident = open_incident(live, "straggler", node="n1", evidence=straggler_evidence(40.0))
    alert = wait_for(lambda: of(live, incident))
    assert [(a["kind"], a["status"]) for a in alert] == [("alert", "succeeded")]
    assert "then checkpoint, isolate, restart if it persists 60 s" in alert[0]["outcome"]
    state = live.controller.state.incidents[incident]
    on_loop(live, live.controller.incidents.resolve(state, note="straggler went away"))
    live.wait_ticks(ENGINE, 3)
    assert [a["kind"] for a in of(live, incident)] == ["alert"]
    assert actuator.acts() == []
    assert not any(r.incident_id == incident for r in live.controller.remediation.remediations)


@live_test
def test_a_restart_refused_for_good_leaves_the_incident_open_and_is_not_retried(  # type: ignore[no-untyped-def]
    controller_factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(isolate_step, "ACTUATOR_BACKOFF_S", (0.05, 0.1))
    policy = (
        "rules:\n  - {kind: gpu_fault, severity: critical, steps: [isolate, restart]}\n"
        "guards: {max_isolated_fraction: 0.5, settle_s: 0}\n"
    )
    live, _agents = fleet(controller_factory, tmp_path, policy, 4)
    actuator = FlakyActuator(
        placements={"gpt": job("n0 n1", rpn=2)}, pools={"gpt": ["n0", "n1", "n2"]}
    )
    actuator.fail = {"restart_job": (100, True)}
    live.controller.remediation.actuator = actuator
    incident = open_incident(live, "gpu_fault", node="n1", severity="critical")
    remediation_over(live, incident)
    live.wait_ticks(ENGINE, 3)
    rows = [a for a in of(live, incident) if a["kind"] == "restart_job"]
    assert [(a["status"], a["outcome"]) for a in rows] == [
        ("failed", "gave up after 3 attempts; last error (retryable): restart_job boom 3")
    ]
    assert actuator.tries["restart_job"] == 3 and actuator.restarts() == []
    [rem] = [r for r in live.controller.remediation.remediations if r.incident_id == incident]
    assert rem.state == "failed" and "gave up after 3 attempts" in rem.outcome
    assert incident in live.controller.state.incidents  # still open: a human decides


@live_test
def test_no_spare_at_the_elastic_minimum_refuses_the_restart_and_says_why(  # type: ignore[no-untyped-def]
    controller_factory, tmp_path: Path
) -> None:
    policy = (
        "rules:\n  - {kind: gpu_fault, severity: critical, steps: [isolate, restart]}\n"
        "guards: {max_isolated_fraction: 0.5, settle_s: 0}\n"
        "restarts: {min_dp: 4}\n"
    )
    live, _agents = fleet(controller_factory, tmp_path, policy, 4)
    actuator = recording(live, nodes=("n0", "n1"), pool=["n0", "n1"])
    incident = open_incident(live, "gpu_fault", node="n1", severity="critical")
    remediation_over(live, incident)
    live.wait_ticks(ENGINE, 2)
    rows = [(a["kind"], a["status"], a["outcome"]) for a in of(live, incident)]
    assert rows[0][:2] == ("isolate_node", "succeeded")
    assert rows[1] == (
        "restart_job",
        "failed",
        "job 'gpt' needs at least 2 healthy nodes (min_dp=4, tp=1, 2 ranks per node); "
        "1 available: n0",
    )
    assert len(rows) == 2 and actuator.restarts() == []
    [rem] = [r for r in live.controller.remediation.remediations if r.incident_id == incident]
    assert rem.state == "failed" and "needs at least 2 healthy nodes" in rem.outcome
    assert incident in live.controller.state.incidents
    assert len([a for a in actions(live) if a["kind"] == "restart_job"]) == 1


@live_test
def test_a_repeat_offender_refused_by_the_circuit_breaker_is_said_and_restarted_in_place(  # type: ignore[no-untyped-def]
    controller_factory, tmp_path: Path
) -> None:
    """4 nodes, 25 %: one isolation allowed, and an operator already used it (n3). n1's
    rank crashes: first offence, not isolated, restarted in place. It crashes again after
    that restart's resume wait ended (a repeat offender within the window; a crash during
    the wait is absorbed as the restart's consequence): the isolation is refused by the
    circuit breaker
    with the numbers, n1 stays in service, and the job is restarted (the restart budget,
    not the breaker, bounds the loop)."""
    policy = (
        "rules:\n"
        "  - {kind: rank_crash, steps: [isolate, restart], isolate_when: hardware_or_repeat}\n"
        "  - {kind: '*', steps: [alert]}\n"
        "guards: {max_isolated_fraction: 0.25, settle_s: 0, resume_timeout_s: 1}\n"
    )
    live, _agents = fleet(controller_factory, tmp_path, policy, 4)
    op = http_calls.client(base_url=live.url, headers=live.headers("operator"), timeout=10)
    assert op.post("/api/v1/nodes/n3/isolate", json={"reason": "bad fan"}).status_code == 200
    actuator = recording(live, nodes=("n0", "n1"), pool=["n0", "n1", "n2", "n3"])
    first = open_incident(live, "rank_crash", node="n1")
    remediation_over(live, first)
    isolate = [a for a in of(live, first) if a["kind"] == "isolate_node"]
    assert [a["outcome"] for a in isolate] == [
        "not isolating n1: no hardware evidence and its first offence in 3600 s"
    ]
    # Its restart never resumes; a crash before its timeout would be absorbed as the
    # restart's consequence, so the repeat comes after it.
    wait_for(
        lambda: [
            a
            for a in of(live, first)
            if a["kind"] == "restart_job" and "resume_failed" in a["params"]
        ]
    )
    second = open_incident(live, "rank_crash", node="n1")
    remediation_over(live, second)
    live.wait_ticks(ENGINE, 2)
    isolate = [a for a in of(live, second) if a["kind"] == "isolate_node"]
    assert [(a["status"], a["outcome"]) for a in isolate] == [
        (
            "skipped",
            "circuit breaker open: isolating n1 would make 2 of 4 nodes isolated within "
            "3600 s (limit 25% = 1)",
        )
    ]
    assert nodes(live)["n1"]["isolated_reason"] is None
    assert [(p.nodes, p.generation) for p in actuator.restarts()] == [
        (("n0", "n1"), 1),
        (("n0", "n1"), 2),
    ]
